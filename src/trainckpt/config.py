"""`CheckpointerSettings`: the settings of a `Checkpointer`, their defaults and limits, validated
once; and `Setting`, the descriptor that makes each one a typed attribute of the checkpointer.
Apart from `checkpointer.py` so the settings read alone; `checkpointer.CheckpointerConfig` adds
`build()` on top, so this module needs no import of the checkpointer. Used on every rank."""

from __future__ import annotations

import difflib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, Self, TypeVar, cast, overload

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainckpt.core.claim import DEFAULT_LEASE, MAX_LEASE
from trainckpt.core.load import VerifyOnLoad
from trainckpt.errors import ConfigurationError, settings_error
from trainckpt.format.trainer_state import DEFAULT_MAX_BYTES


def default_work_dir() -> Path:
    """`<tmp>/trainckpt-<uid>`: the `work_dir` of a `Checkpointer` given none."""
    return Path(tempfile.gettempdir()) / f"trainckpt-{os.getuid() if hasattr(os, 'getuid') else 0}"


def _config_error(error: ValidationError, where: str, fields: Iterable[str]) -> ConfigurationError:
    """pydantic's complaint as a `ConfigurationError` naming each field; a misspelt field gets
    the closest real one ("did you mean 'work_dir'?")."""
    hints = [
        f"'{close[0]}' for '{err['loc'][0]}'"
        for err in error.errors()
        if err["type"] == "extra_forbidden" and err["loc"]
        for close in [difflib.get_close_matches(str(err["loc"][0]), list(fields), n=1)]
        if close
    ]
    message = str(settings_error(error, where, "checkpointer settings"))
    if hints:
        message += f" (did you mean {', '.join(hints)}?)"
    return ConfigurationError(message)


class CheckpointerSettings(BaseModel):
    """Settings of a `Checkpointer`; `CheckpointerConfig` (`checkpointer.py`) adds `build()`.
    Unknown keys are refused, so a typo cannot pass silently.

    The one place the settings, their defaults and their limits are declared: a `Checkpointer`
    holds its validated settings as an instance of this class (`Checkpointer.config`).
    """

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )

    work_dir: Path | None = None
    """Node-local scratch folder: staging of uploads to object stores and the cache of files
    downloaded from URLs. Not the save folder. None: OLMo-core's `TrainerConfig.build` sets its
    trainer's `work_dir`; otherwise `<tmp>/trainckpt-<uid>`."""
    save_overwrite: bool | None = None
    """Replace a committed checkpoint of the same step instead of refusing to save. None:
    OLMo-core's `TrainerConfig.build` sets its trainer's `save_overwrite`; otherwise False."""
    pre_download: bool = False
    """When loading from a URL, download the files this rank needs before reading them, instead
    of reading byte ranges on demand."""
    save_thread_count: int | None = Field(default=None, ge=1, le=64)
    """Threads per rank writing files, and uploading them to object stores; None picks
    min(4, CPUs) for writing and 8 for uploads (which wait on the network, not the CPU)."""
    async_writer: Literal["thread", "process"] = "thread"
    """Who writes the files of `save_async`: threads of the training process, or a separate
    writer process that reads the staged state from shared memory, so the writing never
    competes with training for the interpreter lock (docs/performance.md). The process costs
    a Python interpreter with torch (started at the first async save) and stages into shared
    memory (a `memfd`, not `/dev/shm`); its threads: `save_thread_count`, or the cores
    training leaves free."""
    incremental: bool = True
    """Incremental saves (docs/incremental.md): items whose bytes (xxh3-128 hash) did not change
    since this checkpointer's previous save fill files of their own, and such a file is taken
    over by a hard link (local/NFS) or a server-side copy (gs://, s3://) instead of being
    written and uploaded again. Every checkpoint stays complete and loads alone. False: every
    save writes every byte."""
    load_thread_count: int | None = Field(default=None, ge=1, le=64)
    """Threads per rank reading (and downloading) files; None picks min(4, CPUs)."""
    throttle_uploads: bool = False
    """Upload to object stores one rank per node at a time, to spare each node's network.
    Ranks on the same host take turns in ascending rank order (the host's first rank uploads
    all its files, then its second, ...); each turn ends with a barrier on the checkpointer's
    process group, so nodes upload in parallel but never two ranks of one node. A turn must
    fit within `collective_timeout`. Local/NFS saves ignore it."""
    fs_timeout: float = Field(default=120.0, gt=0)
    """Seconds to wait for files and folders written by another rank to become visible
    (shared filesystems lag) before failing with an error saying what was awaited."""
    collective_timeout: float = Field(default=600.0, gt=0)
    """Seconds a collective of the checkpointer's own process group may wait for a peer; a rank
    that died during a save makes the others fail after at most this long."""
    retry_deadline: float = Field(default=300.0, gt=0)
    """Seconds a remote storage request may keep retrying transient errors."""
    claim_lease: float = Field(default=DEFAULT_LEASE, gt=0, le=MAX_LEASE)
    """Object stores: seconds a save's claim on its step stays live without renewal. Rank 0
    renews it six times per period while the save runs; another save of the same step that
    sees it renewed fails at once, and one that sees it unchanged for this long (its save
    crashed) takes the step over. So a save after a crash waits up to this long; a save that
    stalls for longer than this loses its step and fails instead of committing."""
    on_rollback: Literal["replace", "refuse"] = "replace"
    """What a run that resumes from an older step than the newest committed one in its save
    folder does with the newer checkpoints (docs/rollback.md): `replace` abandons them (no
    finder reports them again; the run's saves of those steps replace them); `refuse` raises
    an error naming them instead, and abandons nothing."""
    local_dir: Path | None = None
    """Folder of the node-local tier (`save_local`): on each node's own disk (NVMe,
    `/dev/shm`), the same path on every node. None: no local tier."""
    replication_factor: int = Field(default=2, ge=1, le=16)
    """Copies of each rank's local part, its own included, each on another node."""
    replication_jump: int | None = Field(default=None, ge=1)
    """Ranks between a local part and its replica; None: the ranks per node
    (`LOCAL_WORLD_SIZE`), so replicas land on the next node."""
    local_keep: int = Field(default=2, ge=1)
    """Committed steps the local tier keeps."""
    verify_on_load: VerifyOnLoad = "size"
    """Check files against the manifest before loading: none, size (cheap) or full (CRC32C)."""
    max_trainer_state_bytes: int = Field(default=DEFAULT_MAX_BYTES, ge=1)
    """Largest trainer-state file (`train/rank{R}.pt`) a save writes and a load reads: a larger
    one is refused by its size before it is read (docs/limits.md). Default 1 GiB."""
    exit_timeout: float = Field(default=300.0, ge=0)
    """Seconds a process that ends (or gets SIGTERM, where the trainer has no handler of its
    own) without `close()` waits for its in-flight async save to commit; a save that does not
    commit in time is logged as an ERROR naming it. 0 does not wait."""

    # -- every way in raises `ConfigurationError` naming the field, never pydantic's own error --
    def __init__(self, **settings: Any) -> None:
        """`CheckpointerConfig(work_dir=..., ...)`; an unknown or invalid field raises
        `ConfigurationError` naming it."""
        try:
            super().__init__(**settings)
        except ValidationError as e:
            raise _config_error(e, type(self).__name__, type(self).model_fields) from e

    # pydantic runs a custom __init__ inside model_validate and would wrap our error in its own;
    # this one only translates errors, so validation may skip it (as it skips BaseModel's)
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise _config_error(e, type(self).__name__, type(self).model_fields) from e

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        """pydantic's `model_validate`, raising `ConfigurationError` naming each bad field."""
        return cls.validated(obj, cls.__name__, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: Any, **kwargs: Any) -> Self:
        """pydantic's `model_validate_json`, raising `ConfigurationError` naming each bad field."""
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as e:
            raise _config_error(e, cls.__name__, cls.model_fields) from e

    @classmethod
    def from_file(cls, path: str | Path) -> Self:
        """Read a YAML or JSON file (a top-level `checkpointer:` key is accepted too)."""
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError as e:
            raise ConfigurationError(f"config file '{p}' does not exist") from e
        try:
            raw = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ConfigurationError(f"config file '{p}' is not valid YAML/JSON: {e}") from e
        raw = raw or {}
        if not isinstance(raw, dict):
            raise ConfigurationError(f"config file '{p}' must hold a mapping of settings")
        if "checkpointer" in raw and isinstance(raw["checkpointer"], dict):
            raw = raw["checkpointer"]
        return cls.validated(raw, where=str(p))

    @classmethod
    def validated(cls, raw: Any, where: str = "CheckpointerConfig", **kwargs: Any) -> Self:
        """Validate `raw`, turning pydantic's errors into one message that names each field
        (`where`: the file or caller the settings came from)."""
        try:
            return super().model_validate(raw, **kwargs)
        except ValidationError as e:
            raise _config_error(e, where, cls.model_fields) from e

    def updated(self, where: str = "CheckpointerConfig", **changes: Any) -> Self:
        """A copy with `changes` applied and validated (`where` names the caller in errors)."""
        return self.validated({**self.model_dump(), **changes}, where) if changes else self

    def with_defaults(self) -> Self:
        """A copy with the settings a trainer may fill in, if left None, set to their defaults:
        `work_dir` `<tmp>/trainckpt-<uid>`, `save_overwrite` False."""
        return self.model_copy(
            update={
                "work_dir": default_work_dir() if self.work_dir is None else self.work_dir,
                "save_overwrite": bool(self.save_overwrite),
            }
        )


_T = TypeVar("_T")


class Configured(Protocol):
    """What a `Setting` needs of its owner: settings held as a `CheckpointerSettings`."""

    config: Any


class Setting(Generic[_T]):
    """A setting of a `Checkpointer` as a typed attribute: read from its `config`, and written
    into a new `config` validated by `CheckpointerSettings` (an invalid value raises
    `ConfigurationError` naming it). Values that the checkpointer derived at construction
    (its process group, storage options, local tier) stay as they were."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> Setting[_T]: ...
    @overload
    def __get__(self, obj: Configured, owner: type) -> _T: ...
    def __get__(self, obj: Configured | None, owner: type) -> Setting[_T] | _T:
        if obj is None:
            return self
        return cast(_T, getattr(obj.config, self.name))

    def __set__(self, obj: Configured, value: _T) -> None:
        changed = obj.config.updated("Checkpointer", **{self.name: value})
        obj.config = changed.with_defaults()
