#!/usr/bin/env python
"""Node-local tier benchmark: 2 gloo ranks on this machine, each with its own local folder (so
each is its own "node" and rank 0's replica lands on rank 1 and back).

Rows (rank 0, median of `--repeats`, after a warm-up save; the contenders of each repeat
alternate in order): training blocked by `save_local` (the copy to CPU memory), time until
committed with replication (`replication_factor=2`) and without (1), each phase of those saves
(from their log records: `LocalTier.save`'s `PHASES`), the replication phase of the rf=2 save,
restore from the own disk and from the peer (own folder wiped), a save of the same state to a
save folder shared by both ranks, and the replication floors: a raw write + fsync of the
replica's bytes (both ranks at once, as they replicate at once) and sending the same bytes
over the same process group (both directions at once, 16 MiB chunks, two in flight, as the
replication does, no disk).

The "cpu:" rows are rank 0's process CPU (all threads, user + system) during
`save()` and `save_local`: a cost that other jobs on the machine inflate less than wall time.
The "phase cpu" rows are the CPU of the thread that ran each phase (where the tier logs it,
`local_save_cpu_seconds`).

Each rank runs `os.cpu_count() // 2` torch threads (as torchrun would give it), the `save()`
contender is not incremental (it writes the same bytes), and each local save's deletions of
the previous step are waited for outside the timing.

Targets (issue 26), each a per-repeat ratio (median, min-max): the rf=1 local save commits in
<= 1.1x a `save()` of the same bytes to the same disk; the replication phase takes <= 1.3x the
slower of its two floors.

`--replica-mode page|direct` sets how replicas are written (the kept verdict of each disk,
`.write-mode.json`) instead of measuring it: on a disk where both ways are close the verdict
may differ from run to run, and comparing two runs is then comparing two ways.

    python scripts/bench_local.py --size-mb 64 --repeats 3 [--replica-mode page] [--json out.json]

`scripts/bench.py` runs it as its local-tier part (`--local-size-mb`, `--no-local`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Timer, make_module  # noqa: E402

from trainckpt import CheckpointerConfig  # noqa: E402
from trainckpt.local.replica_file import MODE_FILE, PROBE_BYTES, WriteMode, read_mode  # noqa: E402
from trainckpt.local.transfer import CHUNK, DEPTH  # noqa: E402

WORLD = 2


class _PhaseLog(logging.Handler):
    """Collects the phase timings each committed local save logs (`local_save_seconds`)."""

    def __init__(self) -> None:
        super().__init__()
        self.phases: list[dict[str, float]] = []
        self.cpu: list[dict[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        phases = getattr(record, "local_save_seconds", None)
        if phases is not None:
            self.phases.append(phases)
            self.cpu.append(getattr(record, "local_save_cpu_seconds", {}))


def _cpu_seconds() -> float:
    """CPU seconds of this process so far, all its threads (user + system): a save's cost
    that other jobs on the machine inflate less than its wall time."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def _raw_write(path: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` already in memory to a new file in one call and fsync it
    (the bytes made before the clock starts; no CRC). Called on: both ranks at once."""
    data = (os.urandom(1 << 20) * (nbytes // (1 << 20) + 1))[:nbytes]
    with Timer() as t, open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    path.unlink()
    return t.seconds


def _process_group_transfer(nbytes: int, chunk: int = CHUNK, depth: int = DEPTH) -> float:
    """Seconds to send `nbytes` to the peer while receiving as many from it over the default
    gloo group, in `chunk`-byte messages with `depth` in flight each way (replication's
    pattern and buffers, `local/transfer.py`, with nothing read or written: no disk, no
    CRC). Called on: both ranks."""
    peer = 1 - dist.get_rank()
    size = min(chunk, nbytes)
    out = [torch.ones(size, dtype=torch.uint8) for _ in range(depth)]
    into = [torch.empty(size, dtype=torch.uint8) for _ in range(depth)]
    chunks = -(-nbytes // chunk)
    dist.barrier()
    works: list[list[Any]] = []
    with Timer() as t:
        for c in range(chunks):
            if c >= depth:
                for w in works[c - depth]:
                    w.wait()
            n = min(chunk, nbytes - c * chunk)
            works.append(
                [
                    dist.irecv(into[c % depth][:n], peer, tag=c % depth),
                    dist.isend(out[c % depth][:n], peer, tag=c % depth),
                ]
            )
        for ws in works[max(0, chunks - depth) :]:
            for w in ws:
                w.wait()
    return t.seconds


def _rank(
    rank: int, port: int, root: str, size_mb: float, repeats: int, out: str, mode: str
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD))  # torchrun's default
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    base = Path(root)
    module = make_module(size_mb, seed=rank)
    nbytes = sum(
        t.numel() * t.element_size()
        for part in module.state_dict_to_save().values()
        for t in part.values()
        if isinstance(t, torch.Tensor)
    )
    rows: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {"rf1": [], "replication": []}
    phase_log = _PhaseLog()
    tier_log = logging.getLogger("trainckpt.local.tier")
    tier_log.addHandler(phase_log)
    tier_log.setLevel(logging.INFO)

    def add(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    if mode != "auto":  # the kept verdict of each disk (docs/local-tier.md), set beforehand
        for factor in (1, 2):
            disk = base / f"node{rank}-rf{factor}"
            disk.mkdir(parents=True, exist_ok=True)
            kept = WriteMode(mode == "direct", 0.0, 0.0, PROBE_BYTES)
            (disk / MODE_FILE).write_text(json.dumps(dataclasses.asdict(kept)))
    ckpts = {
        factor: CheckpointerConfig(
            local_dir=base / f"node{rank}-rf{factor}",
            replication_factor=factor,
            replication_jump=1,
            local_keep=1,
            work_dir=base / f"work{rank}",
        ).build()
        for factor in (1, 2)
    }
    # every save() writes all its bytes (an incremental save of the unchanged state would
    # link the previous one's files and write next to nothing)
    shared = CheckpointerConfig(work_dir=base / f"work{rank}", incremental=False).build()
    for ckpt in ckpts.values():  # warm-up: staging buffers allocated, tier opened
        ckpt.save_local(0, module, {"step": 0}).result()
    shared.save(base / "shared" / "step0", module, {"step": 0})
    used = read_mode(base / f"node{rank}-rf2")
    replica_mode = "page cache" if used is None or not used.direct else "O_DIRECT"
    for repeat in range(1, repeats + 1):
        took: dict[str, float] = {}
        phases: dict[str, dict[str, float]] = {}
        order = ["rf1", "save", "rf2"]
        for what in order[repeat % 2 :] + order[: repeat % 2]:  # alternate who goes first
            dist.barrier()
            if what == "save":
                cpu = _cpu_seconds()
                with Timer() as t:
                    shared.save(base / "shared" / f"step{repeat}", module, {"step": repeat})
                add("save() to a shared save folder", t.seconds)
                add("cpu: save() to a shared save folder", _cpu_seconds() - cpu)
                took["save"] = t.seconds
                dist.barrier()
                shutil.rmtree(base / "shared" / f"step{repeat}", ignore_errors=True)
                continue
            factor = int(what[2:])
            cpu = _cpu_seconds()
            with Timer() as total:
                with Timer() as blocked:
                    future = ckpts[factor].save_local(repeat, module, {"step": repeat})
                future.result()
            add(f"cpu: save_local until committed (rf={factor})", _cpu_seconds() - cpu)
            add(f"save_local blocked (rf={factor})", blocked.seconds)
            add(f"save_local committed (rf={factor})", total.seconds)
            # the tier's own time to its commit (without staging, the save thread, the vote)
            add(
                f"save_local committed, in the tier (rf={factor})",
                phase_log.phases[-1]["committed"],
            )
            for phase, seconds in phase_log.phases[-1].items():
                if phase not in ("committed", "replication"):
                    add(f"phase (rf={factor}): {phase}", seconds)
            for phase, seconds in phase_log.cpu[-1].items():  # the thread's CPU in each phase
                add(f"phase cpu (rf={factor}): {phase}", seconds)
            took[what] = total.seconds
            phases[what] = phase_log.phases[-1]
            ckpts[factor].local.latest()  # waits for its deletions: none overlaps the next row
        ratios["rf1"].append(took["rf1"] / took["save"])
        replicated = phases["rf2"]["replication"]
        add("replication phase (rf=2)", replicated)
        (replica,) = (base / f"node{rank}-rf2" / f"step{repeat}").glob(f"*/rank{1 - rank}")
        extra = sum(f.stat().st_size for f in replica.glob("*.pt"))
        dist.barrier()
        raw = _raw_write(base / f"raw{rank}", extra)
        add("raw write + fsync of the replica's bytes", raw)
        sent = _process_group_transfer(extra)
        add("process-group transfer of the replica's bytes", sent)
        ratios["replication"].append(replicated / max(raw, sent))
        with Timer() as t:
            ckpts[2].load_local(repeat, module)
        add("load_local from own disk", t.seconds)
        if rank == 0:
            shutil.rmtree(base / f"node{rank}-rf2" / f"step{repeat}")
        dist.barrier()
        with Timer() as t:
            ckpts[2].load_local(repeat, module)
        add("load_local from the peer (rank 0's disk wiped)", t.seconds)
    for ckpt in (*ckpts.values(), shared):
        ckpt.close()
    if rank == 0:
        report = {
            "bytes_per_rank": nbytes,
            "rows": rows,
            "ratios": ratios,
            "replica_mode": replica_mode,
        }
        Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


def bench_local(size_mb: float, repeats: int, root: Path, mode: str = "auto") -> dict[str, Any]:
    """Run the rows on 2 spawned ranks under `root`; print them and return the report.
    `mode`: how replicas are written (`auto`: as each disk measured, else `page` or `direct`,
    kept in `.write-mode.json` before the tier opens)."""
    work = Path(tempfile.mkdtemp(prefix="bench-local-", dir=root))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / "result.json"
    try:
        mp.spawn(
            _rank, args=(port, str(work), size_mb, repeats, str(out), mode), nprocs=WORLD, join=True
        )
        report: dict[str, Any] = json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = {name: statistics.median(xs) for name, xs in report["rows"].items()}
    mb = report["bytes_per_rank"] / 1e6
    print(
        f"\nnode-local tier, 2 ranks on one machine, {mb:.0f} MB of state per rank (rank 0), "
        f"replicas written through {report['replica_mode']}:"
    )
    for name, seconds in rows.items():
        xs = report["rows"][name]
        spread = f"({min(xs):.3f}-{max(xs):.3f})"
        if name.startswith(("phase", "cpu")):
            print(f"  local {name:<52} {seconds:7.3f} s  {spread}")
        else:
            print(f"  local {name:<52} {seconds:7.3f} s  {spread}  ({mb / seconds:6.0f} MB/s)")
    targets = {
        "rf1": ("local save_local committed (rf=1) / save() of the same bytes", 1.1),
        "replication": (
            "local replication / max(process-group transfer, raw write + fsync)",
            1.3,
        ),
    }
    report["target_ratios"] = {}
    for key, (label, want) in targets.items():
        xs = report["ratios"][key]
        ratio = statistics.median(xs)
        verdict = "met" if ratio <= want else "NOT met"
        print(
            f"target {label}: {ratio:.2f} (min {min(xs):.2f}, max {max(xs):.2f}; "
            f"want <= {want}) -> {verdict}"
        )
        report["target_ratios"][key] = ratio
    report["medians"] = {k: v for k, v in rows.items() if not k.startswith(("phase", "cpu"))}
    report["phase_medians"] = {k: v for k, v in rows.items() if k.startswith("phase")}
    report["cpu_medians"] = {k: v for k, v in rows.items() if k.startswith("cpu")}
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=64.0, help="state per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--replica-mode",
        choices=("auto", "page", "direct"),
        default="auto",
        help="how replicas are written: as each disk measures (auto; it may flip between runs "
        "on a disk where both ways are close), or set: through the page cache, or O_DIRECT",
    )
    args = p.parse_args(argv)
    root = args.dir or Path(tempfile.gettempdir())
    report = bench_local(args.size_mb, args.repeats, root, args.replica_mode)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
