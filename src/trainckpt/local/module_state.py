"""How a module's state maps to a local-tier part: saved as this rank's local shards (the tier
restores only to the world size and layout that saved it), loaded back into the module's own
state dict, shard by shard."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from trainckpt.core.staging import dtensor_type
from trainckpt.errors import CorruptCheckpointError


def local_view(state: Any) -> Any:
    """`state` with every DTensor replaced by this rank's local shard (the local tier restores
    only to the same world size and layout, so the local shard is all a rank needs)."""
    DTensor = dtensor_type()
    if DTensor is not None and isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {k: local_view(v) for k, v in state.items()}
    if isinstance(state, list):
        return [local_view(v) for v in state]
    return state


def load_into(train_module: Any, saved: dict[str, Any], where: str) -> None:
    """Apply a restored part to `train_module`, as a DCP load would: the module's own state
    dict to load (`state_dict_to_load`, its shardings) is filled in place, key by key, from
    the saved local tensors (a DTensor's local shard from the saved shard), then applied with
    `load_state_dict`. A key the part lacks, or a tensor of another shape or dtype, is a
    `CorruptCheckpointError` naming it. Called on: each rank, for its own part."""
    keys: dict[str, None] = {}
    for k, v in saved.items():
        keys.update({f"{k}.{sub}": None for sub in v} if isinstance(v, dict) else {k: None})
    target = train_module.state_dict_to_load(SimpleNamespace(state_dict_metadata=keys))
    with torch.no_grad():
        _fill(target, saved, "", where)
    train_module.load_state_dict(target)


def _fill(target: dict[str, Any], saved: Any, path: str, where: str) -> None:
    if not isinstance(saved, dict):
        raise CorruptCheckpointError(f"{where}: '{path}' is no dict in the saved part")
    DTensor = dtensor_type()
    for k, t in target.items():
        key = f"{path}{k}"
        if k not in saved:
            raise CorruptCheckpointError(
                f"{where}: the saved part has no '{key}', which the module expects; was it "
                "saved by another model or sharding? Load from the save folder instead"
            )
        s = saved[k]
        if isinstance(t, dict):
            _fill(t, s, f"{key}.", where)
            continue
        local = t.to_local() if DTensor is not None and isinstance(t, DTensor) else t
        if isinstance(local, torch.Tensor):
            if not isinstance(s, torch.Tensor) or s.shape != local.shape or s.dtype != local.dtype:
                got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s)
                raise CorruptCheckpointError(
                    f"{where}: '{key}' was saved as {got}, the module has {local.dtype} "
                    f"{tuple(local.shape)} here; the local tier restores only the layout that "
                    "saved it: load from the save folder instead"
                )
            local.copy_(s)
        else:
            target[k] = s
