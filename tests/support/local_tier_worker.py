"""One rank of a node-local tier scenario (`test_local_tier.py`), forked as its own process by
`multiproc.fork_ranks` through `rank_worker.main` (result JSON, errors).

Each rank's state is its own (seeded by rank, step and attempt), so a part restored to the
wrong rank, from the wrong step or from another attempt changes the digest the test compares.
`LOCAL_FAULT` arms `TRAINCKPT_FAULT_POINT` only before the last save of a run. `LOCAL_PIECES`
cuts each part's module file into that many pieces (`local/part_write.py`; the test modules'
parts are far smaller than a real piece).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`
from support import rank_worker  # noqa: E402
from support.models import fresh_module, make_module  # noqa: E402
from trainckpt import Checkpointer, CheckpointerConfig  # noqa: E402
from trainckpt.local import part_write  # noqa: E402
from trainckpt.testing.faults import ENV_VAR  # noqa: E402


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


def _checkpointer(local: str) -> Checkpointer:
    """The checkpointer of a scenario (`LOCAL_RF`, `LOCAL_JUMP`: its replication settings;
    `LOCAL_PIECES`: pieces per module file)."""
    if "LOCAL_PIECES" in os.environ:
        pieces = int(os.environ["LOCAL_PIECES"])
        part_write.PIECE_BYTES = 4 << 10  # the test parts are ~100 KB: always `pieces`
        part_write.max_pieces = lambda: pieces  # type: ignore[assignment]
    replication = {
        key: int(os.environ[var])
        for key, var in (("replication_factor", "LOCAL_RF"), ("replication_jump", "LOCAL_JUMP"))
        if var in os.environ
    }
    return CheckpointerConfig(
        local_dir=local,
        work_dir=f"/tmp/trainckpt-w{dist.get_rank()}",
        collective_timeout=20,
        **replication,
    ).build()


def local_save(local: str, steps: str, attempt: str = "0", mode: str = "sync") -> dict:
    """Save each of `steps` (comma-separated) with `save_local`; return each step's digest of
    this rank's state. `async`: the parameters are overwritten as soon as `save_local` returns
    (as the next optimizer step would), before the save commits."""
    ckpt, rank = _checkpointer(local), dist.get_rank()
    steps_ = [int(s) for s in steps.split(",")]
    digests = {}
    for step in steps_:
        if step == steps_[-1] and os.environ.get("LOCAL_FAULT"):
            os.environ[ENV_VAR] = os.environ["LOCAL_FAULT"]
        module = rank_module(rank, step, int(attempt))
        digests[str(step)] = digest(module.state_dict_to_save())
        future = ckpt.save_local(step, module, {"step": step, "rank": rank})
        if mode == "async":
            with torch.no_grad():
                for p in module.model.parameters():
                    p.fill_(float(step))
        future.result()
    ckpt.close()
    return {"digests": digests}


def local_restore(local: str, then_save: str = "") -> dict:
    """Load the newest step that restores into a fresh module; return its digest (of the
    module's state after loading) and trainer state; then save step `then_save`, if given."""
    ckpt = _checkpointer(local)
    result: dict[str, Any] = {"latest": ckpt.latest_local(), "step": None}
    module = fresh_module()
    got = ckpt.load_latest_local(module)
    if got is not None:
        step, trainer = got
        result.update(step=step, digest=digest(module.state_dict_to_save()), trainer=trainer)
    if then_save:
        ckpt.close()
        result["saved"] = local_save(local, then_save)["digests"]
        result["latest_after"] = _checkpointer(local).latest_local()
    return result


rank_worker.SCENARIOS.update({f.__name__: f for f in (local_save, local_restore)})


def main() -> None:
    """`local_tier_worker.py SCENARIO OUT ARGS...`: a script's or a forked rank's entry
    (`multiproc.fork_ranks`)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rank_worker.main()


if __name__ == "__main__":
    main()
