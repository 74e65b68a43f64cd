#!/usr/bin/env python
"""Checkpoint benchmark: trainckpt against the disk's limit, torch.save, plain DCP and OLMo-core.

Every contender saves and loads the same state (a model plus AdamW moments, `--size-mb` in
all) in one run; contenders alternate (the order rotates every repeat) and each number is the
median of `--repeats` runs with its min–max. Loads are cold (page cache dropped) when this
process may drop it (root), else warm, and the table says which. Each load is checked: the
model and optimizer are zeroed before it and must match the saved state after it.

    python scripts/bench.py                      # ~1.2 GB state, 3 repeats, GCS, training
    python scripts/bench.py --size-mb 64 --repeats 1 --no-gcs --json out.json
    python scripts/bench.py --training-only --train-size-mb 600 --repeats 5
    python scripts/bench.py --scale --json scale.json   # bookkeeping at scale only
    python scripts/bench.py --incremental --json inc.json   # three saves of a frozen base

The GCS part runs against fake-gcs-server on 127.0.0.1 (`scripts/bench_gcs.py`); the last part
trains a small model while each contender saves in the background (`scripts/bench_train.py`);
the node-local tier part runs 2 ranks with their own local folders (`scripts/bench_local.py`).
`--scale` runs only the bookkeeping-at-scale part instead (`scripts/bench_scale.py`): states of
many small entries, and simulated many-rank inputs to the functions rank 0 and every rank run.
`--incremental` runs only the incremental part instead (`scripts/bench_incremental.py`): three
saves of a model whose frozen base holds most of the bytes, against the peers and on GCS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Timer, fingerprint, make_module, state_tensors, zero_state  # noqa: E402
from bench_train import CONTENDERS as TRAIN_CONTENDERS  # noqa: E402
from bench_train import LABELS as TRAIN_LABELS  # noqa: E402
from bench_train import PEERS as TRAIN_PEERS  # noqa: E402
from bench_train import TRAINCKPT_MODES, bench_training  # noqa: E402

from trainckpt import Checkpointer, CheckpointerConfig, ModelAndOptim  # noqa: E402
from trainckpt.format import shard_checksums

TRAIN_STATE = {"step": 1, "note": "bench"}
CONTENDERS = ("raw", "torch", "dcp", "olmo", "trainckpt", "async", "overlap", "process")


# -- the page cache --------------------------------------------------------------------------


def drop_page_cache() -> bool:
    """Write dirty pages out and drop the page cache; False when not permitted (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# -- contenders --------------------------------------------------------------------------------


@dataclass
class Contender:
    """One way to save and load the state. `save`/`load` take the target folder."""

    save_label: str
    load_label: str
    save: Callable[[Path], None]
    load: Callable[[Path], None]
    extra: dict[str, list[float]] = field(default_factory=dict)
    """More timings a save records (rows shown before the save's), label -> seconds."""


def raw_floor(module: ModelAndOptim) -> Contender:
    """The same bytes in one file, `write` + `fsync`; read back with `readinto` in place."""

    def save(folder: Path) -> None:
        folder.mkdir(parents=True)
        with open(folder / "raw.bin", "wb", buffering=0) as f:
            for _, t in state_tensors(module.state_dict_to_save()):
                f.write(memoryview(t.numpy()).cast("B"))
            os.fsync(f.fileno())

    def load(folder: Path) -> None:
        with open(folder / "raw.bin", "rb", buffering=0) as f:
            for _, t in state_tensors(module.state_dict_to_save()):
                view = memoryview(t.numpy()).cast("B")
                got = 0
                while got < len(view):
                    got += f.readinto(view[got:]) or _eof(folder)

    return Contender("raw write+fsync", "raw read", save, load)


def _eof(folder: Path) -> int:
    raise RuntimeError(f"{folder}/raw.bin is shorter than the state")


def torch_save(module: ModelAndOptim) -> Contender:
    def save(folder: Path) -> None:
        folder.mkdir(parents=True)
        with open(folder / "state.pt", "wb") as f:
            torch.save(module.state_dict_to_save(), f)
            f.flush()
            os.fsync(f.fileno())

    def load(folder: Path) -> None:
        state = torch.load(folder / "state.pt", weights_only=True, map_location="cpu")
        module.load_state_dict(state)

    return Contender("torch.save+fsync", "torch.load", save, load)


def plain_dcp(module: ModelAndOptim) -> Contender:
    import torch.distributed.checkpoint as dcp

    def save(folder: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(module.state_dict_to_save(), checkpoint_id=str(folder))

    def load(folder: Path) -> None:
        reader = dcp.FileSystemReader(str(folder))
        state = module.state_dict_to_load(reader.read_metadata(), optim=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(folder))
        module.load_state_dict(state)

    return Contender("plain DCP save", "plain DCP load", save, load)


def olmo_core(module: ModelAndOptim, work_dir: Path) -> Contender | None:
    try:
        from olmo_core.train.checkpoint import Checkpointer as OlmoCheckpointer
    except ImportError:
        return None
    ckpt = OlmoCheckpointer(work_dir=work_dir)

    def save(folder: Path) -> None:
        ckpt.save(str(folder), module, TRAIN_STATE)

    def load(folder: Path) -> None:
        ckpt.load(str(folder), module)

    return Contender("OLMo-core save", "OLMo-core load", save, load)


def trainckpt_sync(module: ModelAndOptim, ckpt: Checkpointer) -> Contender:
    def save(folder: Path) -> None:
        ckpt.save(folder, module, TRAIN_STATE)

    def load(folder: Path) -> None:
        ckpt.load(folder, module)

    return Contender("trainckpt save", "trainckpt load", save, load)


def trainckpt_async(
    module: ModelAndOptim, ckpt: Checkpointer, label: str = "trainckpt save_async"
) -> Contender:
    """`save_async`: the call returns once the state is copied to CPU memory; timed also until
    committed. `label` names the rows (one per `async_writer`)."""
    blocked: list[float] = []

    def save(folder: Path) -> None:
        start = time.perf_counter()
        future = ckpt.save_async(folder, module, TRAIN_STATE)
        blocked.append(time.perf_counter() - start)
        future.result()

    def load(folder: Path) -> None:
        ckpt.load(folder, module)

    return Contender(
        f"{label}: until committed",
        f"trainckpt load (after {label.removeprefix('trainckpt ')})",
        save,
        load,
        extra={f"{label}: call blocks": blocked},
    )


def trainckpt_overlap(module: ModelAndOptim, ckpt: Checkpointer) -> Contender:
    """`save_async(overlap_staging=True)`: the call returns before the copy to CPU memory, which
    overlaps the next forward/backward; `wait_for_staging()` before the optimizer step."""
    blocked: list[float] = []
    staged: list[float] = []

    def save(folder: Path) -> None:
        start = time.perf_counter()
        future = ckpt.save_async(folder, module, TRAIN_STATE, overlap_staging=True)
        blocked.append(time.perf_counter() - start)
        ckpt.wait_for_staging()
        staged.append(time.perf_counter() - start)
        future.result()

    def load(folder: Path) -> None:
        ckpt.load(folder, module)

    label = "trainckpt save_async(overlap)"
    return Contender(
        f"{label}: until committed",
        "trainckpt load (after overlap)",
        save,
        load,
        extra={f"{label}: call blocks": blocked, f"{label}: until staged": staged},
    )


# -- running -------------------------------------------------------------------------------------


@dataclass
class Samples:
    save: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)


def run(
    contenders: list[Contender], module: ModelAndOptim, root: Path, repeats: int
) -> tuple[dict[str, Samples], bool]:
    """Alternate the contenders `repeats` times (rotating the order); time saves and loads."""
    expected = fingerprint(module)
    samples = {c.save_label: Samples() for c in contenders}
    cold = True
    for r in range(repeats):
        order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
        for c in order:
            folder = root / f"c{contenders.index(c)}-r{r}" / "step1"
            cold = drop_page_cache() and cold
            with Timer() as t:
                c.save(folder)
            samples[c.save_label].save.append(t.seconds)
            zero_state(module)
            cold = drop_page_cache() and cold
            with Timer() as t:
                c.load(folder)
            samples[c.save_label].load.append(t.seconds)
            got = fingerprint(module)
            if got != expected:
                raise RuntimeError(f"{c.load_label}: the loaded state differs from the saved")
            shutil.rmtree(folder.parent)
            took = samples[c.save_label]
            print(
                f"  repeat {r + 1}/{repeats} {c.save_label}: save {took.save[-1]:.2f}s "
                f"load {took.load[-1]:.2f}s",
                flush=True,
            )
    return samples, cold


def async_matches_sync(module: ModelAndOptim, ckpt: Checkpointer, root: Path) -> bool:
    """Save once with `save` and once with `save_async`: the same files, with equal size and
    CRC32C, except DCP's `.metadata` (a random save id and the folder's path) and the record
    at the end of each shard (the same save id): there, the items (offset, length, CRC32C)."""
    a, b = root / "cmp-sync" / "step1", root / "cmp-async" / "step1"
    ckpt.save(a, module, TRAIN_STATE)
    ckpt.save_async(b, module, TRAIN_STATE).result()
    files = [_comparable(a), _comparable(b)]
    shutil.rmtree(a.parent)
    shutil.rmtree(b.parent)
    return files[0] == files[1] and len(files[0]) > 1


def _comparable(folder: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rel, entry in json.loads((folder / ".manifest.json").read_text())["files"].items():
        if rel.endswith(("/.metadata", "/.metadata.trainckpt")):  # both hold the save id
            continue
        if rel.endswith(".distcp"):
            with open(folder / rel, "rb") as f:
                out[rel] = shard_checksums.read(f, rel).items
        else:
            out[rel] = entry
    return out


# -- reporting ---------------------------------------------------------------------------------


def summary(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def rows(contenders: list[Contender], samples: dict[str, Samples]) -> dict[str, dict[str, Any]]:
    """Table rows in display order: each contender's save then load."""
    out: dict[str, dict[str, Any]] = {}
    for c in contenders:
        for label, xs in c.extra.items():
            out[label] = summary(xs)
        out[c.save_label] = summary(samples[c.save_label].save)
        out[c.load_label] = summary(samples[c.save_label].load)
    return out


def table(results: dict[str, dict[str, Any]], nbytes: int, cold: bool) -> str:
    raw_save = results.get("raw write+fsync", {}).get("median")
    raw_load = results.get("raw read", {}).get("median")
    olmo_save = results.get("OLMo-core save", {}).get("median")
    olmo_load = results.get("OLMo-core load", {}).get("median")
    head = (
        f"{'operation':<46} {'median s':>9} {'min–max s':>13} {'GB/s':>6} "
        f"{'× raw':>6} {'× OLMo':>7}"
    )
    lines = [head, "-" * len(head)]
    for label, r in results.items():
        is_load = "load" in label or "read" in label
        raw = raw_load if is_load else raw_save
        olmo = olmo_load if is_load else olmo_save
        med = r["median"]
        lines.append(
            f"{label:<46} {med:>9.2f} {r['min']:>6.2f}–{r['max']:<6.2f} "
            f"{nbytes / med / 1e9:>6.2f} {_ratio(med, raw):>6} {_ratio(med, olmo):>7}"
        )
    lines.append(
        f"(loads {'cold: page cache dropped before each' if cold else 'WARM: cache not dropped'}"
        "; × = time relative to that row's reference, lower is faster)"
    )
    return "\n".join(lines)


def targets(report: dict[str, Any]) -> list[str]:
    """The issue's targets, each with this run's ratio (medians of the same run)."""
    r = {k: v["median"] for k, v in report.get("results", {}).items()}
    out: list[str] = []

    def line(what: str, value: float | None, target: str, ok: bool | None) -> None:
        shown = "n/a" if value is None else f"{value:.2f}"
        verdict = "not measured" if ok is None else ("met" if ok else "NOT met")
        out.append(f"target {what}: {shown} (want {target}) -> {verdict}")

    def ratio(a: str, b: str) -> float | None:
        return r[a] / r[b] if a in r and b in r else None

    x = ratio("trainckpt save", "raw write+fsync")
    line("sync save / raw write+fsync", x, "<= 1.3", None if x is None else x <= 1.3)
    x = ratio("trainckpt save", "OLMo-core save")
    line("sync save / OLMo-core save", x, "<= 1.0", None if x is None else x <= 1.0)
    x = ratio("trainckpt save_async: call blocks", "trainckpt save")
    line("save_async blocking / sync save", x, "<= 0.10", None if x is None else x <= 0.10)
    for mode in ("overlap", "process"):
        x = ratio(f"trainckpt save_async({mode}): call blocks", "trainckpt save")
        line(
            f"save_async({mode}) blocking / sync save",
            x,
            "<= 0.10",
            None if x is None else x <= 0.10,
        )
    x = ratio("trainckpt load", "OLMo-core load")
    line("load / OLMo-core load", x, "<= 1.0", None if x is None else x <= 1.0)
    out.extend(training_targets(report.get("training", {}).get("results", {})))
    gcs = report.get("gcs", {}).get("results", {})
    for op in ("save", "load"):
        a, b = gcs.get(f"GCS trainckpt {op}"), gcs.get(f"GCS OLMo-core {op}")
        x = b["median"] / a["median"] if a and b else None
        line(f"GCS {op} throughput / OLMo-core's", x, ">= 1.5", None if x is None else x >= 1.5)
    latest = report.get("gcs", {}).get("latest_checkpoint", {})
    if "trainckpt" in latest and "OLMo-core" in latest:
        x = latest["OLMo-core"]["requests"] / max(1, latest["trainckpt"]["requests"])
        line("latest_checkpoint requests, OLMo-core / trainckpt", x, ">= 10", x >= 10)
    imp = report.get("import", {}).get("import trainckpt after torch", {}).get("median")
    line("import trainckpt after torch, s", imp, "<= 0.3", None if imp is None else imp <= 0.3)
    return out


def training_targets(res: dict[str, dict[str, Any]]) -> list[str]:
    """Training time lost to each trainckpt background save: against the copy floor's (<= 1.2x;
    the plain floor's when the copy floor did not run) and below every peer's."""
    out = []
    lost = {
        k: res[TRAIN_LABELS[k]]["lost_s"]["median"] for k in TRAIN_LABELS if TRAIN_LABELS[k] in res
    }
    floor_key = "copy-floor" if "copy-floor" in lost else "floor"
    floor = lost.get(floor_key)
    peers = {k: v for k, v in lost.items() if k in TRAIN_PEERS}
    for key in TRAINCKPT_MODES:
        if key not in lost:
            continue
        label = TRAIN_LABELS[key]
        if floor is not None:
            x = lost[key] / floor if floor > 0 else None
            verdict = "not measured" if x is None else ("met" if x <= 1.2 else "NOT met")
            shown = "n/a (the floor lost no time)" if x is None else f"{x:.2f}"
            out.append(
                f"target {label}: training lost / {TRAIN_LABELS[floor_key]}'s: {shown} "
                f"(want <= 1.2) -> {verdict}"
            )
        if peers:
            theirs = ", ".join(f"{TRAIN_LABELS[k]} {v:.2f}s" for k, v in peers.items())
            verdict = "met" if all(lost[key] < v for v in peers.values()) else "NOT met"
            out.append(
                f"target {label}: training lost {lost[key]:.2f}s below every peer's ({theirs}) "
                f"-> {verdict}"
            )
    return out


def _ratio(x: float, ref: float | None) -> str:
    return f"{x / ref:.2f}" if ref else "–"


def import_times(repeats: int = 5) -> dict[str, Any]:
    """Seconds for `import torch`, and for `import trainckpt` after it, in fresh processes."""
    code = (
        "import time;t=time.perf_counter();import torch;a=time.perf_counter();"
        "import trainckpt;b=time.perf_counter();print(a-t,b-a)"
    )
    torch_s, extra_s = [], []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        a, b = (float(x) for x in out.stdout.split())
        torch_s.append(a)
        extra_s.append(b)
    return {"import torch": summary(torch_s), "import trainckpt after torch": summary(extra_s)}


def machine(root: Path) -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    fs = subprocess.run(["df", "-T", str(root)], capture_output=True, text=True).stdout.split("\n")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem, 1),
        "filesystem": fs[1].split()[1] if len(fs) > 1 and fs[1] else "unknown",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": os.getloadavg(),
    }


# -- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=1200.0, help="state size (model + 2 moments)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    p.add_argument("--import-repeats", type=int, default=5, help="fresh processes timing imports")
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(CONTENDERS)}")
    p.add_argument("--no-gcs", action="store_true", help="skip the fake-gcs-server part")
    p.add_argument("--gcs-size-mb", type=float, default=200.0)
    p.add_argument("--gcs-checkpoints", type=int, default=200)
    p.add_argument("--no-local", action="store_true", help="skip the node-local tier part")
    p.add_argument("--local-size-mb", type=float, default=200.0, help="local tier: state per rank")
    p.add_argument("--no-training", action="store_true", help="skip the training-loop part")
    p.add_argument("--training-only", action="store_true", help="run only the training-loop part")
    p.add_argument("--train-size-mb", type=float, default=600.0, help="state saved while training")
    p.add_argument(
        "--train-only",
        default="",
        help=f"comma-separated subset of {','.join(TRAIN_CONTENDERS)} (training part)",
    )
    p.add_argument("--scale", action="store_true", help="run only the bookkeeping-at-scale part")
    p.add_argument(
        "--incremental",
        action="store_true",
        help="run only the incremental part: three saves of a mostly frozen model",
    )
    p.add_argument(
        "--incremental-size-mb", type=float, default=400.0, help="--incremental: frozen base size"
    )
    p.add_argument(
        "--incremental-entries",
        type=int,
        default=16_000,
        help="--incremental: entries of the fully trained many-entry state",
    )
    p.add_argument(
        "--scale-entries",
        default="2000,16000,64000",
        help="--scale: state sizes in entries (comma-separated)",
    )
    p.add_argument(
        "--scale-contenders",
        default="trainckpt,dcp,olmo,torch_checkpointing",
        help="--scale: the entries part's contenders (comma-separated subset of the default)",
    )
    p.add_argument(
        "--scale-sampled-s",
        type=float,
        default=2.0,
        help="--scale: repeat a small state (up to 5x --repeats) until its samples add up to "
        "about this many seconds per contender",
    )
    p.add_argument(
        "--scale-ranks",
        default="16,256,1024,4096,8192",
        help="--scale: simulated rank counts (comma-separated)",
    )
    p.add_argument(
        "--scale-tensors", type=int, default=16, help="--scale: tensors sharded over every rank"
    )
    p.add_argument(
        "--scale-load",
        default="1000x2048",
        help="--scale: TENSORSxRANKS of the simulated load of a sharded checkpoint's metadata "
        "('0': skip it)",
    )
    p.add_argument(
        "--scale-training-entries",
        type=int,
        default=16000,
        help="--scale: entries of the state saved in the background while a model trains "
        "(0: skip that part)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    # DCP says on every single-process call that it assumes a single process; it is right.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    root = Path(tempfile.mkdtemp(prefix="trainckpt-bench-", dir=args.dir))
    report: dict[str, Any] = {"machine": machine(root), "notes": []}
    try:
        if args.incremental:
            from bench_incremental import bench_incremental

            report["incremental"] = bench_incremental(
                args.incremental_size_mb,
                root,
                args.repeats,
                gcs=not args.no_gcs,
                entries=args.incremental_entries,
            )
            report["notes"] += report["incremental"]["notes"]
        elif args.scale:
            from bench_scale import bench_scale

            report["scale"] = bench_scale(
                [int(x) for x in args.scale_entries.split(",")],
                args.repeats,
                [int(x) for x in args.scale_ranks.split(",")],
                args.scale_tensors,
                root,
                args.scale_training_entries,
                args.scale_contenders.split(","),
                None
                if args.scale_load == "0"
                else tuple(int(x) for x in args.scale_load.split("x", 1)),  # type: ignore[arg-type]
                args.scale_sampled_s,
            )
            report["notes"] += report["scale"]["entries"]["notes"]
            report["notes"] += report["scale"].get("training", {}).get("notes", [])
        elif not args.training_only:
            _bench(args, root, report)
        if not args.no_training and not args.scale and not args.incremental:
            report["training"] = bench_training(
                args.train_size_mb, args.repeats, root / "training", args.train_only
            )
            report["notes"] += report["training"]["notes"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.incremental:
        from bench_incremental import targets as incremental_targets

        report["targets"] = incremental_targets(report["incremental"])
    elif args.scale:
        from bench_scale import scale_targets

        report["targets"] = scale_targets(report["scale"])
    else:
        report["targets"] = targets(report)
    print()
    for line in report["targets"]:
        print(line)
    for note in report["notes"]:
        print(f"note: {note}")
    report["machine"]["load_average_at_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _bench(args: argparse.Namespace, root: Path, report: dict[str, Any]) -> None:
    """The save and load rows, import times and the GCS part, into `report`."""
    module = make_module(args.size_mb)
    tensors = [t for _, t in state_tensors(module.state_dict_to_save())]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    info = report["machine"]
    print(
        f"state: {nbytes / 1e9:.3f} GB in {len(tensors)}"
        f" tensors; {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, "
        f"{info['filesystem']} at {root}",
        flush=True,
    )

    # incremental=False: every repeat saves the same, unchanged state; each must write it all
    ckpt = CheckpointerConfig(work_dir=root / "work", incremental=False).build()
    closing = [ckpt]
    wanted = set(args.only.split(",")) if args.only else set(CONTENDERS)
    if "process" in wanted:  # built first: its writer process starts while the others run
        writer = CheckpointerConfig(
            work_dir=root / "work-process", async_writer="process", incremental=False
        )
        closing.append(writer.build())
    contenders = []
    notes = report["notes"]
    for key in CONTENDERS:
        if key not in wanted:
            continue
        if key == "olmo":
            olmo = olmo_core(module, root / "olmo-work")
            if olmo is None:
                notes.append("OLMo-core not installed (pip install trainckpt[bench]): skipped")
                continue
            contenders.append(olmo)
        elif key == "async":
            contenders.append(trainckpt_async(module, ckpt))
        elif key == "overlap":
            contenders.append(trainckpt_overlap(module, ckpt))
        elif key == "process":
            contenders.append(trainckpt_async(module, closing[-1], "trainckpt save_async(process)"))
        elif key == "trainckpt":
            contenders.append(trainckpt_sync(module, ckpt))
        else:
            simple = {"raw": raw_floor, "torch": torch_save, "dcp": plain_dcp}
            contenders.append(simple[key](module))

    samples, cold = run(contenders, module, root, args.repeats)
    identical = async_matches_sync(module, ckpt, root) if "async" in wanted else None
    for c in closing:
        c.close()
    results = rows(contenders, samples)
    report.update(
        state_bytes=nbytes,
        repeats=args.repeats,
        loads="cold" if cold else "warm",
        results=results,
        async_files_identical_to_sync=identical,
    )
    print()
    print(table(results, nbytes, cold))
    print(f"save_async files identical to save's (size + CRC32C): {identical}")

    report["import"] = import_times(args.import_repeats)
    imp = report["import"]
    print(
        f"import torch: {imp['import torch']['median']:.2f}s; import trainckpt after torch: "
        f"+{imp['import trainckpt after torch']['median']:.2f}s "
        f"(median of {args.import_repeats})"
    )

    if not args.no_gcs:
        from bench_gcs import bench_gcs

        report["gcs"] = bench_gcs(args.gcs_size_mb, args.gcs_checkpoints, args.repeats, root)

    if not args.no_local:
        from bench_local import bench_local

        report["local"] = bench_local(args.local_size_mb, args.repeats, root)


if __name__ == "__main__":
    sys.exit(main())
