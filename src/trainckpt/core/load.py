"""Loading a checkpoint on every rank: the checks against its manifest, the trainer state, then
the model state (DCP), in that order. `Checkpointer.load` calls `load_checkpoint` once.

The manifest is read once per load, by rank 0 (with the check of the files against it, or alone
when `verify_on_load="none"` and the saved world size is needed); every rank gets rank 0's copy,
so a load from an object store makes one manifest request per job, not one per rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainckpt.core import dist
from trainckpt.core.cuda_calls import CudaCalls
from trainckpt.core.gc_pause import paused_gc
from trainckpt.core.self_saving_module import load_direct, loads_directly
from trainckpt.core.trainer_tensors import on_rank_device
from trainckpt.errors import CheckpointNotFoundError, ConfigurationError
from trainckpt.format import folder as save_folder
from trainckpt.format import layout
from trainckpt.format.records import CheckpointManifest
from trainckpt.format.trainer_state import (
    DEFAULT_MAX_BYTES,
    deserialize_trainer_state,
    read_trainer_state,
)
from trainckpt.format.verify import (
    VerifyReport,
    check_crcs,
    check_loaded_file,
    verify_checkpoint,
)
from trainckpt.storage import LocalStorage, Storage

log = logging.getLogger(__name__)

VerifyOnLoad = Literal["none", "size", "full"]


@dataclass(frozen=True)
class LoadRequest:
    """One load: where from, on which group, how it is checked and read."""

    storage: Storage
    dir: str
    group: dist.ProcessGroup | None
    verify: VerifyOnLoad
    work_dir: Path
    pre_download: bool
    thread_count: int
    max_trainer_state_bytes: int = DEFAULT_MAX_BYTES
    cuda: CudaCalls = field(default_factory=CudaCalls)
    """Puts trainer-state tensors saved from a GPU on the rank's device (`trainer_tensors.py`)."""


@dataclass(frozen=True)
class ManifestFacts:
    """What a load takes from the manifest, as rank 0 read it."""

    manifest: CheckpointManifest | None
    """To check the files read whole against (None at level `none`, or without a manifest)."""
    saved_world_size: int | None
    """The number of ranks that saved the checkpoint; None when unknown (no manifest)."""


def load_checkpoint(
    req: LoadRequest,
    train_module: Any,
    *,
    load_trainer_state: bool | None,
    load_optim_state: bool | None,
    reset_optimizer_states_on_load: bool | None,
    exclude: Sequence[str],
) -> dict[str, Any] | None:
    """Load the checkpoint `req.dir` into `train_module` (a `TrainModule`, or a module with
    OLMo-core's direct API); return this rank's trainer state (see `Checkpointer.load`).

    Called on: all ranks.
    """
    start = time.perf_counter()
    storage, path, group = req.storage, req.dir, req.group
    folder = save_folder.dcp_folder(storage, path)
    # 1. Rank 0 reads the manifest and checks the files against it; every rank gets its copy.
    facts = check_before_load(storage, path, req.verify, group)

    # 2. Each rank reads its own trainer state (rank 0's when the world size changed).
    trainer_state = None
    if load_trainer_state is not False:
        if req.verify == "none":  # not read by the check: rank 0 reads the world size alone
            facts = dist.run_on_rank0(
                lambda: ManifestFacts(None, save_folder.saved_world_size(storage, path)),
                f"reading the manifest of '{path}'",
                group,
            )
        error: Exception | None = None
        try:
            trainer_state = _load_trainer_state(req, facts, required=bool(load_trainer_state))
        except Exception as e:  # each rank reads its own file: a failure may be one rank's
            error = e
        dist.agree(error, f"reading the trainer state of '{path}'", group)

    # 3. The DCP folder's metadata (trainckpt's own record, or `.metadata` read with the
    #    allow-list), then the model state.
    if load_optim_state is None and layout.parse_step(storage.name(path)) == 0:
        log.info("'%s' is a step-0 (seed) checkpoint: loading model weights only", path)
        load_optim_state = False
    from trainckpt.format.dcp_metadata import (  # imported on first use: slow to import
        native_record_current,
        read_dcp_metadata,
    )

    md_prefix = "" if folder == path else f"{storage.name(folder)}/"
    direct = loads_directly(train_module)
    # One pause from the metadata to the applied state (see gc_pause): the metadata, the plan
    # and the flat state (hundreds of thousands of small objects) are freed before collection
    # resumes, so it does not walk them (it did, twice, between the steps: a fifth of a load).
    with paused_gc():
        metadata = read_dcp_metadata(  # refuses unsafe or misplaced metadata, direct API too
            storage,
            folder,
            check=lambda name, data, at: check_loaded_file(
                facts.manifest, f"{md_prefix}{name}", data, at
            ),
            native=native_record_current(storage, folder, facts.manifest, md_prefix),
        )
        if not direct:
            if reset_optimizer_states_on_load:
                log.warning(
                    "reset_optimizer_states_on_load=True has no effect on %s (only train "
                    "modules with load_state_dict_direct reset optimizer state, as in "
                    "OLMo-core)",
                    type(train_module).__name__,
                )
            trainer_state = _load_module_state(
                req, folder, metadata, train_module, trainer_state, load_optim_state, exclude
            )
        del metadata
    if direct:
        if reset_optimizer_states_on_load is None and trainer_state is not None:
            reset_optimizer_states_on_load = getattr(
                train_module, "reset_optimizer_states_on_resume", None
            )
        trainer_state = _exclude({}, trainer_state, exclude, path)
        load_direct(
            train_module,
            folder,
            group=group,
            pre_download=req.pre_download and not isinstance(storage, LocalStorage),
            work_dir=req.work_dir,
            thread_count=req.thread_count,
            load_optim_state=load_optim_state,
            reset_optimizer_states_on_load=reset_optimizer_states_on_load,
        )
    log.info("loaded checkpoint '%s' in %.2fs", path, time.perf_counter() - start)
    return trainer_state


def check_before_load(
    storage: Storage, path: str, level: VerifyOnLoad, group: dist.ProcessGroup | None
) -> ManifestFacts:
    """Refuse to load a checkpoint whose files do not match its manifest; return what the
    load needs of the manifest (nothing at level `none`, or when there is no manifest).

    `size`: rank 0 reads the manifest, compares one listing with it and tells every rank the
    outcome with the manifest. `full`: after that, every rank recomputes the CRC32C of its
    share of the files and all ranks agree on the result. Raises `CorruptCheckpointError` on
    every rank, naming the files.
    Called on: all ranks.
    """
    if level == "none":
        return ManifestFacts(None, None)
    report = dist.run_on_rank0(
        lambda: verify_checkpoint(storage, path), f"checking '{path}' before loading", group
    )
    report.raise_if_bad()
    if report.unverifiable:
        log.info(
            "'%s' has no %s; loading it without checking its files", path, layout.MANIFEST_FILE
        )
        return ManifestFacts(None, None)
    manifest = report.manifest
    assert manifest is not None  # a readable manifest, or the report had a problem
    if level == "full":
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        mine = sorted(manifest.files.items())[rank::world]
        problems: list[str] = []
        error: Exception | None = None
        try:
            problems = check_crcs(storage, path, mine)
        except Exception as e:  # shared below, so no rank waits for one that gave up
            error = e
        dist.agree(error, f"checking the CRC32C of the files of '{path}'", group)
        everyone = [p for part in dist.all_gather_object(problems, group) for p in part]
        VerifyReport(path=path, deep=True, problems=sorted(everyone)).raise_if_bad()
    return ManifestFacts(manifest, manifest.world_size)


def _load_trainer_state(req: LoadRequest, facts: ManifestFacts, *, required: bool) -> dict | None:
    """This rank's trainer state; rank 0's when the checkpoint was saved by another number
    of ranks (per-rank state such as data positions does not carry over rank by rank).
    Called on: each rank, for itself."""
    storage, path, group = req.storage, req.dir, req.group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    own = storage.join(path, layout.trainer_state_file(rank))
    rank0 = storage.join(path, layout.trainer_state_file(0))
    saved_world = facts.saved_world_size
    candidates = [(own, rank), (rank0, 0)]
    if saved_world is not None and saved_world != world:
        candidates = [(rank0, 0)]
        log.warning(
            "'%s' was saved by %d ranks and is loaded by %d: every rank gets rank 0's "
            "trainer state '%s'",
            path,
            saved_world,
            world,
            rank0,
        )
    for candidate, of_rank in candidates:
        try:
            data = read_trainer_state(storage, candidate, req.max_trainer_state_bytes)
        except FileNotFoundError:
            continue
        check_loaded_file(facts.manifest, layout.trainer_state_file(of_rank), data, candidate)
        if candidate != own and saved_world is None:
            log.warning(
                "'%s' not found (the checkpoint was saved with another world size); "
                "using rank 0's trainer state '%s'",
                own,
                rank0,
            )
        return deserialize_trainer_state(data, candidate, on_rank_device(req.cuda))
    if required:
        raise CheckpointNotFoundError(
            f"no trainer state in '{path}' (looked for '{own}' and '{rank0}'); pass "
            "load_trainer_state=False to load model and optimizer state only"
        )
    return None


def _load_module_state(
    req: LoadRequest,
    folder: str,
    metadata: Any,
    train_module: Any,
    trainer_state: dict[str, Any] | None,
    load_optim_state: bool | None,
    exclude: Sequence[str],
) -> dict[str, Any] | None:
    """Load the checkpoint's DCP folder into the module's state dict and apply it; return
    the trainer state without the `exclude`d keys. Called on: all ranks."""
    from trainckpt.core.dcp import load_state

    with paused_gc():  # thousands of entries: see gc_pause
        state = train_module.state_dict_to_load(metadata, optim=load_optim_state)
        trainer_state = _exclude(state, trainer_state, exclude, req.dir)
        load_state(
            state,
            req.storage,
            folder,
            metadata,
            group=req.group,
            download_to=req.work_dir / "download-cache" if req.pre_download else None,
            thread_count=req.thread_count,
            check_items=req.verify != "none",
        )
        train_module.load_state_dict(state)
    return trainer_state


def _exclude(
    state: dict[str, Any], trainer_state: dict[str, Any] | None, names: Sequence[str], path: str
) -> dict[str, Any] | None:
    """Drop the `names` from the state to load (in place) and from the trainer state."""
    if not names:
        return trainer_state
    known = set(state) | set(trainer_state or {})
    unknown = sorted(set(names) - known)
    if unknown:
        raise ConfigurationError(
            f"exclude names {unknown}, which loading '{path}' does not have; "
            f"known top-level keys: {sorted(known)}"
        )
    for name in names:
        state.pop(name, None)
    if trainer_state is None:
        return None
    return {k: v for k, v in trainer_state.items() if k not in names}
