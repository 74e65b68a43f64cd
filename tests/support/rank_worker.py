"""One rank of a multi-process test scenario, run by `multiproc.launch_ranks` as its own process.

`python rank_worker.py SCENARIO OUT_DIR [ARGS...]` with the torchrun-style environment set.
Writes `OUT_DIR/rank{R}.json`: the scenario's result, or the error it raised.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`
from support.exit_worker import save_then_end  # noqa: E402
from support.models import TinyNet, make_module  # noqa: E402
from trainckpt import CheckpointerConfig, ModelAndOptim  # noqa: E402


def not_shared(folder: str) -> dict:
    """Save into a folder that rank 1 sees as a different directory (its own mount)."""
    ckpt = CheckpointerConfig(work_dir=f"/tmp/trainckpt-w{dist.get_rank()}", fs_timeout=3).build()
    ckpt.save(f"{folder}/step1", make_module(), {"step": 1})
    return {"saved": True}


class _Exploding(ModelAndOptim):
    def __init__(self, how: str) -> None:
        m = make_module()
        super().__init__(m.model, m.optim)
        self.how = how

    def state_dict_to_save(self) -> dict:
        if dist.get_rank() == 1:
            if self.how == "raise":
                raise RuntimeError("rank 1 ran out of host memory (simulated)")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().state_dict_to_save()


def rank_fails(folder: str, how: str, mode: str) -> dict:
    """Rank 1 fails (`raise` or `kill` before the save's collectives, or any other value: the
    fault point named by TRAINCKPT_FAULT_POINT kills it); the others must fail, not hang."""
    ckpt = CheckpointerConfig(
        work_dir=f"/tmp/trainckpt-w{dist.get_rank()}", collective_timeout=20, fs_timeout=20
    ).build()
    module = _Exploding(how) if how in ("raise", "kill") else make_module()
    start = time.monotonic()
    if mode == "async":
        ckpt.save_async(f"{folder}/step1", module, {"step": 1}).result()
    else:
        ckpt.save(f"{folder}/step1", module, {"step": 1})
    return {"saved": True, "seconds": time.monotonic() - start}


def async_interleaved(folder: str) -> dict:
    """Training collectives on the default group while background saves run on the
    checkpointer's own group; then every save loads back exactly."""
    ckpt = CheckpointerConfig(
        work_dir=f"/tmp/trainckpt-w{dist.get_rank()}", collective_timeout=60
    ).build()
    torch.manual_seed(0)
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    module = ModelAndOptim(model, optim)
    expected = {}
    for step in range(1, 7):
        tokens = torch.randint(0, 64, (4, 8))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        for p in model.parameters():  # a DDP-style gradient all-reduce on the main group
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optim.step()
        optim.zero_grad()
        if step % 2 == 0:
            expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.save_async(f"{folder}/step{step}", module, {"step": step})
    ckpt.wait()
    for step, ref in expected.items():
        fresh = ModelAndOptim(TinyNet(), None)
        assert ckpt.load(f"{folder}/step{step}", fresh, load_optim_state=False)["step"] == step
        for k, v in fresh.model.state_dict().items():
            assert torch.equal(v, ref[k]), (step, k)
    ckpt.close()
    return {"steps": sorted(expected)}


def exit_mid_save(folder: str, how: str, exit_timeout: str) -> dict:
    """Start an async save on every rank, then end the process by `how` (see `exit_worker`)
    through the interpreter's own exit: writes no result file."""
    save_then_end(folder, how, float(exit_timeout), f"/tmp/trainckpt-w{dist.get_rank()}")
    return {}


SCENARIOS = {f.__name__: f for f in (not_shared, rank_fails, async_interleaved, exit_mid_save)}
ENDS_PROCESS = {"exit_mid_save"}


def main() -> None:
    scenario, out, *args = sys.argv[1:]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    if scenario in ENDS_PROCESS:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        SCENARIOS[scenario](*args)
        return
    try:
        result = {"ok": True, **SCENARIOS[scenario](*args)}
    except BaseException as e:
        result = {
            "ok": False,
            "type": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "message": str(e),
            "trace": traceback.format_exc(),
        }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # skip teardown: a peer may be dead, and destroy_process_group would wait for it


if __name__ == "__main__":
    main()
