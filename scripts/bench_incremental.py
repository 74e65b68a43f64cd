"""The incremental part of the benchmark (`python scripts/bench.py --incremental`).

A fine-tune: a stack of frozen square layers (the base, most of the bytes; not in the
optimizer) with small trained low-rank adapters. Three consecutive saves of one run, one
optimizer step of the adapters before each, while a small model trains on one thread (the
training loop of `bench_train.py`, which measures the time a save costs it). Per save and
contender:

- bytes written: the data blocks of files that are new in this checkpoint (a file hard-linked
  from an earlier checkpoint of the run counts nothing), after `sync`, from `st_blocks`;
- save time: from the call until the checkpoint is committed (async saves: its future);
- time lost to training: the blocking time plus the extra time of the steps during the save.

Contenders: trainckpt `save_async` (incremental, the default), DCP `async_save`, OLMo-core's
`save_async`, `torch_checkpointing` (no fsync), and "changed only": trainckpt writing the
adapters and their optimizer state alone (a trainable-only save, not self-contained), the
reference the targets compare with. Then, on fake-gcs-server (request bodies counted),
three synchronous saves by trainckpt and OLMo-core: bytes uploaded per save. Last, the
no-regression check: a fully trained state (nothing unchanged) saved nine times with
incremental on and off: the second save, and the saves of a long run (sixth on); once a state
of large tensors (`--incremental-size-mb`, at most 200 MB), once a state of 16,000 small
entries (`--scale`'s MoE shape; `--incremental-entries`). The first save of each contender
includes its start-up (a writer process to spawn). Each contender's three saves run
`--repeats` times, the contenders' order rotating from one repeat to the next; each row is the
median, with the minimum and maximum of the times.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Timer, make_module, state_tensors  # noqa: E402
from bench_scale import make_moe  # noqa: E402
from bench_train import (  # noqa: E402
    TRAIN_STATE,
    Contender,
    Save,
    Trainer,
    init_one_rank_group,
    make_contenders,
    one_save,
)

from trainckpt import CheckpointerConfig, ModelAndOptim  # noqa: E402

WIDTH = 1024
RANK = 8  # adapters: 2 * 8 / 1024 of the base's parameters, with 2 AdamW moments each
PEERS = ("dcp-thread", "olmo", "torch-checkpointing")
LABELS = {
    "async": "trainckpt save_async (incremental)",
    "changed-only": "changed only (trainckpt, adapters alone)",
    "dcp-thread": "DCP async_save (thread)",
    "olmo": "OLMo-core save_async",
    "torch-checkpointing": "torch_checkpointing (no fsync)",
}


class LoraStack(torch.nn.Module):
    """Frozen square layers, each with a trained low-rank adapter (`adapters`)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.base = torch.nn.ModuleList(
            torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)
        )
        self.base.requires_grad_(False)
        self.adapters = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(WIDTH, RANK, bias=False), torch.nn.Linear(RANK, WIDTH, bias=False)
            )
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for base, adapter in zip(self.base, self.adapters, strict=True):
            x = base(x) + adapter(x)
        return x


def make_lora(size_mb: float) -> tuple[ModelAndOptim, ModelAndOptim]:
    """The whole module (base + adapters, `size_mb` MB of frozen base) and a view of the
    adapters alone with the same optimizer (what a trainable-only save writes)."""
    torch.manual_seed(0)
    layers = max(1, round(size_mb * 1e6 / (WIDTH * WIDTH * 4)))
    model = LoraStack(layers)
    optim = torch.optim.AdamW(model.adapters.parameters(), lr=1e-3)
    return ModelAndOptim(model, optim), ModelAndOptim(model.adapters, optim)


def adapter_step(module: ModelAndOptim, seed: int) -> None:
    """One optimizer step of the adapters (the base stays as it is)."""
    gen = torch.Generator().manual_seed(seed)
    for p in module.model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    assert module.optim is not None
    module.optim.step()
    module.optim.zero_grad(set_to_none=True)


def new_bytes(folder: Path, seen: set[tuple[int, int]]) -> int:
    """Data blocks (bytes) of the files under `folder` not `seen` (device, inode) before."""
    total = 0
    for path in folder.rglob("*"):
        st = path.lstat()
        if path.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def _changed_only(adapters: ModelAndOptim, root: Path) -> Contender:
    ckpt = CheckpointerConfig(work_dir=root / "work-changed", incremental=False).build()

    def start(folder: Path) -> Save:
        save = Save()
        save.follow(ckpt.save_async(folder, adapters, TRAIN_STATE))
        return save

    return Contender("changed-only", start, ckpt.close)


def _local_runs(
    size_mb: float, root: Path, warm_steps: int, repeats: int
) -> tuple[dict[str, Any], list[str]]:
    """Three saves per contender, `repeats` times, the contenders' order rotating from one
    repeat to the next; returns per label the median row of each save, and notes."""
    group = init_one_rank_group()
    module, adapters = make_lora(size_mb)
    initial = (
        {k: v.clone() for k, v in module.model.state_dict().items()},
        module.optim.state_dict() if module.optim else None,
    )
    keys = ["async", *PEERS]
    contenders, notes = make_contenders(keys, module, root, group, incremental=True)
    contenders.insert(1, _changed_only(adapters, root))
    trainer = Trainer()
    for _ in range(5):  # first steps allocate
        trainer.step()
    runs: dict[str, list[list[dict[str, Any]]]] = {LABELS[c.key]: [] for c in contenders}
    try:
        for r in range(repeats):
            shift = r % len(contenders)
            for c in contenders[shift:] + contenders[:shift]:
                runs[LABELS[c.key]].append(
                    _three_saves(module, initial, trainer, c, root, r, warm_steps)
                )
    finally:
        for c in contenders:
            c.close()
    return {label: [_median_row(rs, i) for i in range(3)] for label, rs in runs.items()}, notes


def _three_saves(
    module: ModelAndOptim,
    initial: tuple[dict[str, torch.Tensor], Any],
    trainer: Trainer,
    c: Contender,
    root: Path,
    repeat: int,
    warm_steps: int,
) -> list[dict[str, Any]]:
    """One run of three saves by `c` from the same initial state as every contender's."""
    module.model.load_state_dict(initial[0])
    assert module.optim is not None
    module.optim.state.clear()
    seen: set[tuple[int, int]] = set()
    rows = []
    for n in (1, 2, 3):
        adapter_step(module, n)
        os.sync()
        folder = root / c.key / f"run{repeat}" / f"step{n}"
        s = one_save(trainer, c, folder, warm_steps)
        os.sync()
        rows.append(
            {
                "save": n,
                "bytes_written": new_bytes(folder, seen),
                "save_s": s.committed,
                "blocked_s": s.blocked,
                "lost_s": s.lost,
            }
        )
        r = rows[-1]
        print(
            f"  {LABELS[c.key]} save {n} (repeat {repeat + 1}): wrote "
            f"{r['bytes_written'] / 1e6:.1f} MB, committed {r['save_s']:.2f}s, "
            f"training lost {r['lost_s']:.2f}s",
            flush=True,
        )
    shutil.rmtree(root / c.key, ignore_errors=True)
    return rows


def _median_row(runs: list[list[dict[str, Any]]], i: int) -> dict[str, Any]:
    """Save `i` over the runs: medians, and the samples of each time."""
    rows = [run[i] for run in runs]
    out: dict[str, Any] = {"save": rows[0]["save"]}
    for field in ("bytes_written", "save_s", "blocked_s", "lost_s"):
        values = [row[field] for row in rows]
        out[field] = statistics.median(values)
        out[f"{field}_samples"] = values
    return out


def _gcs_runs(size_mb: float, root: Path) -> dict[str, Any]:
    """Three synchronous saves by trainckpt and OLMo-core on fake-gcs-server: bytes uploaded
    (the bodies of every HTTP request this process sends, counted in `requests`: resumable
    uploads go straight to the session URL the server hands out) and save time per save."""
    import requests
    from requests.utils import super_len

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from bench_gcs import _reset_olmo_client
    from support.servers import FakeGCS, use_emulator

    sent = [0]
    send = requests.Session.send

    def counting(session: requests.Session, request: Any, **kwargs: Any) -> Any:
        if request.body is not None:
            sent[0] += super_len(request.body)
        return send(session, request, **kwargs)

    server = FakeGCS(root).start()
    requests.Session.send = counting  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    try:
        use_emulator(server.url)
        _reset_olmo_client()
        bucket = f"gs://{server.create_bucket()}"
        savers: dict[str, Any] = {
            "trainckpt": CheckpointerConfig(work_dir=root / "gcs-work").build()
        }
        try:
            from olmo_core.train.checkpoint import Checkpointer as OlmoCheckpointer

            savers["OLMo-core"] = OlmoCheckpointer(work_dir=root / "gcs-olmo")
        except ImportError:
            pass
        for name, saver in savers.items():
            module, _ = make_lora(size_mb)
            rows = []
            for n in (1, 2, 3):
                adapter_step(module, n)
                before = sent[0]
                with Timer() as t:
                    saver.save(f"{bucket}/{name.lower()}/step{n}", module, TRAIN_STATE)
                rows.append({"save": n, "bytes_uploaded": sent[0] - before, "save_s": t.seconds})
                mb = rows[-1]["bytes_uploaded"] / 1e6
                print(f"  GCS {name} save {n}: uploaded {mb:.1f} MB in {t.seconds:.2f}s")
            out[name] = rows
        savers["trainckpt"].close()
    finally:
        requests.Session.send = send  # type: ignore[method-assign]
        server.stop()
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    return out


STEADY_FROM, RUN_SAVES = 6, 9
"""The no-regression check times saves 2 and `STEADY_FROM`..`RUN_SAVES` of a run: from the
sixth save on, a tensor that changed at every save is hashed at two saves in eight
(`core/incremental.py`'s `hash_due`), as in a long run."""


def _no_regression(module: ModelAndOptim, what: str, root: Path, repeats: int) -> dict[str, Any]:
    """A fully trained state saved `RUN_SAVES` times with incremental on and off, every
    parameter and moment changed before each save, alternating: the second save (the first
    incremental one hashes everything and finds nothing unchanged) and the saves of a long run
    (`STEADY_FROM` on), wall and process CPU time."""
    samples: dict[str, dict[str, list[float]]] = {
        mode: {"second": [], "steady": [], "second_cpu": [], "steady_cpu": []}
        for mode in ("on", "off")
    }
    for r in range(repeats):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            ckpt = CheckpointerConfig(
                work_dir=root / f"nr-work-{mode}", incremental=mode == "on"
            ).build()
            folder = root / f"nr-{mode}-{r}"
            try:
                for save in range(1, RUN_SAVES + 1):
                    adapter_step(module, 100 * r + save)  # every parameter and moment changes
                    os.sync()
                    cpu = time.process_time()
                    with Timer() as t:
                        ckpt.save(folder / f"step{save}", module, TRAIN_STATE)
                    cpu = time.process_time() - cpu
                    if save == 2 or save >= STEADY_FROM:
                        kind = "second" if save == 2 else "steady"
                        samples[mode][kind].append(t.seconds)
                        samples[mode][f"{kind}_cpu"].append(cpu)
                    if save > 2:  # keep the previous one: the next save compares with it
                        shutil.rmtree(folder / f"step{save - 2}")
            finally:
                ckpt.close()
                shutil.rmtree(folder, ignore_errors=True)
    out: dict[str, Any] = {"samples": samples}
    for kind in ("second", "steady", "second_cpu", "steady_cpu"):
        on, off = (statistics.median(samples[m][kind]) for m in ("on", "off"))
        out[kind] = {"incremental_s": on, "off_s": off, "ratio": on / off}
    print(
        f"  fully trained {what}: second save incremental {out['second']['incremental_s']:.2f}s,"
        f" off {out['second']['off_s']:.2f}s; saves {STEADY_FROM}-{RUN_SAVES}: incremental "
        f"{out['steady']['incremental_s']:.2f}s, off {out['steady']['off_s']:.2f}s",
        flush=True,
    )
    return out


def bench_incremental(
    size_mb: float,
    root: Path,
    repeats: int,
    gcs: bool = True,
    warm_steps: int = 5,
    entries: int = 16_000,
) -> dict[str, Any]:
    """Run the incremental part; print its table and targets and return its numbers. The
    no-regression check also saves a fully trained state of `entries` small entries
    (MoE-shaped, as `--scale` saves): there the per-item bookkeeping of incremental saves
    shows, not the hashing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="incremental-", dir=root))
    try:
        module, adapters = make_lora(size_mb)
        state = sum(
            t.numel() * t.element_size() for _, t in state_tensors(module.state_dict_to_save())
        )
        frozen = sum(p.numel() * p.element_size() for p in module.model.base.parameters())  # type: ignore[union-attr]
        print(
            f"\nincremental: {state / 1e6:.0f} MB of state, {100 * frozen / state:.1f}% frozen; "
            f"load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        local, notes = _local_runs(size_mb, work, warm_steps, repeats)
        report: dict[str, Any] = {
            "state_bytes": state,
            "frozen_bytes": frozen,
            "load_average": os.getloadavg(),
            "local": local,
            "notes": notes,
        }
        if gcs:
            report["gcs"] = _gcs_runs(size_mb, work)
        mb = min(size_mb, 200.0)
        report["fully_trained"] = _no_regression(
            make_module(mb, seed=2), f"state of {mb:.0f} MB", work, repeats
        )
        report["fully_trained_entries"] = _no_regression(
            make_moe(entries), f"state of {entries} entries", work, repeats
        )
        report["entries"], report["fully_trained_mb"] = entries, mb
        report["load_average_end"] = os.getloadavg()
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(report))
    return report


def table(report: dict[str, Any]) -> str:
    head = f"{'contender':<42} {'save':>4} {'written MB':>11} {'save s':>17} {'lost s':>17}"
    lines = [head, "-" * len(head)]
    for label, rows in report["local"].items():
        for r in rows:
            lines.append(
                f"{label:<42} {r['save']:>4} {r['bytes_written'] / 1e6:>11.1f} "
                f"{_spread(r, 'save_s'):>17} {_spread(r, 'lost_s'):>17}"
            )
    for name, rows in report.get("gcs", {}).items():
        for r in rows:
            lines.append(
                f"{'GCS ' + name + ' (uploaded MB)':<42} {r['save']:>4} "
                f"{r['bytes_uploaded'] / 1e6:>11.1f} {r['save_s']:>17.2f} {'':>17}"
            )
    return "\n".join(lines)


def _spread(row: dict[str, Any], field: str) -> str:
    """`median (min-max)` of a time over the repeats."""
    samples = row.get(f"{field}_samples", [row[field]])
    if len(samples) == 1:
        return f"{row[field]:.2f}"
    return f"{row[field]:.2f} ({min(samples):.2f}-{max(samples):.2f})"


def targets(report: dict[str, Any]) -> list[str]:
    """The issue's targets, from the second save on (ratios within this one run)."""
    ours = report["local"][LABELS["async"]]
    ref = report["local"].get(LABELS["changed-only"])
    out = []
    if ref is not None:
        for r, c in zip(ours[1:], ref[1:], strict=True):
            b = r["bytes_written"] / c["bytes_written"]
            t = r["save_s"] / c["save_s"]
            out.append(
                f"target save {r['save']}: bytes {b:.2f}x changed-only (<= 1.1: "
                f"{'ok' if b <= 1.1 else 'MISSED'}), time {t:.2f}x (<= 1.2: "
                f"{'ok' if t <= 1.2 else 'MISSED'})"
            )
    gcs = report.get("gcs", {}).get("trainckpt")
    if gcs is not None and ref is not None:
        for r, c in zip(gcs[1:], ref[1:], strict=True):
            b = r["bytes_uploaded"] / c["bytes_written"]
            out.append(
                f"target GCS save {r['save']}: uploaded {r['bytes_uploaded'] / 1e6:.1f} MB, "
                f"{b:.2f}x the changed-only bytes, of {report['frozen_bytes'] / 1e6:.0f} MB "
                f"frozen (no unchanged byte: {'ok' if b <= 1.1 else 'MISSED'})"
            )
    saves = (("second", "second save"), ("steady", f"saves {STEADY_FROM}-{RUN_SAVES}"))
    large, many = f"{report['fully_trained_mb']:.0f} MB", f"{report['entries']} entries"
    for field, state in (("fully_trained", large), ("fully_trained_entries", many)):
        trained = report[field]
        for kind, save in saves:
            ratio, cpu = trained[kind]["ratio"], trained[f"{kind}_cpu"]["ratio"]
            out.append(
                f"target fully trained ({state}), {save}: incremental {ratio:.2f}x the time of "
                f"incremental=False (no slower, within noise: "
                f"{'ok' if ratio <= 1.05 else 'MISSED'}), {cpu:.2f}x its process CPU"
            )
    return out
