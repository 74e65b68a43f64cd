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

import dataclasses
from typing import Any

from olmo_core.train.checkpoint import CheckpointerConfig as _OLMoCheckpointerConfig

from trainckpt.checkpointer import Checkpointer, CheckpointerConfig
from trainckpt.core import dist


class _Methods(_OLMoCheckpointerConfig):
    """What `OLMoCheckpointerConfig` does; its fields are added below."""

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


def _own_fields() -> list[tuple[str, Any, Any]]:
    """`CheckpointerConfig`'s fields that OLMo-core's config lacks, with type and default:
    generated, so a setting added to `CheckpointerConfig` is here too."""
    olmo = {f.name for f in dataclasses.fields(_OLMoCheckpointerConfig)}
    fields = []
    for name, info in CheckpointerConfig.model_fields.items():
        if name in olmo:
            continue
        if info.default_factory is not None:
            default = dataclasses.field(default_factory=info.default_factory)  # type: ignore[arg-type]
        else:
            default = dataclasses.field(default=info.default)
        fields.append((name, info.annotation, default))
    return fields


OLMoCheckpointerConfig = dataclasses.make_dataclass(
    "OLMoCheckpointerConfig",
    _own_fields(),
    bases=(_Methods,),
    namespace={
        "__module__": __name__,  # OLMo-core's from_dict finds the class by this name
        "__doc__": """OLMo-core's `CheckpointerConfig` fields (`work_dir`, `save_overwrite`,
        `pre_download`, thread counts, `throttle_uploads`; the first two filled in by
        `TrainerConfig.build`) plus every other field of trainckpt's `CheckpointerConfig`, each
        meaning what it means there.""",
    },
)
