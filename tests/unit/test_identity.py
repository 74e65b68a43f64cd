"""`trainckpt.identity`: a key per live object, and no `id()` per state entry in a save or a
load, which a Python audit hook (filelock installs one) makes about ten times as costly."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from trainckpt.identity import identity


@dataclass
class _Unhashable:  # a dataclass with eq: no __hash__, as DCP's `_StorageInfo`
    n: int


def test_identity_is_one_key_per_live_object_whatever_its_own_hash() -> None:
    objs: list[object] = [torch.zeros(2), torch.zeros(2), _Unhashable(1), _Unhashable(1)]
    objs += [bytes(bytearray(b"xy")), bytes(bytearray(b"xy")), 1.5, (1, 2), object()]
    keys = [identity(o) for o in objs]
    assert len(set(keys)) == len(objs)  # equal values, distinct objects: distinct keys
    assert keys == [identity(o) for o in objs]  # the same object: the same key


_COUNT_IDS = r"""
import collections, json, sys, warnings
from pathlib import Path
import torch
from trainckpt import CheckpointerConfig, ModelAndOptim

root = Path(sys.argv[1])
package = str(Path(__import__("trainckpt").__file__).parent)
counts = collections.Counter()
phase = [None]
busy = [False]

def hook(event, args):
    # `id()` called from trainckpt's own files, per phase (sys._getframe is audited too)
    if event != "builtins.id" or phase[0] is None or busy[0]:
        return
    busy[0] = True
    try:
        if sys._getframe(1).f_code.co_filename.startswith(package):
            counts[phase[0]] += 1
    finally:
        busy[0] = False

model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(100)))
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
for p in model.parameters():
    p.grad = torch.full_like(p, 1e-3)
optim.step()
module = ModelAndOptim(model, optim)
warnings.filterwarnings("ignore")
sys.addaudithook(hook)
plain = CheckpointerConfig(work_dir=root / "w1", incremental=False).build()
incremental = CheckpointerConfig(work_dir=root / "w2", incremental=True).build()
process = CheckpointerConfig(work_dir=root / "w3", async_writer="process").build()
runs = [
    ("first save", lambda: plain.save(root / "a" / "step1", module, {})),
    ("save", lambda: plain.save(root / "b" / "step1", module, {})),
    ("load", lambda: plain.load(root / "b" / "step1", module)),
    ("save_async", lambda: plain.save_async(root / "c" / "step1", module, {}).result()),
    ("incremental saves", lambda: [
        incremental.save(root / "d" / f"step{n}", module, {}) for n in (1, 2)
    ]),
    ("process writer", lambda: process.save_async(root / "e" / "step1", module, {}).result()),
]
for name, run in runs:
    phase[0] = name
    run()
    phase[0] = None
for c in (plain, incremental, process):
    c.close()
print(json.dumps({name: counts[name] for name, _ in runs}))
"""


def test_saves_and_loads_call_id_a_few_times_not_once_per_entry(tmp_path: Path) -> None:
    """200 parameters, 600 optimizer state values, 2,200 flattened hyperparameters: before,
    trainckpt's files called `id()` about 3,800 times in a save, 2,200 in a load and 16,600 in
    two incremental saves; now a few times each, whatever the state's size."""
    out = subprocess.run(
        [sys.executable, "-c", _COUNT_IDS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(counts) == {
        "first save",
        "save",
        "load",
        "save_async",
        "incremental saves",
        "process writer",
    }
    assert all(n <= 30 for n in counts.values()), counts
