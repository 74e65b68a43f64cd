"""`trainckpt export`: consolidate a sharded checkpoint into one safetensors or torch file.

The DCP metadata is read with the allow-list unpickler and every value with
`weights_only=True` (`dcp.load_full_state`), so exporting an untrusted checkpoint runs none of
its code. One process, no process group: each tensor is rebuilt at its full size on the CPU.
File sizes are checked against the manifest first. The file is assembled in a temporary folder
and published create-only (unless `overwrite`) through the storage interface, so OUT can be a
local path or an object-store URL.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainckpt.cli.inspect import checkpoint_dcp_folder
from trainckpt.core.dcp import load_full_state
from trainckpt.errors import CheckpointExistsError, CheckpointNotFoundError, ConfigurationError
from trainckpt.format.dcp_metadata import native_record_current, read_dcp_metadata
from trainckpt.format.layout import MANIFEST_FILE
from trainckpt.format.records import read_manifest
from trainckpt.format.verify import Progress, verify_checkpoint
from trainckpt.storage import resolve
from trainckpt.storage.local import writing

log = logging.getLogger(__name__)

ExportFormat = Literal["safetensors", "torch"]
MODEL_PREFIX = "model."
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class ExportResult:
    """What was written: where, how many values, and how many bytes of tensors."""

    out: str
    format: ExportFormat
    tensors: int
    values: int
    nbytes: int


def format_for(out: str, requested: ExportFormat | None) -> ExportFormat:
    """The requested format, else the one OUT's extension names (`.pt`/`.pth`/`.bin`: torch),
    else safetensors."""
    if requested is not None:
        return requested
    return "torch" if out.lower().endswith((".pt", ".pth", ".bin")) else "safetensors"


def export_checkpoint(
    ckpt: str,
    out: str,
    *,
    fmt: ExportFormat,
    dtype: torch.dtype | None = None,
    model_only: bool = True,
    overwrite: bool = False,
    work_dir: Path | None = None,
    progress: Progress | None = None,
    on_total: Callable[[int], None] | None = None,
) -> ExportResult:
    """Write the values of checkpoint `ckpt` to `out` as one file.

    `model_only` keeps the `model.*` values and strips the prefix, so the file loads into the
    plain module with `load_state_dict`; otherwise every value keeps its full DCP key. `dtype`
    converts floating-point tensors only. `on_total` receives the byte count to load before
    loading starts; `progress` the bytes of each loaded piece.
    """
    src_storage, src = resolve(ckpt)
    dst_storage, dst = resolve(out)
    if not dst_storage.writable:  # before any request: a read-only server is not asked
        raise ConfigurationError(
            f"cannot export to '{dst}': that storage is read-only; write to a local path, "
            "gs:// or s3://"
        )
    if not overwrite and dst_storage.exists(dst):
        raise CheckpointExistsError(f"'{dst}' already exists; pass --overwrite to replace it")
    if fmt == "safetensors":
        _require_safetensors()
    folder = checkpoint_dcp_folder(src_storage, src, command="export {} OUT")
    # sizes against the manifest (one listing): a truncated or missing shard is named up front
    verify_checkpoint(src_storage, src).raise_if_bad()
    manifest = None
    if src_storage.exists(src_storage.join(src, MANIFEST_FILE)):
        manifest = read_manifest(src_storage, src)
    prefix = "" if folder == src else f"{src_storage.name(folder)}/"
    native = native_record_current(src_storage, folder, manifest, prefix)
    metadata = read_dcp_metadata(src_storage, folder, native=native)
    prefix = MODEL_PREFIX if model_only else ""
    if not any(k.startswith(prefix) for k in metadata.state_dict_metadata):
        raise CheckpointNotFoundError(
            f"'{src}' holds no '{MODEL_PREFIX}*' values (its keys start with "
            f"{_top_level_keys(metadata.state_dict_metadata)}); pass --all to export every value"
        )
    if on_total is not None:
        on_total(_tensor_bytes(metadata.state_dict_metadata, prefix))
    state = load_full_state(src_storage, folder, metadata, keys_prefix=prefix, progress=progress)
    state = {k[len(prefix) :]: _convert(v, dtype) for k, v in state.items()}
    if fmt == "safetensors":
        _check_tensors_only(state, src)
    with writing(work_dir or tempfile.gettempdir()):
        scratch = tempfile.TemporaryDirectory(prefix="trainckpt-export-", dir=work_dir)
    with scratch as tmp:
        local = Path(tmp) / "export"
        with writing(local):
            _write(state, local, fmt, src)
        try:
            dst_storage.upload(local, dst, overwrite=overwrite)
        except FileExistsError as e:
            raise CheckpointExistsError(
                f"'{dst}' already exists; pass --overwrite to replace it"
            ) from e
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    result = ExportResult(
        out=dst,
        format=fmt,
        tensors=len(tensors),
        values=len(state) - len(tensors),
        nbytes=sum(t.numel() * t.element_size() for t in tensors),
    )
    log.info("exported %d tensors from '%s' to '%s'", result.tensors, src, dst)
    return result


def _require_safetensors() -> None:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError as e:
        raise ConfigurationError(
            "writing safetensors needs the 'safetensors' package: `pip install safetensors`, "
            "or pass --format torch"
        ) from e


def _top_level_keys(md: dict[str, Any]) -> str:
    tops = sorted({k.split(".", 1)[0] for k in md})
    return ", ".join(f"'{t}.'" for t in tops[:5]) or "nothing: it is empty"


def _tensor_bytes(md: dict[str, Any], prefix: str) -> int:
    total = 0
    for key, m in md.items():
        if key.startswith(prefix) and isinstance(m, TensorStorageMetadata):
            total += m.size.numel() * m.properties.dtype.itemsize
    return total


def _convert(value: Any, dtype: torch.dtype | None) -> Any:
    if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def _check_tensors_only(state: dict[str, Any], src: str) -> None:
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ConfigurationError(
                f"'{src}': value '{key}' is a {type(value).__name__}, not a tensor, and "
                "safetensors files hold tensors only; pass --format torch (or export the model "
                "weights only, without --all)"
            )


def _write(state: dict[str, Any], local: Path, fmt: ExportFormat, src: str) -> None:
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(local), metadata={"source": src, "format": "pt"})
    else:
        torch.save(state, local)
