"""`OLMoCheckpointerConfig`: trainckpt's settings in the shape of OLMo-core's `CheckpointerConfig`,
for `olmo_core.train.TrainerConfig(checkpointer=...)`; its `build()` returns trainckpt's
`Checkpointer`.

Why a second class: OLMo-core's config machinery (`as_config_dict`, `from_dict`, `merge`)
serializes only dataclasses and decodes `TrainerConfig.checkpointer` only into an instance of
its own `CheckpointerConfig`. A subclass of it round-trips; the pydantic `CheckpointerConfig`
cannot be one without importing OLMo-core (seconds) on every `import trainckpt`. This module
needs the `olmo` extra and is imported only when used (`trainckpt.OLMoCheckpointerConfig`).
Validation stays in one place: every value goes through `CheckpointerConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from olmo_core.train.checkpoint import CheckpointerConfig as _OLMoCheckpointerConfig

from . import dist
from .checkpointer import Checkpointer, VerifyOnLoad
from .config import CheckpointerConfig

_FIELDS = CheckpointerConfig.model_fields


@dataclass
class OLMoCheckpointerConfig(_OLMoCheckpointerConfig):
    """OLMo-core's `CheckpointerConfig` fields (`work_dir`, `save_overwrite`, `pre_download`,
    thread counts, `throttle_uploads`; the first two filled in by `TrainerConfig.build`) plus
    trainckpt's own; each field means what it means in `CheckpointerConfig`."""

    fs_timeout: float = _FIELDS["fs_timeout"].default
    collective_timeout: float = _FIELDS["collective_timeout"].default
    retry_deadline: float = _FIELDS["retry_deadline"].default
    verify_on_load: VerifyOnLoad = _FIELDS["verify_on_load"].default
    exit_timeout: float = _FIELDS["exit_timeout"].default

    def __post_init__(self) -> None:
        self.trainckpt_config()  # invalid settings fail here, as a pydantic model would

    def trainckpt_config(self, **overrides: Any) -> CheckpointerConfig:
        """These settings (None ones left out) as a validated `CheckpointerConfig`."""
        raw = {**self.as_dict(exclude_none=True, recurse=False), **overrides}
        return CheckpointerConfig.validated(raw, where=type(self).__name__)

    def build(  # type: ignore[override]  # returns trainckpt's Checkpointer, not OLMo-core's
        self, process_group: dist.ProcessGroup | None = None, **kwargs: Any
    ) -> Checkpointer:
        """trainckpt's `Checkpointer` with these settings, `kwargs` (what `TrainerConfig.build`
        fills in) on top. Called on: all ranks."""
        return self.trainckpt_config(**kwargs).build(process_group)
