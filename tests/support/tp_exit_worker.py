"""One rank of a tensor-parallel save and load in OLMo-core's style: the checkpointer is never
closed, and the process ends through the interpreter's own exit.

`python tp_exit_worker.py - OUT FOLDER TEARDOWN` with the torchrun-style environment set, as
`multiproc.launch_ranks` runs it (the scenario and OUT are not used: it prints); TEARDOWN
`destroy` destroys the job's groups at the end (as OLMo-core's teardown does), `keep` leaves
them. The last exit hook (registered before trainckpt is imported, so it runs after trainckpt's
own) prints whether the checkpointer's own gloo group is still alive: left to the interpreter's
finalization, its worker threads can abort the process.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from pathlib import Path
from typing import Any

_own_group: list[weakref.ref[Any]] = []


def _report() -> None:
    alive = bool(_own_group) and _own_group[0]() is not None
    print(f"own group alive at the last exit hook: {alive}", flush=True)


atexit.register(_report)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`
from trainckpt import Checkpointer, CheckpointerConfig, ModelAndOptim  # noqa: E402


def _tp_module(seed: int) -> ModelAndOptim:
    """A two-layer MLP split across the ranks (column- then row-wise, as in OLMo-core's
    tensor-parallel tests) and its AdamW optimizer after one step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).sum().backward()
    optim.step()
    optim.zero_grad()
    return ModelAndOptim(model, optim)


def main(folder: str, teardown: str) -> Checkpointer:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt = CheckpointerConfig(work_dir=f"{folder}/work{rank}", collective_timeout=60).build()
    _own_group.append(weakref.ref(ckpt.process_group))
    src = _tp_module(seed=0)
    path = ckpt.save(f"{folder}/step1", src, {"rank": rank})
    dst = _tp_module(seed=1)
    assert ckpt.load(path, dst) == {"rank": rank}
    for (name, a), b in zip(
        src.model.state_dict().items(), dst.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    print("loaded exactly", flush=True)
    if teardown == "destroy":
        dist.destroy_process_group()
    return ckpt  # held until the interpreter exits, like a trainer's attribute; never closed


if __name__ == "__main__":
    kept = main(*sys.argv[3:])
