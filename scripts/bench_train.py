"""What a background save costs a training loop: `python scripts/bench.py` runs this part.

A small transformer trains on one thread (`torch.set_num_threads(1)`, so another core is free
for the writer) while each contender saves a large state (a model plus AdamW moments, built by
`bench_common.make_module`) in the background. Per save: how long the call blocked, how long
until the checkpoint was committed, the median training step during the save relative to the
steps just before it, and the training time lost: the blocking time plus the extra time (over
the median step before the save) of every step that started before the commit.

Contenders: two floors, trainckpt `save_async` (default, `overlap_staging=True`, and
`async_writer="process"`, with and without overlap), DCP `async_save` (thread and process),
OLMo-core's `save_async` and PyTorch's `torch_checkpointing` (its `CheckpointManager` with an
async saver; on CPU with pinned memory and direct I/O off, which it needs there). The floors:
a separate, already running process writing the same bytes from its own memory with `write` +
`fsync` (what writing costs the training loop when nothing must be copied), and the training
thread copying the state into shared memory, then another running process writing it from
there (the least any snapshot the trainer keeps training past can cost: the copy floor,
which trainckpt's targets compare with). `torch_checkpointing` does not fsync: its save is
"committed" when its future resolves, with bytes possibly still in the page cache, so its
times leave out what the others pay for durability. Its staging copy runs on a thread after
`save` returns; as its docs require, the trainer takes `manager.lock()` before each optimizer
step, which waits for that copy (as trainckpt's overlapped staging has it call
`wait_for_staging`). Each contender is warmed first (one
untimed save: spawned processes, first buffer allocations); the order rotates every repeat.
DCP's process mode needs `torch.distributed`: a one-rank gloo group on 127.0.0.1 is set up.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from bench_common import make_module, state_tensors

from trainckpt import Checkpointer, CheckpointerConfig, ModelAndOptim

TRAIN_STATE = {"step": 1, "note": "bench"}
CONTENDERS = (
    "floor",
    "copy-floor",
    "async",
    "overlap",
    "process",
    "process-overlap",
    "dcp-thread",
    "dcp-process",
    "olmo",
    "torch-checkpointing",
)
LABELS = {
    "floor": "floor: other process write+fsync",
    "copy-floor": "copy floor: shm copy+process write",
    "async": "trainckpt save_async",
    "overlap": "trainckpt save_async(overlap)",
    "process": "trainckpt save_async(process)",
    "process-overlap": "trainckpt save_async(process,overlap)",
    "dcp-thread": "DCP async_save (thread)",
    "dcp-process": "DCP async_save (process)",
    "olmo": "OLMo-core save_async",
    "torch-checkpointing": "torch_checkpointing (no fsync)",
}
PEERS = ("dcp-thread", "dcp-process", "olmo", "torch-checkpointing")
FLOORS = ("floor", "copy-floor")
TRAINCKPT_MODES = {  # key: (overlap_staging, async_writer="process")
    "async": (False, False),
    "overlap": (True, False),
    "process": (False, True),
    "process-overlap": (True, True),
}


# -- the training loop ---------------------------------------------------------------------------


class Trainer:
    """A small transformer language model trained on random tokens, one step at a time."""

    def __init__(self, width: int = 256, layers: int = 2, batch: int = 4, seq: int = 64) -> None:
        torch.manual_seed(0)
        vocab = 1000
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, 0.0, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)
        self.params = [
            *self.embed.parameters(),
            *self.body.parameters(),
            *self.head.parameters(),
        ]
        self.optim = torch.optim.AdamW(self.params, lr=1e-4)
        self.tokens = torch.randint(0, vocab, (batch, seq + 1))
        self.vocab = vocab

    def step(self, before_optim_step: Callable[[], None] | None = None) -> float:
        """One forward, backward and optimizer step; its wall time in seconds."""
        start = time.perf_counter()
        x, y = self.tokens[:, :-1], self.tokens[:, 1:]
        logits = self.head(self.body(self.embed(x)))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab), y.reshape(-1))
        loss.backward()
        if before_optim_step is not None:
            before_optim_step()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return time.perf_counter() - start


# -- contenders --------------------------------------------------------------------------------


@dataclass
class Save:
    """One background save in flight: `committed` is set (and `committed_at` stamped) once the
    checkpoint is complete; `before_optim_step` is what the trainer must call before its next
    optimizer step (`wait_for_staging` for overlapped staging)."""

    committed: threading.Event = field(default_factory=threading.Event)
    committed_at: float = 0.0
    error: BaseException | None = None
    before_optim_step: Callable[[], None] | None = None

    def follow(self, future: Future) -> None:
        """Stamp the commit when `future` completes (after callbacks added before this one)."""

        def done(f: Future) -> None:
            self.error = f.exception()
            self.committed_at = time.perf_counter()
            self.committed.set()

        future.add_done_callback(done)


@dataclass
class Contender:
    key: str
    start: Callable[[Path], Save]
    close: Callable[[], None] = lambda: None
    processes: Callable[[], list[int]] = list
    """Ids of the other processes the contender writes with (their CPU time counts too)."""


class Floor:
    """A separate process that holds the state's bytes in its own memory and, on request,
    writes them to one file with `write` + `fsync`: the least a background save can cost."""

    CODE = (
        "import mmap,os,sys\n"
        "src=open(sys.argv[1],'rb+');size=os.fstat(src.fileno()).st_size\n"
        "if sys.argv[2]=='map': buf=mmap.mmap(src.fileno(),size)\n"
        "else: buf=bytearray(size);src.readinto(buf);src.close()\n"
        "view=memoryview(buf);chunk=64<<20\n"
        "print('ready',flush=True)\n"
        "for line in sys.stdin:\n"
        "    fd=os.open(line.strip(),os.O_WRONLY|os.O_CREAT|os.O_EXCL,0o644)\n"
        "    for i in range(0,len(view),chunk):\n"
        "        done=i\n"
        "        while done<min(i+chunk,len(view)): done+=os.write(fd,view[done:i+chunk])\n"
        "    os.fsync(fd);os.close(fd);print('done',flush=True)\n"
    )

    def __init__(self, module: ModelAndOptim, scratch: Path) -> None:
        source = scratch / "floor-state.bin"
        with open(source, "wb") as f:
            for t in _tensors(module.state_dict_to_save()):
                f.write(memoryview(t.contiguous().numpy()).cast("B"))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.CODE, str(source), "own"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the floor writer process did not start")
        source.unlink()
        self.lock = threading.Lock()

    def start(self, folder: Path) -> Save:
        folder.mkdir(parents=True)
        save = Save()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        stdout = self.proc.stdout

        def wait() -> None:
            line = stdout.readline().strip()
            save.error = None if line == "done" else RuntimeError(f"floor writer: {line!r}")
            save.committed_at = time.perf_counter()
            save.committed.set()

        self.proc.stdin.write(f"{folder / 'raw.bin'}\n")
        self.proc.stdin.flush()
        threading.Thread(target=wait, daemon=True).start()
        return save

    def pids(self) -> list[int]:
        return [self.proc.pid]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class CopyFloor(Floor):
    """The copy floor: the training thread copies the state into shared memory (the call
    blocks for that copy), then a separate, already running process that maps the same
    memory writes it to one file with `write` + `fsync`."""

    def __init__(self, module: ModelAndOptim, scratch: Path) -> None:
        self.tensors = [t.detach().reshape(-1) for t in _tensors(module.state_dict_to_save())]
        nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.shm = Path("/dev/shm") / f"trainckpt-bench-copy-floor-{os.getpid()}"
        with open(self.shm, "wb+") as f:
            f.truncate(nbytes)
            self.map = mmap.mmap(f.fileno(), nbytes)
        self.buf = torch.frombuffer(self.map, dtype=torch.uint8)
        self.buf.fill_(0)  # the pages exist before the first timed copy, as a pool's would
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.CODE, str(self.shm), "map"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the copy floor's writer process did not start")
        self.lock = threading.Lock()

    def start(self, folder: Path) -> Save:
        offset = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            self.buf[offset : offset + n].copy_(t.view(torch.uint8))
            offset += n
        return super().start(folder)

    def close(self) -> None:
        super().close()
        del self.buf
        self.map.close()
        self.shm.unlink(missing_ok=True)


def _tensors(state: Any) -> list[torch.Tensor]:
    return [t for _, t in state_tensors(state)]


def make_contenders(
    keys: list[str], module: ModelAndOptim, root: Path, group: Any, incremental: bool = False
) -> tuple[list[Contender], list[str]]:
    """The contenders named by `keys` (those that can run here) and notes on the others.
    trainckpt's saves are `incremental` (off by default: the repeats save one unchanged state,
    and each must write it all)."""
    contenders: list[Contender] = []
    notes: list[str] = []
    ckpt = CheckpointerConfig(work_dir=root / "work", incremental=incremental).build()
    writer: Checkpointer | None = None  # async_writer="process"
    for key in keys:
        if key in FLOORS:
            floor = Floor(module, root) if key == "floor" else CopyFloor(module, root)
            contenders.append(Contender(key, floor.start, floor.close, floor.pids))
        elif key in TRAINCKPT_MODES:
            overlap, process = TRAINCKPT_MODES[key]
            if process and writer is None:
                writer = CheckpointerConfig(
                    work_dir=root / "work-process", async_writer="process", incremental=incremental
                ).build()
            saver = writer if process else ckpt
            assert saver is not None

            def start(folder: Path, saver: Checkpointer = saver, overlap: bool = overlap) -> Save:
                save = Save(before_optim_step=saver.wait_for_staging if overlap else None)
                save.follow(saver.save_async(folder, module, TRAIN_STATE, overlap_staging=overlap))
                return save

            def writer_pid(saver: Checkpointer = saver) -> list[int]:
                process = getattr(saver._writer, "_proc", None)  # private: for the CPU column
                return [] if process is None else [process.pid]

            contenders.append(Contender(key, start, saver.close, writer_pid))
        elif key in ("dcp-thread", "dcp-process"):
            process = key == "dcp-process"
            contenders.append(
                Contender(key, _dcp_start(module, process, group), processes=_dcp_processes)
                if process
                else Contender(key, _dcp_start(module, process, group))
            )
        elif key == "olmo":
            try:
                import olmo_core.train.checkpoint  # noqa: F401
            except ImportError:
                notes.append("OLMo-core not installed (pip install trainckpt[bench]): skipped")
                continue
            contenders.append(Contender(key, _olmo_start(module, root, group)))
        elif key == "torch-checkpointing":
            try:
                import torch_checkpointing  # noqa: F401
            except ImportError:
                notes.append(
                    "torch_checkpointing not installed (pip install trainckpt[bench]): skipped"
                )
                continue
            start, close = _torch_checkpointing(module)
            contenders.append(Contender(key, start, close))
            notes.append(
                "torch_checkpointing does not fsync: its times leave out making the bytes "
                "durable, which every other contender pays"
            )
    return contenders, notes


def _dcp_processes() -> list[int]:
    """The id of DCP's checkpoint process (private to DCP; absent until the first save)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    proc = getattr(executor, "_CHECKPOINT_PROCESS", None)
    save_process = getattr(proc, "_save_process", None)
    return [save_process.pid] if save_process is not None else []


def _olmo_start(module: ModelAndOptim, root: Path, group: Any) -> Callable[[Path], Save]:
    from olmo_core.train.checkpoint import Checkpointer as OlmoCheckpointer

    olmo = OlmoCheckpointer(work_dir=root / "olmo-work", process_group=group)

    def start(folder: Path) -> Save:
        save = Save()
        save.follow(olmo.save_async(str(folder), module, TRAIN_STATE))
        return save

    return start


def _torch_checkpointing(
    module: ModelAndOptim,
) -> tuple[Callable[[Path], Save], Callable[[], None]]:
    """PyTorch's `torch_checkpointing` with an async saver (a writer process of its own), with
    pinned memory and direct I/O off, as it needs on CPU (it pins through CUDA). Its staging
    copies the state on a thread of its own after `save` returns; its contract is that the
    trainer takes `manager.lock()` around each in-place update of the saved state (the
    optimizer step), which waits while that copy runs. The trainer here does so, as it does
    `wait_for_staging` for trainckpt's overlapped staging: without it, the copy would race the
    next optimizer step (a torn checkpoint) and its cost would go unmeasured."""
    import torch_checkpointing as tc
    from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    manager = tc.CheckpointManager.Config(
        save=tc.AsyncCheckpointSaverConfig(
            staging_config=CheckpointStagerConfig(
                use_pinned_memory=False, use_non_blocking_copy=False
            ),
            process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=600),
        ),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
    ).build()

    def before_optim_step() -> None:
        with manager.lock():  # waits while a capture of the state runs
            pass

    def start(folder: Path) -> Save:
        save = Save(before_optim_step=before_optim_step)
        future = manager.save(str(folder), module.state_dict_to_save())
        assert future is not None
        save.follow(future)
        return save

    return start, manager.close


def _dcp_start(module: ModelAndOptim, process: bool, group: Any) -> Callable[[Path], Save]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD

    def start(folder: Path) -> Save:
        save = Save()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            future = dcp.async_save(
                module.state_dict_to_save(),
                checkpoint_id=str(folder),
                process_group=group,
                async_checkpointer_type=kind,
            )
        save.follow(future)  # type: ignore[arg-type]
        return save

    return start


# -- running ---------------------------------------------------------------------------------------


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time of this process and of the processes `pids` (user + system, from /proc)."""
    total = time.process_time()
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@dataclass
class Sample:
    cpu: float
    """CPU seconds the save burnt outside the training thread, from the call to the commit
    (the blocking part included)."""
    blocked: float
    committed: float
    before: float
    during: float
    lost: float
    steps: int


def one_save(trainer: Trainer, contender: Contender, folder: Path, warm_steps: int) -> Sample:
    """Train `warm_steps` steps, start the save, keep training until it is committed."""
    before = [trainer.step() for _ in range(warm_steps)]
    base = statistics.median(before)
    pids = contender.processes()
    cpu_start = _cpu_seconds(pids)
    start = time.perf_counter()
    save = contender.start(folder)
    blocked = time.perf_counter() - start
    training_cpu_start = time.thread_time()  # the steps' CPU is not the save's
    during: list[float] = []
    while True:
        step_start = time.perf_counter()
        if save.committed.is_set() and save.committed_at <= step_start:
            break
        during.append(trainer.step(save.before_optim_step))
    save.committed.wait()
    cpu = _cpu_seconds(pids) - cpu_start - (time.thread_time() - training_cpu_start)
    if save.error is not None:
        raise RuntimeError(f"{LABELS[contender.key]} failed: {save.error}") from save.error
    extra = sum(d - base for d in during)
    return Sample(
        cpu=cpu,
        blocked=blocked,
        committed=save.committed_at - start,
        before=base,
        during=statistics.median(during) / base if during else 1.0,
        lost=blocked + extra,
        steps=len(during),
    )


def run(
    contenders: list[Contender], trainer: Trainer, root: Path, repeats: int, warm_steps: int
) -> dict[str, list[Sample]]:
    """Warm every contender with one untimed save, then alternate them `repeats` times."""
    for c in contenders:
        folder = root / f"warm-{c.key}" / "step1"
        save = c.start(folder)
        save.committed.wait()
        if save.error is not None:
            raise RuntimeError(f"{LABELS[c.key]} failed: {save.error}") from save.error
        shutil.rmtree(folder.parent)
        print(f"  warmed {LABELS[c.key]}", flush=True)
    samples: dict[str, list[Sample]] = {c.key: [] for c in contenders}
    for r in range(repeats):
        order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
        for c in order:
            folder = root / f"{c.key}-r{r}" / "step1"
            os.sync()
            s = one_save(trainer, c, folder, warm_steps)
            samples[c.key].append(s)
            shutil.rmtree(folder.parent)
            print(
                f"  repeat {r + 1}/{repeats} {LABELS[c.key]}: blocked {s.blocked:.2f}s "
                f"committed {s.committed:.2f}s step x{s.during:.2f} ({s.steps} steps) "
                f"lost {s.lost:.2f}s cpu {s.cpu:.2f}s",
                flush=True,
            )
    return samples


# -- reporting ---------------------------------------------------------------------------------


def _summary(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def results(samples: dict[str, list[Sample]]) -> dict[str, dict[str, Any]]:
    """Per contender label: blocked, committed, step_ratio, lost (each median, min, max)."""
    out: dict[str, dict[str, Any]] = {}
    for key, xs in samples.items():
        out[LABELS[key]] = {
            "blocked_s": _summary([s.blocked for s in xs]),
            "committed_s": _summary([s.committed for s in xs]),
            "step_during_over_before": _summary([s.during for s in xs]),
            "lost_s": _summary([s.lost for s in xs]),
            "save_cpu_s": _summary([s.cpu for s in xs]),
            "step_before_s": _summary([s.before for s in xs]),
            "steps_during": _summary([float(s.steps) for s in xs]),
        }
    return out


def table(res: dict[str, dict[str, Any]]) -> str:
    """Medians (min–max) per contender, with the lost time relative to the copy floor (the
    plain floor when the copy floor did not run) and the best peer."""
    floor = next(
        (res[LABELS[k]]["lost_s"]["median"] for k in reversed(FLOORS) if LABELS[k] in res), None
    )
    peers = [res[LABELS[k]]["lost_s"]["median"] for k in PEERS if LABELS[k] in res]
    best_peer = min(peers) if peers else None

    def cell(r: dict[str, Any], fmt: str) -> str:
        return f"{r['median']:{fmt}} ({r['min']:{fmt}}–{r['max']:{fmt}})"

    head = (
        f"{'contender':<34} {'call blocks s':>19} {'until committed s':>19} "
        f"{'step × during':>19} {'training lost s':>19} {'× floor':>7} {'× best peer':>11} "
        f"{'save CPU s':>19}"
    )
    lines = [head, "-" * len(head)]
    for label, r in res.items():
        lost = r["lost_s"]["median"]
        lines.append(
            f"{label:<34} {cell(r['blocked_s'], '.2f'):>19} {cell(r['committed_s'], '.2f'):>19} "
            f"{cell(r['step_during_over_before'], '.2f'):>19} {cell(r['lost_s'], '.2f'):>19} "
            f"{_ratio(lost, floor):>7} {_ratio(lost, best_peer):>11} "
            f"{cell(r['save_cpu_s'], '.2f'):>19}"
        )
    step = statistics.median(r["step_before_s"]["median"] for r in res.values())
    lines.append(
        f"(median training step before a save: {step * 1000:.0f} ms on 1 thread; lost = call "
        "blocking + extra time of every step that started before the commit; save CPU = CPU "
        "time of the save's threads and processes, call to commit)"
    )
    return "\n".join(lines)


def _ratio(x: float, ref: float | None) -> str:
    return f"{x / ref:.2f}" if ref is not None and ref > 0 else "–"


def init_one_rank_group() -> Any:
    """A one-rank gloo world on 127.0.0.1 (DCP's process mode needs torch.distributed)."""
    if not tdist.is_initialized():
        from torch.distributed.elastic.utils.distributed import get_free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(get_free_port()))
        tdist.init_process_group("gloo", rank=0, world_size=1)
    return tdist.new_group(backend="gloo")


def bench_training(
    size_mb: float, repeats: int, root: Path, only: str = "", warm_steps: int = 10
) -> dict[str, Any]:
    """Run the training-loop part; return its report (printed as it goes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        group = init_one_rank_group()
        module = make_module(size_mb, seed=1)
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(module.state_dict_to_save()))
        keys = [k for k in CONTENDERS if not only or k in only.split(",")]
        root.mkdir(parents=True, exist_ok=True)
        contenders, notes = make_contenders(keys, module, root, group)
        trainer = Trainer()
        for _ in range(5):  # first steps allocate
            trainer.step()
        print(
            f"\ntraining while saving {nbytes / 1e9:.3f} GB in the background "
            f"(1 training thread, {os.cpu_count()} cores)",
            flush=True,
        )
        try:
            samples = run(contenders, trainer, root, repeats, warm_steps)
        finally:
            for c in contenders:
                c.close()
        res = results(samples)
        print()
        print(table(res))
        for note in notes:
            print(f"note: {note}")
        return {"state_bytes": nbytes, "repeats": repeats, "results": res, "notes": notes}
    finally:
        torch.set_num_threads(threads)
