"""Bookkeeping at scale: `python scripts/bench.py --scale` runs this part.

Three measurements, each a table and a `scale` section of `--json`:

1. **Many entries, one rank.** States shaped like MoE layers (each layer 50 experts
   `Linear(16, 16)` with AdamW: 8 state entries per expert, 400 per layer; 2,000 / 16,000 /
   64,000 entries by default) are saved and loaded by every contender, alternating in one run:
   trainckpt (`save`, `save_async` until committed, `load`), plain DCP, OLMo-core and PyTorch's
   `torch_checkpointing` (sync saver; on CPU with pinned memory and direct I/O off; it does not
   fsync, every other contender does). Each load is checked against the saved state. Reported:
   seconds, the cost per entry, and how that cost grows from the smallest state to the largest.
   Each contender first saves each state once, timed apart as its *first save* (what a
   restarted job pays once: trainckpt then plans, with its per-process caches emptied before);
   the medians are of the saves after it: `--repeats` of them, or more for a small state
   (up to 5x, until about 2 s of samples: `size_repeats`), whose 0.1 s timings are noisy.
2. **Simulated many ranks.** Real thousand-rank jobs are not available here, so synthetic
   per-rank inputs for 256..8,192 ranks (every tensor sharded over every rank) are fed to the
   functions rank 0 and every rank run: DCP's global save planning, the manifest and the
   commit's file check (rank 0), and reading the checkpoint's metadata (every rank: a foreign
   `.metadata` through the safe unpickler against `pickle` itself, and trainckpt's own
   `.metadata.trainckpt`). Reported: seconds and peak
   traced memory per function. Beside them, one-rank files as DCP itself writes them: the
   `.metadata` that `dcp.save` writes for each MoE state (up to 16,000 entries), read
   through the safe unpickler and through `pickle` in turn.
   A **simulated load** (`--scale-load`, default 1,000 tensors x 2,048 ranks: 2 million
   chunks): one rank decodes the `.metadata.trainckpt` of such a checkpoint, plans the load
   of its row shard of every tensor with trainckpt's load planner and looks up each read
   item's stored piece; on as many ranks and on three quarters as many. Reported: seconds
   (median of at least 5), traced peak and resident growth.
3. **Training beside a background save** of the 16,000-entry state (`--scale-training-entries`):
   the training loop of `bench_train.py` (a small transformer on one thread) while trainckpt's
   `save_async` writes, with writer threads, with a writer process, and with a writer process
   and overlapped staging, beside the copy floor. Reported: training time lost and the step
   time during the save over the step time before it.
"""

from __future__ import annotations

import gc
import math
import pickle
import shutil
import statistics
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Timer, after_one_step, fingerprint, zero_state  # noqa: E402

from trainckpt import Checkpointer, CheckpointerConfig, ModelAndOptim  # noqa: E402
from trainckpt.core.gc_pause import paused_gc  # noqa: E402

EXPERTS = 50
ENTRIES_PER_LAYER = EXPERTS * 8  # weight + bias, each with step, exp_avg, exp_avg_sq
TRAIN_STATE = {"step": 1}
TC_NOTE = "torch_checkpointing does not fsync its files (every other contender does)"


def make_moe(entries: int, seed: int = 0) -> ModelAndOptim:
    """Layers of `EXPERTS` experts `Linear(16, 16)` with AdamW after one step: `entries` state
    entries (rounded to whole layers, at least one)."""
    layers = max(1, round(entries / ENTRIES_PER_LAYER))
    torch.manual_seed(seed)
    model = torch.nn.ModuleList(
        torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(EXPERTS)) for _ in range(layers)
    )
    return after_one_step(model)


def entry_count(module: ModelAndOptim) -> int:
    params = list(module.model.parameters())
    assert module.optim is not None
    return len(params) + sum(len(s) for s in module.optim.state.values())


# -- contenders --------------------------------------------------------------------------------


@dataclass
class ScaleContender:
    label: str
    save: Callable[[Path], None]
    load: Callable[[Path], None]
    note: str = ""


SCALE_CONTENDERS = ("trainckpt", "dcp", "olmo", "torch_checkpointing")
"""`--scale-contenders` keys (default: all). Plain DCP and OLMo-core take ~10x longer than
the others at tens of thousands of entries: leaving them out keeps a 64,000-entry run short."""


def contenders(
    module: ModelAndOptim,
    ckpt: Checkpointer,
    work: Path,
    wanted: Collection[str] = SCALE_CONTENDERS,
) -> list[ScaleContender]:
    import torch.distributed.checkpoint as dcp

    out = []
    if "trainckpt" in wanted:
        out += [
            ScaleContender(
                "trainckpt save",
                lambda f: ckpt.save(f, module, TRAIN_STATE),
                lambda f: ckpt.load(f, module),
            ),
            ScaleContender(
                "trainckpt save_async",
                lambda f: ckpt.save_async(f, module, TRAIN_STATE).result(),
                lambda f: ckpt.load(f, module),
            ),
        ]

    def dcp_save(folder: Path) -> None:
        dcp.save(module.state_dict_to_save(), checkpoint_id=str(folder))

    def dcp_load(folder: Path) -> None:
        reader = dcp.FileSystemReader(str(folder))
        state = module.state_dict_to_load(reader.read_metadata(), optim=True)
        dcp.load(state, checkpoint_id=str(folder))
        module.load_state_dict(state)

    if "dcp" in wanted:
        out.append(ScaleContender("plain DCP", dcp_save, dcp_load))
    try:
        from olmo_core.train.checkpoint import Checkpointer as OlmoCheckpointer
    except ImportError:
        wanted = set(wanted) - {"olmo"}
    if "olmo" in wanted:
        olmo = OlmoCheckpointer(work_dir=work / "olmo-work")
        out.append(
            ScaleContender(
                "OLMo-core",
                lambda f: olmo.save(str(f), module, TRAIN_STATE),
                lambda f: olmo.load(str(f), module),
            )
        )
    tc = torch_checkpointing(module) if "torch_checkpointing" in wanted else None
    if tc is not None:
        out.append(tc)
    return out


def torch_checkpointing(module: ModelAndOptim) -> ScaleContender | None:
    """PyTorch's `torch_checkpointing` 0.1 (sync saver), set up for the CPU: direct I/O off
    (pinned memory is off by itself without CUDA)."""
    try:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.config import SyncCheckpointSaverConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    except ImportError:
        return None
    manager = CheckpointManager(
        CheckpointManager.Config(
            save=SyncCheckpointSaverConfig(),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )
    assert module.optim is not None
    optim = module.optim

    def payload() -> dict[str, Any]:
        return {"model": module.model.state_dict(), "optim": optim.state_dict()}

    return ScaleContender(
        "torch_checkpointing",
        lambda f: manager.save(str(f), payload()),
        lambda f: manager.load(str(f), into=payload()),
        note=TC_NOTE,
    )


# -- many entries, one rank --------------------------------------------------------------------


SAMPLED_S = 2.0
"""A small state is saved and loaded more often than `--repeats` says (at most 5 times as
often), until each contender's samples add up to about this many seconds
(`--scale-sampled-s`): a 2,000-entry load takes 0.1 s, and the growth of the cost per entry
is divided by that median."""


def size_repeats(repeats: int, first_save_s: float, sampled_s: float = SAMPLED_S) -> int:
    """Repeats of a state whose slowest first save took `first_save_s` (`SAMPLED_S`)."""
    wanted = math.ceil(sampled_s / max(first_save_s, 1e-3))
    return max(repeats, min(5 * repeats, wanted))


def bench_entries(
    sizes: list[int],
    repeats: int,
    root: Path,
    wanted: Collection[str] = SCALE_CONTENDERS,
    sampled_s: float = SAMPLED_S,
) -> dict[str, Any]:
    """Every contender saves and loads a MoE-shaped state of each size in `sizes` (entries),
    alternating, `repeats` times or more (`size_repeats`); medians, cost per entry and its
    growth."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    results: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    ckpt = CheckpointerConfig(work_dir=root / "scale-work", incremental=False).build()
    try:
        for size in sizes:
            module = make_moe(size)
            entries = entry_count(module)
            expected = fingerprint(module)
            cs = contenders(module, ckpt, root, wanted)
            for c in cs:
                if c.note and c.note not in notes:
                    notes.append(c.note)
            save: dict[str, list[float]] = {c.label: [] for c in cs}
            load: dict[str, list[float]] = {c.label: [] for c in cs}
            first: dict[str, float] = {}
            for c in cs:  # the first save of this state, apart from the medians
                folder = root / f"scale-{size}-{cs.index(c)}-first" / "step1"
                if c.label.startswith("trainckpt"):
                    _forget_plans()
                gc.collect()
                with Timer() as t:
                    c.save(folder)
                first[c.label] = t.seconds
                shutil.rmtree(folder.parent)
                print(f"  scale {entries} entries, first save {c.label}: {t.seconds:.2f}s")
            count = size_repeats(repeats, max(first.values()), sampled_s)
            for r in range(count):
                for c in cs[r % len(cs) :] + cs[: r % len(cs)]:
                    folder = root / f"scale-{size}-{cs.index(c)}-{r}" / "step1"
                    gc.collect()
                    with Timer() as t:
                        c.save(folder)
                    save[c.label].append(t.seconds)
                    zero_state(module)
                    gc.collect()
                    with Timer() as t:
                        c.load(folder)
                    load[c.label].append(t.seconds)
                    if fingerprint(module) != expected:
                        raise RuntimeError(f"{c.label} at {entries} entries: the load differs")
                    shutil.rmtree(folder.parent)
                    print(
                        f"  scale {entries} entries, repeat {r + 1}/{count} {c.label}: "
                        f"save {save[c.label][-1]:.2f}s load {load[c.label][-1]:.2f}s",
                        flush=True,
                    )
            for c in cs:
                s, ld = statistics.median(save[c.label]), statistics.median(load[c.label])
                results.setdefault(c.label, {})[str(entries)] = {
                    "entries": entries,
                    "save_s": s,
                    "load_s": ld,
                    "first_save_s": first[c.label],
                    "repeats": count,
                    "save_us_per_entry": s / entries * 1e6,
                    "load_us_per_entry": ld / entries * 1e6,
                    "save_samples": save[c.label],
                    "load_samples": load[c.label],
                }
    finally:
        ckpt.close()
    for by_size in results.values():
        points = list(by_size.values())
        for op in ("save", "load"):
            first, last = points[0][f"{op}_us_per_entry"], points[-1][f"{op}_us_per_entry"]
            by_size[f"{op}_growth"] = last / first  # type: ignore[assignment]
    return {"results": results, "repeats": repeats, "notes": notes}


def _forget_plans() -> None:
    """Empty trainckpt's per-process caches of plans, files and metadata bytes, as in a new
    process: the next save plans from scratch."""
    from trainckpt.core import plan_cache
    from trainckpt.format import metadata_files, shard_writer

    plan_cache.forget()
    metadata_files.forget()
    with shard_writer._files_lock:
        shard_writer._kept_files.clear()


def entries_table(report: dict[str, Any]) -> str:
    head = (
        f"{'contender':<22} {'entries':>8} {'first save s':>12} {'save s':>8} {'load s':>8} "
        f"{'save µs/entry':>14} {'load µs/entry':>14}"
    )
    lines = [head, "-" * len(head)]
    for label, by_size in report["results"].items():
        for r in by_size.values():
            if not isinstance(r, dict):
                continue
            lines.append(
                f"{label:<22} {r['entries']:>8} {r.get('first_save_s', float('nan')):>12.2f} "
                f"{r['save_s']:>8.2f} {r['load_s']:>8.2f} "
                f"{r['save_us_per_entry']:>14.0f} {r['load_us_per_entry']:>14.0f}"
            )
        lines.append(
            f"{label:<22} {'growth':>8} per entry, largest / smallest state: save "
            f"{by_size['save_growth']:.2f}×, load {by_size['load_growth']:.2f}×"
        )
    lines += [f"note: {n}" for n in report["notes"]]
    lines.append(
        "note: 'first save s' is each contender's first save of the state (trainckpt plans "
        "then); save s and load s are medians of the saves and loads after it (repeats per "
        "state: "
        + ", ".join(
            f"{r['entries']}: {r.get('repeats', report['repeats'])}"
            for r in next(iter(report["results"].values()), {}).values()
            if isinstance(r, dict)
        )
        + ")"
    )
    return "\n".join(lines)


# -- simulated many ranks ----------------------------------------------------------------------


def _measure(fn: Callable[[], Any]) -> dict[str, float]:
    """Seconds of one call, then the peak memory it allocated (a second, traced call)."""
    gc.collect()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return {"s": seconds, "peak_mb": _traced_peak(fn) / 1e6}


def _alternated(
    fns: dict[str, Callable[[], Any]], rounds: int = 7, sampled_s: float = 1.0, most: int = 300
) -> dict[str, Any]:
    """`_measure` for contenders whose ratio is a target: called in turn after a warm-up call
    each, `rounds` times or more, until each has about `sampled_s` of samples (at most `most`
    rounds: a call of a few milliseconds, seven times, is mostly noise); the median seconds
    (and the min-max) and the number of rounds. Every call is timed alike: with the garbage
    collector paused, its result dropped after the clock stops and before the collector
    resumes. (A contender that resumed the collector while its result was still alive paid
    for a collection of that result inside its time: `pickle.loads` in a `with paused_gc()`
    block took 40 % longer than the same call under `load_dcp_metadata`'s own pause, and the
    ratio of the two read 1.37 where it was 1.69.)"""
    times: dict[str, list[float]] = {name: [] for name in fns}
    with paused_gc():
        for fn in fns.values():
            fn()
    done = 0
    while done < rounds or (done < most and min(map(sum, times.values())) < sampled_s):
        for name, fn in fns.items():
            with paused_gc():
                start = time.perf_counter()
                result = fn()
                times[name].append(time.perf_counter() - start)
                del result
        done += 1
    return {
        name: {
            "s": statistics.median(t),
            "min": min(t),
            "max": max(t),
            "rounds": done,
            "peak_mb": _traced_peak(fns[name]) / 1e6,
        }
        for name, t in times.items()
    }


def _traced_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes of Python objects one call of `fn` allocated (traced, after a collection)."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return int(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


class _Listing:
    """The part of a `Storage` the commit's file check calls: a fixed listing."""

    def __init__(self, files: dict[str, int]) -> None:
        self.files = files

    def list_files(self, folder: str) -> dict[str, int]:
        return dict(self.files)


def _sim_save_plans(ranks: int, tensors: int) -> list[Any]:
    """Each rank's local DCP save plan: one row-shard of each of `tensors` tensors."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    props = TensorProperties(dtype=torch.float32)
    size = torch.Size([ranks, 64])
    return [
        SavePlan(
            [
                WriteItem(
                    index=MetadataIndex(f"layers.{t}.weight", torch.Size([r, 0])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, 64])),
                        properties=props,
                        size=size,
                    ),
                )
                for t in range(tensors)
            ],
            planner_data={},
        )
        for r in range(ranks)
    ]


def sim_metadata(ranks: int, tensors: int) -> Any:
    """A DCP `Metadata` of `tensors` tensors, each sharded over `ranks` ranks."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    props = TensorProperties(dtype=torch.float32)
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for t in range(tensors):
        fqn = f"layers.{t}.weight"
        chunks = []
        for r in range(ranks):
            chunks.append(ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, 64])))
            storage[MetadataIndex(fqn, torch.Size([r, 0]))] = _StorageInfo(
                f"__{r}_0.distcp", t * 1024, 1024
            )
        state[fqn] = TensorStorageMetadata(props, torch.Size([ranks, 64]), chunks)
    return Metadata(state_dict_metadata=state, storage_data=storage)


def bench_ranks(rank_counts: list[int], tensors: int, sampled_s: float = 1.0) -> dict[str, Any]:
    """Time and peak memory of each per-rank and rank-0 function, per simulated rank count;
    the safe unpickler against `pickle.loads` on about `sampled_s` of calls each."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from trainckpt.core.commit_steps import check_complete
    from trainckpt.format import native_metadata
    from trainckpt.format.records import CheckpointManifest
    from trainckpt.format.safe_unpickle import load_dcp_metadata
    from trainckpt.storage.checksums import FileEntry

    out: dict[str, dict[str, Any]] = {}
    for ranks in rank_counts:
        row: dict[str, Any] = {"chunks": ranks * tensors}
        plans = _sim_save_plans(ranks, tensors)

        def plan(plans: list[Any] = plans) -> None:
            planner = DefaultSavePlanner()
            planner.create_global_plan(plans)

        row["rank 0: DCP global save plan"] = _measure(plan)
        del plans
        parts = [
            {
                f"model/__{r}_{i}.distcp": FileEntry(size=4096 + i, crc32c=f"{r:08x}")
                for i in range(4)
            }
            | {f"train/rank{r}.pt": FileEntry(size=100, crc32c="00000000")}
            for r in range(ranks)
        ]
        listing = _Listing({k: e.size for p in parts for k, e in p.items()})

        def manifest(parts: list[Any] = parts, ranks: int = ranks) -> bytes:
            return CheckpointManifest.merge(parts, step=1, world_size=ranks).to_json()

        def file_check(
            parts: list[Any] = parts, listing: _Listing = listing, ranks: int = ranks
        ) -> None:
            m = CheckpointManifest.merge(parts, step=1, world_size=ranks)
            check_complete(listing, "ckpt", m)  # type: ignore[arg-type]

        row["rank 0: manifest"] = _measure(manifest)
        row["rank 0: commit file check"] = _measure(file_check)
        del parts, listing
        data = pickle.dumps(sim_metadata(ranks, tensors))
        row["metadata_bytes"] = len(data)
        row |= _alternated(
            {
                "every rank: pickle.loads(.metadata)": lambda d=data: pickle.loads(d),
                "every rank: safe unpickle (.metadata)": lambda d=data: load_dcp_metadata(
                    d, "sim/.metadata"
                ),
            },
            sampled_s=sampled_s,
        )
        native = native_metadata.encode(sim_metadata(ranks, tensors))
        assert native is not None
        row["native_bytes"] = len(native)
        row["every rank: trainckpt's own record"] = _measure(
            lambda d=native: native_metadata.decode(d, "sim/.metadata.trainckpt")
        )
        out[str(ranks)] = row
        print(f"  simulated {ranks} ranks: done", flush=True)
    return {"tensors": tensors, "results": out}


FOREIGN_MOST = 16_000
"""Largest state whose DCP `.metadata` `bench_foreign` has DCP write (DCP's own save takes
about 1 ms per entry)."""


def bench_foreign(sizes: list[int], root: Path, sampled_s: float = 1.0) -> dict[str, Any]:
    """The safe unpickler against `pickle.loads` on DCP's own `.metadata` of the MoE states of
    `sizes` (up to `FOREIGN_MOST` entries), saved by `dcp.save` on one rank: what a foreign
    one-rank checkpoint costs, beside the simulated sharded ones of `bench_ranks`."""
    import torch.distributed.checkpoint as dcp

    from trainckpt.format.safe_unpickle import load_dcp_metadata

    out: dict[str, dict[str, Any]] = {}
    for size in sorted({min(s, FOREIGN_MOST) for s in sizes}):
        module = make_moe(size)
        folder = root / f"foreign-{size}"
        dcp.save(module.state_dict_to_save(), checkpoint_id=str(folder), no_dist=True)
        data = (folder / ".metadata").read_bytes()
        shutil.rmtree(folder)
        row: dict[str, Any] = {"entries": entry_count(module), "metadata_bytes": len(data)}
        row |= _alternated(
            {
                "pickle.loads": lambda d=data: pickle.loads(d),
                "safe unpickle": lambda d=data, w=f"{folder}/.metadata": load_dcp_metadata(d, w),
                "pickle.loads, collector running": lambda d=data: _collecting_loads(d),
            },
            sampled_s=sampled_s,
        )
        out[str(size)] = row
    return out


def _collecting_loads(data: bytes) -> Any:
    """`pickle.loads` with the garbage collector running, as DCP's and OLMo-core's readers
    call it: what reading a foreign `.metadata` costs them (not a target's reference: the
    collections' cost depends on the whole heap)."""
    paused = not gc.isenabled()
    gc.enable()
    try:
        return pickle.loads(data)
    finally:
        if paused:
            gc.disable()


def foreign_table(report: dict[str, Any]) -> str:
    lines = [
        "DCP's own .metadata of the MoE states (one rank): safe unpickle against pickle.loads",
        "(both with the collector paused; the last column is pickle.loads with it running, as",
        "DCP's reader calls it: not the target's reference)",
        f"{'entries':>8} {'.metadata KB':>13} {'pickle.loads ms':>16} {'safe ms':>9} {'ratio':>6} "
        f"{'collecting ms':>14}",
    ]
    for r in report.values():
        p, s = r["pickle.loads"]["s"], r["safe unpickle"]["s"]
        lines.append(
            f"{r['entries']:>8} {r['metadata_bytes'] / 1e3:>13.0f} {p * 1e3:>16.2f} "
            f"{s * 1e3:>9.2f} {s / p:>6.2f} "
            f"{r['pickle.loads, collector running']['s'] * 1e3:>14.2f}"
        )
    return "\n".join(lines)


def ranks_table(report: dict[str, Any]) -> str:
    rows = report["results"]
    functions = [k for k, v in next(iter(rows.values())).items() if isinstance(v, dict)]
    head = f"{'function (simulated ranks →)':<40}" + "".join(f"{r:>16}" for r in rows)
    lines = [
        f"simulated ranks: {report['tensors']} tensors, each sharded over every rank "
        "(seconds / peak MB)",
        head,
        "-" * len(head),
    ]
    for fn in functions:
        cells = "".join(f"{rows[r][fn]['s']:>8.3f}/{rows[r][fn]['peak_mb']:<7.1f}" for r in rows)
        lines.append(f"{fn:<40}{cells}")
    lines.append(
        f"{'.metadata MB':<40}" + "".join(f"{rows[r]['metadata_bytes'] / 1e6:>16.1f}" for r in rows)
    )
    lines.append(
        f"{'.metadata.trainckpt MB':<40}"
        + "".join(f"{rows[r]['native_bytes'] / 1e6:>16.1f}" for r in rows)
    )
    return "\n".join(lines)


LOAD_SHAPE = (1000, 2048)
"""The simulated load of `--scale-load`: tensors, and ranks each holds a row shard of (2
million chunks: about a Llama-70B-like state of ~1,000 tensors over 2,048 ranks)."""


class _SimShard(torch.Tensor):
    """What DCP's load planner sees of a rank's DTensor shard of a tensor: the tensor's global
    size and the one chunk this rank holds (`__create_chunk_list__`, DTensor's protocol). A
    tensor (empty), as DCP's state walk keeps only tensors and plain values."""

    _global: torch.Size
    _chunk: Any

    @staticmethod
    def make(size: torch.Size, chunk: Any) -> _SimShard:
        shard = torch.Tensor._make_subclass(_SimShard, torch.empty(0))
        shard._global, shard._chunk = size, chunk
        return shard  # type: ignore[no-any-return]

    def size(self, dim: Any = None) -> Any:  # type: ignore[override]
        return self._global if dim is None else self._global[dim]

    def __create_chunk_list__(self) -> list[Any]:
        return [self._chunk]


_SIM_ROWS = 8192
"""Rows (and columns) of every simulated sharded tensor: row shards of `_SIM_ROWS // ranks`."""


def sim_sharded_record(tensors: int, ranks: int) -> bytes:
    """trainckpt's own metadata record (`native_metadata.encode`) of a DCP `Metadata` of
    `tensors` float32 tensors of `_SIM_ROWS` x `_SIM_ROWS`, each saved by `ranks` ranks as
    row shards (rank r's shards in its file `__r_0.distcp`). Equal sizes share one object."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from trainckpt.format import native_metadata

    rows = _SIM_ROWS // ranks
    props = TensorProperties(dtype=torch.float32)
    size = torch.Size([rows * ranks, _SIM_ROWS])
    sizes = torch.Size([rows, _SIM_ROWS])
    offsets = [torch.Size([r * rows, 0]) for r in range(ranks)]
    chunks = [ChunkStorageMetadata(o, sizes) for o in offsets]
    nbytes = rows * _SIM_ROWS * 4
    files = [f"__{r}_0.distcp" for r in range(ranks)]
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for t in range(tensors):
        fqn = f"layers.{t}.weight"
        state[fqn] = TensorStorageMetadata(props, size, chunks)
        for r in range(ranks):
            storage[MetadataIndex(fqn, offsets[r], r)] = _StorageInfo(files[r], t * nbytes, nbytes)
    record = native_metadata.encode(Metadata(state_dict_metadata=state, storage_data=storage))
    assert record is not None
    return record


def _sim_rank_load(record: bytes, tensors: int, saved_ranks: int, ranks: int, rank: int) -> int:
    """What `rank` of `ranks` does with the metadata before reading a byte of a shard, for a
    checkpoint saved by `saved_ranks` (`sim_sharded_record`): decode the record (as
    `dcp_metadata` does), plan the load of its row shard of every tensor (`core/dcp.py`'s
    load planner, as `dcp.load` calls it) and look up each read item's stored piece (as the
    reader does). Returns the read items' count."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from trainckpt.core.dcp import _SafeLoadPlanner
    from trainckpt.format import native_metadata

    with paused_gc():  # a load runs under one pause from reading its metadata on
        md = native_metadata.decode(record, "sim/.metadata.trainckpt")
        size = torch.Size([_SIM_ROWS // saved_ranks * saved_ranks, _SIM_ROWS])
        lo, hi = size[0] * rank // ranks, size[0] * (rank + 1) // ranks
        chunk = ChunkStorageMetadata(torch.Size([lo, 0]), torch.Size([hi - lo, _SIM_ROWS]))
        state = {f"layers.{t}.weight": _SimShard.make(size, chunk) for t in range(tensors)}
        planner = _SafeLoadPlanner("sim", direct=True)
        planner.set_up_planner(state, md, False)
        plan = planner.create_local_plan()
        storage = md.storage_data
        places = [storage[item.storage_index] for item in plan.items]
        return len(places)


def _rss_kb(field: str) -> int | None:
    """`VmRSS` or `VmHWM` (peak) of this process in KiB, None where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _peak_rss_growth(fn: Callable[[], Any]) -> float | None:
    """How far the process's resident memory rose above what it was during one call of
    `fn`, in MB (counts what tracemalloc misses: tensors' memory); None where Linux's peak
    cannot be reset."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what was freed before leaves the RSS
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak (VmHWM) to the current size
    except OSError:
        return None
    before = _rss_kb("VmRSS")
    fn()
    peak = _rss_kb("VmHWM")
    return None if before is None or peak is None else (peak - before) / 1e3


def _measure_median(fn: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Median, min and max seconds of `repeats` calls, then the peak memory one traced call
    allocated (Python objects), and how far one call raised the resident memory (any)."""
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    peak = _traced_peak(fn)
    return {
        "s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "peak_mb": peak / 1e6,
        "rss_growth_mb": _peak_rss_growth(fn),
    }


def bench_rank_load(tensors: int, ranks: int, repeats: int) -> dict[str, Any]:
    """A rank's metadata work on loading a checkpoint of `tensors` tensors sharded over
    `ranks` ranks (`_sim_rank_load`), on as many ranks and on three quarters as many (each
    rank's shard then overlaps two saved ones), and the decode alone."""
    from trainckpt.format import native_metadata

    print(f"  simulated load: {tensors} tensors x {ranks} ranks: encoding", flush=True)
    record = sim_sharded_record(tensors, ranks)
    out: dict[str, Any] = {
        "tensors": tensors,
        "ranks": ranks,
        "chunks": tensors * ranks,
        "native_bytes": len(record),
    }
    out["decode"] = _measure_median(
        lambda: native_metadata.decode(record, "sim/.metadata.trainckpt"), repeats
    )
    rank = ranks // 2 + 1
    out["items"] = _sim_rank_load(record, tensors, ranks, ranks, rank)
    out["decode + load plan + lookups"] = _measure_median(
        lambda: _sim_rank_load(record, tensors, ranks, ranks, rank), repeats
    )
    fewer = ranks * 3 // 4
    out["items_resharded"] = _sim_rank_load(record, tensors, ranks, fewer, fewer // 2 + 1)
    out[f"the same, loaded on {fewer} ranks"] = _measure_median(
        lambda: _sim_rank_load(record, tensors, ranks, fewer, fewer // 2 + 1), repeats
    )
    return out


def rank_load_table(report: dict[str, Any]) -> str:
    lines = [
        f"simulated load: {report['tensors']} tensors x {report['ranks']} ranks = "
        f"{report['chunks']:,} chunks; .metadata.trainckpt {report['native_bytes'] / 1e6:.0f} MB"
        " (one rank's work, the file's bytes already read; seconds: median (min-max); "
        "peak MB: traced Python objects / resident memory growth)"
    ]
    for k, v in report.items():
        if isinstance(v, dict):
            rss = v.get("rss_growth_mb")
            lines.append(
                f"  {k:<40}{v['s']:>7.3f} s ({v['min_s']:.3f}-{v['max_s']:.3f})"
                f"  {v['peak_mb']:>8.1f} / {'-' if rss is None else f'{rss:.1f}'} MB"
            )
    lines.append(
        f"  read items planned: {report['items']:,} (same ranks), "
        f"{report['items_resharded']:,} (resharded)"
    )
    return "\n".join(lines)


TRAINING_MODES = ("copy-floor", "async", "process", "process-overlap")
"""The training part's contenders (`bench_train.py`'s keys): the copy floor, and trainckpt's
background save with writer threads, with a writer process, and with both overlapping."""
TRAINCKPT_LABELS = ("async", "process", "process-overlap")


def bench_training_lost(
    entries: int, repeats: int, root: Path, warm_steps: int = 5
) -> dict[str, Any]:
    """The training time a background save of an `entries`-entry state costs a small model
    training on one thread (`bench_train.py`'s loop), per writer mode."""
    from bench_train import Trainer, init_one_rank_group, make_contenders, results, run, table

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        group = init_one_rank_group()
        module = make_moe(entries, seed=1)
        work = root / "scale-training"
        work.mkdir(parents=True, exist_ok=True)
        contenders, notes = make_contenders(list(TRAINING_MODES), module, work, group)
        print(
            f"\ntraining while saving a {entry_count(module)}-entry state in the background "
            "(1 training thread)",
            flush=True,
        )
        try:
            samples = run(contenders, Trainer(), work, repeats, warm_steps)
        finally:
            for c in contenders:
                c.close()
        res = results(samples)
        print()
        print(table(res))
        shutil.rmtree(work, ignore_errors=True)
        return {"entries": entry_count(module), "results": res, "notes": notes}
    finally:
        torch.set_num_threads(threads)


def bench_scale(
    sizes: list[int],
    repeats: int,
    rank_counts: list[int],
    tensors: int,
    root: Path,
    training_entries: int = 0,
    wanted: Collection[str] = SCALE_CONTENDERS,
    load_shape: tuple[int, int] | None = LOAD_SHAPE,
    sampled_s: float = SAMPLED_S,
) -> dict[str, Any]:
    """The parts, printed and returned for `--json`; the training part only with
    `training_entries`; the entries part with the contenders `wanted`; the simulated load
    of `load_shape` (tensors, ranks) unless None."""
    entries = bench_entries(sizes, repeats, root, wanted, sampled_s)
    print()
    print(entries_table(entries))
    report: dict[str, Any] = {"entries": entries}
    if training_entries:
        report["training"] = bench_training_lost(training_entries, repeats, root)
    ranks = bench_ranks(rank_counts, tensors, sampled_s / 2)
    print()
    print(ranks_table(ranks))
    report["ranks"] = ranks
    foreign = bench_foreign(sizes, root, sampled_s / 2)
    print()
    print(foreign_table(foreign))
    report["foreign"] = foreign
    if load_shape is not None:
        load = bench_rank_load(*load_shape, repeats=max(repeats, 5))
        print()
        print(rank_load_table(load))
        report["rank_load"] = load
    return report


def scale_targets(report: dict[str, Any]) -> list[str]:
    """The issue's targets for this part, each with this run's ratio."""
    out: list[str] = []
    results = report["entries"]["results"]
    ours = results.get("trainckpt save", {})
    peers = {k: v for k, v in results.items() if not k.startswith("trainckpt")}
    sizes = [k for k, v in ours.items() if isinstance(v, dict)]
    for size in sizes:
        want = 0.8 if int(size) >= 64000 else 1.0
        for op in ("save", "load"):
            best = min((v[size][f"{op}_s"] for v in peers.values() if size in v), default=None)
            if best is None:
                continue
            x = ours[size][f"{op}_s"] / best
            verdict = "met" if x <= want else "NOT met"
            out.append(
                f"target {size} entries: trainckpt {op} / best peer's: {x:.2f} (want <= {want})"
                f" -> {verdict}"
            )
    for size in sizes:  # no target: what a restarted job pays once, beside the peers'
        firsts = [
            v[size]["first_save_s"] for v in peers.values() if "first_save_s" in v.get(size, {})
        ]
        if firsts and "first_save_s" in ours[size]:
            out.append(
                f"first save {size} entries: trainckpt {ours[size]['first_save_s']:.2f}s, "
                f"{ours[size]['first_save_s'] / min(firsts):.2f}x the best peer's first save"
            )
    # Both trainckpt rows load alike and save through the same bookkeeping: the worse of
    # their two growths is the verdict (their difference is the measurement's noise).
    rows = {k: v for k, v in results.items() if k.startswith("trainckpt")}
    for op in ("save", "load"):
        growths = {k: v[f"{op}_growth"] for k, v in rows.items() if f"{op}_growth" in v}
        if growths:
            g = max(growths.values())
            each = ", ".join(f"{k.removeprefix('trainckpt ')} {x:.2f}" for k, x in growths.items())
            out.append(
                f"target trainckpt {op} cost per entry, largest / smallest state: {g:.2f} "
                f"({each}; want <= 1.25) -> {'met' if g <= 1.25 else 'NOT met'}"
            )
    training = report.get("training")
    if training is not None:
        from bench_train import LABELS as TRAIN_LABELS

        modes = {k: training["results"][TRAIN_LABELS[k]] for k in TRAINCKPT_LABELS}
        best = min(modes, key=lambda k: modes[k]["lost_s"]["median"])
        lost = modes[best]["lost_s"]["median"]
        step = modes[best]["step_during_over_before"]["median"]
        out.append(
            f"target background save of {training['entries']} entries, best mode "
            f"({TRAIN_LABELS[best]}): training lost {lost:.2f}s (want <= 1.0) -> "
            f"{'met' if lost <= 1.0 else 'NOT met'}; step during / before {step:.2f} "
            f"(want <= 1.3) -> {'met' if step <= 1.3 else 'NOT met'}"
        )
    load = report.get("rank_load")
    if load is not None:
        work = load["decode + load plan + lookups"]
        mb = load["native_bytes"] / 1e6 + work["peak_mb"] + (work["rss_growth_mb"] or 0)
        ok = work["s"] <= 1 and mb <= 1000
        out.append(
            f"target a rank's metadata work for {load['chunks']:,} chunks: {work['s']:.2f} s, "
            f"~{mb:.0f} MB with the file's bytes (want <= 1 s, <= 1 GB) -> "
            f"{'met' if ok else 'NOT met'}"
        )
    rows = report["ranks"]["results"]
    if rows:
        top = max(rows, key=int)
        r = rows[top]
        commit = r["rank 0: manifest"]["s"] + r["rank 0: commit file check"]["s"]
        out.append(
            f"target simulated {top} ranks: rank 0 commit work {commit:.2f}s (want <= 2) -> "
            f"{'met' if commit <= 2 else 'NOT met'}"
        )
        out.append(
            _unpickle_target(
                "at every simulated size",
                "ranks",
                rows,
                "every rank: safe unpickle (.metadata)",
                "every rank: pickle.loads(.metadata)",
            )
        )
    foreign = report.get("foreign")
    if foreign:
        out.append(
            _unpickle_target(
                "on DCP's own one-rank .metadata",
                "entries",
                foreign,
                "safe unpickle",
                "pickle.loads",
            )
        )
    return out


def _unpickle_target(where: str, unit: str, rows: dict[str, Any], safe: str, ref: str) -> str:
    """The safe unpickler's target line over the sizes `rows` (each with the alternated
    timings `safe` and `ref`): every size's ratio named, the worst judged."""
    ratios = {n: v[safe]["s"] / max(v[ref]["s"], 1e-9) for n, v in rows.items()}
    worst = max(ratios, key=ratios.__getitem__)
    each = ", ".join(f"{n}: {x:.2f}" for n, x in ratios.items())
    calls = "/".join(str(v[safe].get("rounds", 7)) for v in rows.values())
    return (
        f"target safe unpickle / pickle {where}: worst {ratios[worst]:.2f} at {worst} {unit} "
        f"({each}; medians of {calls} alternated calls; want <= 1.5) -> "
        f"{'met' if ratios[worst] <= 1.5 else 'NOT met'}"
    )
