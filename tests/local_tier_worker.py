"""One rank of a node-local tier scenario (`test_local_tier.py`), run as its own process by
`multiproc.launch_ranks(..., worker=...)` through `rank_worker.main` (result JSON, errors).

Each rank's state is its own (seeded by rank, step and attempt), so a part restored to the
wrong rank, from the wrong step or from another attempt changes the digest the test compares.
`LOCAL_FAULT` arms `TRAINCKPT_FAULT_POINT` only before the last save of a run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import rank_worker  # noqa: E402
from models import fresh_module, make_module  # noqa: E402

from trainckpt.core import dist as tdist  # noqa: E402
from trainckpt.core.local_tier import LocalTier, load_into  # noqa: E402
from trainckpt.core.staging import Stager  # noqa: E402
from trainckpt.faults import ENV_VAR  # noqa: E402
from trainckpt.format.trainer_state import serialize_trainer_state  # noqa: E402


def digest(state: Any) -> str:
    """SHA-256 of every key, tensor dtype, shape and byte, and every other value."""
    h = hashlib.sha256()

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k], f"{key}.{k}")
        elif isinstance(obj, torch.Tensor):
            t = obj.detach().contiguous().cpu().reshape(-1)
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(f"{key}={obj!r}".encode())

    walk(state, "")
    return h.hexdigest()


def rank_module(rank: int, step: int, attempt: int = 0) -> Any:
    """The module rank `rank` saves at `step` in attempt `attempt` (deterministic)."""
    return make_module(seed=1000 * rank + 10 * step + attempt, steps=1)


def expected_digest(rank: int, step: int, attempt: int = 0) -> str:
    return digest(rank_module(rank, step, attempt).state_dict_to_save())


def _tier(local: str) -> LocalTier:
    return LocalTier(Path(local), tdist.new_cpu_group(20), keep=2)


def local_save(local: str, steps: str, attempt: str = "0") -> dict:
    """Save each of `steps` (comma-separated); return each step's digest of this rank's state."""
    tier, rank = _tier(local), dist.get_rank()
    steps_ = [int(s) for s in steps.split(",")]
    digests = {}
    for step in steps_:
        if step == steps_[-1] and os.environ.get("LOCAL_FAULT"):
            os.environ[ENV_VAR] = os.environ["LOCAL_FAULT"]
        module = rank_module(rank, step, int(attempt))
        state = module.state_dict_to_save()
        digests[str(step)] = digest(state)
        trainer = serialize_trainer_state({"step": step, "rank": rank}, "local")
        tier.save(step, Stager().stage(state), trainer)
    return {"digests": digests}


def local_restore(local: str, then_save: str = "") -> dict:
    """Restore the newest step that restores into a fresh module; return its digest (of the
    module's state after loading) and trainer state; then save step `then_save`, if given."""
    tier = _tier(local)
    latest = tier.latest()
    got = tier.restore_latest()
    result: dict[str, Any] = {"latest": latest, "step": None}
    if got is not None:
        step, state, trainer = got
        module = fresh_module()
        load_into(module, state, f"local step {step}")
        result.update(step=step, digest=digest(module.state_dict_to_save()), trainer=trainer)
    if then_save:
        result["saved"] = local_save(local, then_save)["digests"]
        result["latest_after"] = tier.latest()
    return result


rank_worker.SCENARIOS.update({f.__name__: f for f in (local_save, local_restore)})

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rank_worker.main()
