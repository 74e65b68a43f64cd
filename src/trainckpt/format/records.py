"""`.metadata.json` and `.manifest.json` as pydantic models, the one size-bounded way to read
them (and DCP's `.metadata`) from storage.

Records come from whoever wrote the checkpoint, so they are read as hostile input: a record is
refused by its size before it is read, and anything that does not parse into the model (deep
nesting, oversized integers, wrong types) is a `CorruptCheckpointError` naming the file.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Iterable
from typing import Final, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainckpt.errors import CorruptCheckpointError
from trainckpt.format.layout import MANIFEST_FILE, METADATA_FILE
from trainckpt.storage.checksums import FileEntry
from trainckpt.version import __version__

MAX_METADATA_BYTES = 64 * 1024
"""Largest `.metadata.json` read. A commit record is about 40 bytes (two fields)."""
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
"""Largest `.manifest.json` read: about 700,000 files at ~90 bytes per entry, far more than a
job of 10,000 ranks writes (one trainer-state file and a few shards per rank)."""
DCP_METADATA_FLOOR_BYTES = 1024 * 1024 * 1024
"""A DCP `.metadata` pickle up to this size is always read. Larger ones are read up to
`dcp_metadata_bound`, which grows with the checkpoint."""
DCP_METADATA_BYTES_PER_SHARD_BYTE = 4
"""`.metadata` holds one entry (~100-300 bytes) per item of a shard file, and each item is a
`torch.save` archive of at least ~700 bytes: a `.metadata` larger than 4x its shards (plus
the floor) was not written by DCP."""


def dcp_metadata_bound(shard_bytes: int) -> int:
    """Largest DCP `.metadata` read for a folder whose `.distcp` shard files hold
    `shard_bytes` in all: `DCP_METADATA_FLOOR_BYTES + 4 * shard_bytes`. It scales with the
    checkpoint (a job of 1,024 ranks with 2 million chunks has a ~300 MB `.metadata` beside
    gigabytes of shards), and a damaged or crafted file still never reaches memory whole."""
    return DCP_METADATA_FLOOR_BYTES + DCP_METADATA_BYTES_PER_SHARD_BYTE * shard_bytes


MANIFEST_FORMAT: Final = 1
"""`format` of a manifest without `attempt`: what local and shared-filesystem saves write, and
what trainckpt 0.1 wrote and reads."""
MANIFEST_FORMAT_WITH_ATTEMPT: Final = 2
"""`format` of a manifest that names its save `attempt` (object-store saves since 0.2). trainckpt
0.1 forbids unknown fields, so it would call such a manifest invalid and advise deleting the
checkpoint; the bumped number makes it say "upgrade trainckpt" instead. Readers take both."""

_DAMAGED = "the checkpoint is damaged: delete it or restore it from a copy"
_UNTRUSTED = "cannot be trusted: delete it or restore it from a copy"
_UNVERIFIABLE = "cannot be verified: delete it or restore it from a copy"

_Record = TypeVar("_Record", bound=BaseModel)


class CheckpointMetadata(BaseModel):
    """The commit record. Exactly OLMo-core's two fields, so either library reads the other's.

    A missing `ephemeral` (older OLMo-core checkpoints) means permanent.
    """

    model_config = ConfigDict(extra="ignore")

    ephemeral: bool = False
    version: str = __version__

    def to_json(self) -> bytes:
        return json.dumps({"ephemeral": self.ephemeral, "version": self.version}).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> CheckpointMetadata:
        raw = _parse_json_object(data, where)
        if raw.get("ephemeral") is None:
            raw.pop("ephemeral", None)
        return _validated(cls, raw, where, "commit record", f"the checkpoint {_UNTRUSTED}")


class CheckpointManifest(BaseModel):
    """Every file of a checkpoint but the two JSON records, with size and CRC32C.

    Paths are relative to the checkpoint folder with `/` separators. Paths are not validated
    here so that `verify` can report an escaping entry instead of refusing the whole manifest.
    """

    model_config = ConfigDict(extra="forbid")

    format: Literal[1, 2] = MANIFEST_FORMAT
    """1, or 2 when the manifest names its save `attempt` (`MANIFEST_FORMAT_WITH_ATTEMPT`)."""
    step: int | None = None
    created_at: str = Field(default_factory=lambda: utc_now_iso())
    world_size: int = Field(default=1, ge=1)
    attempt: str | None = None
    """Object stores: the save attempt that wrote the checkpoint (the id its claim named)."""
    files: dict[str, FileEntry] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _format_of_attempt(self) -> CheckpointManifest:
        """A manifest that names its attempt is format 2, so that 0.1 refuses it as newer."""
        if self.attempt is not None:
            self.format = MANIFEST_FORMAT_WITH_ATTEMPT
        return self

    def to_json(self) -> bytes:
        raw = self.model_dump()
        if raw["attempt"] is None:  # local saves: the manifest 0.1 wrote and reads
            del raw["attempt"]
        return json.dumps(raw, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> CheckpointManifest:
        raw = _parse_json_object(data, where)
        if raw.get("format") not in (MANIFEST_FORMAT, MANIFEST_FORMAT_WITH_ATTEMPT):
            raise CorruptCheckpointError(
                f"{where} has format {raw.get('format')!r}; this trainckpt reads formats "
                f"{MANIFEST_FORMAT} and {MANIFEST_FORMAT_WITH_ATTEMPT}: upgrade trainckpt or "
                "re-save the checkpoint"
            )
        return _validated(cls, raw, where, "manifest", f"the checkpoint {_UNVERIFIABLE}")

    @classmethod
    def merge(
        cls,
        parts: Iterable[dict[str, FileEntry]],
        *,
        step: int | None,
        world_size: int,
        attempt: str | None = None,
    ) -> CheckpointManifest:
        files: dict[str, FileEntry] = {}
        for part in parts:
            files.update(part)
        return cls(
            step=step, world_size=world_size, attempt=attempt, files=dict(sorted(files.items()))
        )


class RecordSource(Protocol):
    """What reading a record needs of a `Storage` (kept structural: storage imports this
    module, not the other way round)."""

    def join(self, base: str, *parts: str) -> str: ...

    def read_bytes(self, location: str, start: int = 0, end: int | None = None) -> bytes: ...


def read_record_bytes(storage: RecordSource, where: str, limit: int) -> bytes:
    """The bytes of the record file `where`, refused when larger than `limit`.

    One read of at most `limit + 1` bytes (a ranged request on object stores and HTTP), so a
    huge or growing file never reaches memory (except from an HTTP server that ignores
    `Range`, whose whole answer `HTTPStorage` receives). A missing file raises the storage's
    `FileNotFoundError` (`CheckpointNotFoundError`)."""
    data = storage.read_bytes(where, 0, limit + 1)
    if len(data) > limit:
        raise CorruptCheckpointError(
            f"{where} is larger than {limit} bytes, more than such a record ever holds; "
            f"it was not read: {_DAMAGED}"
        )
    return data


def read_metadata(storage: RecordSource, ckpt: str) -> CheckpointMetadata:
    """The commit record of checkpoint folder `ckpt`, size-bounded and validated. Raises
    `FileNotFoundError` when there is none, `CorruptCheckpointError` when it is malformed."""
    where = storage.join(ckpt, METADATA_FILE)
    data = read_record_bytes(storage, where, MAX_METADATA_BYTES)
    return CheckpointMetadata.from_json(data, where)


def read_manifest(storage: RecordSource, ckpt: str) -> CheckpointManifest:
    """The manifest of checkpoint folder `ckpt`, size-bounded and validated. Raises
    `FileNotFoundError` when there is none, `CorruptCheckpointError` when it is malformed."""
    where = storage.join(ckpt, MANIFEST_FILE)
    data = read_record_bytes(storage, where, MAX_MANIFEST_BYTES)
    return CheckpointManifest.from_json(data, where)


def parse_record(
    data: bytes, model: type[_Record], where: str, what: str, advice: str = _DAMAGED
) -> _Record:
    """`data`, read from `where`, as a `model` record (`what` names it in errors); anything
    that is not a JSON object fitting the model (deep nesting, oversized integers, wrong types)
    is a `CorruptCheckpointError` naming the file and ending with `advice`."""
    return _validated(model, _parse_json_object(data, where, advice), where, what, advice)


def _parse_json_object(data: bytes, where: str, advice: str = _DAMAGED) -> dict:
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError, MemoryError) as e:
        # ValueError: not UTF-8, not JSON, or an integer of more than 4300 digits;
        # RecursionError: brackets nested deeper than the parser's recursion limit.
        if not data.strip():
            raise CorruptCheckpointError(f"{where} is empty; {advice}") from e
        if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
            raise CorruptCheckpointError(f"{where} is not JSON ({e}); {advice}") from e
        raise _unparsable(where, e, advice) from e
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(
            f"{where} holds {type(raw).__name__}, not a JSON object; {advice}"
        )
    return raw


def _validated(model: type[_Record], raw: dict, where: str, what: str, advice: str) -> _Record:
    """`raw` (parsed from the file `where`) as a `model`; what does not fit is a
    `CorruptCheckpointError` naming the file and the field, ending with `advice`."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise CorruptCheckpointError(
            f"{where} is not a valid {what} ({loc + ': ' if loc else ''}{err['msg']}); {advice}"
        ) from e
    except (ValueError, RecursionError, MemoryError) as e:
        raise _unparsable(where, e, advice) from e


def _unparsable(where: str, e: BaseException, advice: str) -> CorruptCheckpointError:
    detail = " ".join(str(e).split())[:200] or "no detail"
    return CorruptCheckpointError(
        f"{where} is not a valid record ({type(e).__name__}: {detail}); {advice}"
    )


def utc_now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
