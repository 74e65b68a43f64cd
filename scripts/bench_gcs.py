"""The GCS part of the benchmark: trainckpt and OLMo-core against fake-gcs-server on 127.0.0.1.

Saves and loads of the same state to `gs://` (alternating, repeated), and `latest_checkpoint`
on a folder of many committed checkpoints, timed and counted in HTTP requests by a relaying
proxy between the clients and the server. The server and the proxy are the test suite's
(`tests/support/servers.py`); run `python scripts/bench.py` for the whole benchmark.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("NO_GCE_CHECK", "true")  # before google.auth is imported anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_common import Timer, fingerprint, make_module, zero_state  # noqa: E402

from trainckpt import Checkpointer, CheckpointerConfig  # noqa: E402

TRAIN_STATE = {"step": 1}


def bench_gcs(size_mb: float, n_checkpoints: int, repeats: int, root: Path) -> dict[str, Any]:
    """Run the GCS part; print its table and return its numbers."""
    from support.servers import FakeGCS, GCSFaultProxy, use_emulator

    server = FakeGCS(root).start()
    try:
        use_emulator(server.url)
        _reset_olmo_client()
        bucket = f"gs://{server.create_bucket()}"
        module = make_module(size_mb, seed=1)
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(module))
        results = _save_and_load(module, bucket, repeats, root)
        folder = _make_checkpoint_folder(server.create_bucket(), n_checkpoints)
        proxy = GCSFaultProxy(server)
        with _serving(proxy):
            use_emulator(proxy.url)
            _reset_olmo_client()
            latest = _latest_checkpoint(folder, n_checkpoints, proxy, repeats)
    finally:
        server.stop()
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    _print(results, latest, nbytes, n_checkpoints)
    return {"state_bytes": nbytes, "results": results, "latest_checkpoint": latest}


def _tensors(module: Any) -> Iterator[Any]:
    from bench_common import state_tensors

    for _, t in state_tensors(module.state_dict_to_save()):
        yield t


def _reset_olmo_client() -> None:
    """OLMo-core builds its GCS client once per process; rebuild it for the new endpoint."""
    try:
        from olmo_core.io import _get_gcs_client
    except ImportError:
        return
    _get_gcs_client.cache_clear()


def _contenders(module: Any, work: Path) -> dict[str, tuple[Callable[[str], None], ...]]:
    # incremental=False: every repeat saves the same, unchanged state; each must write it all
    ckpt = CheckpointerConfig(work_dir=work / "trainckpt", incremental=False).build()
    out: dict[str, tuple[Callable[[str], None], ...]] = {
        "trainckpt": (
            lambda d: ckpt.save(d, module, TRAIN_STATE) and None,
            lambda d: ckpt.load(d, module) and None,
        )
    }
    try:
        from olmo_core.train.checkpoint import Checkpointer as OlmoCheckpointer
    except ImportError:
        return out
    olmo = OlmoCheckpointer(work_dir=work / "olmo")
    out["OLMo-core"] = (
        lambda d: olmo.save(d, module, TRAIN_STATE),
        lambda d: olmo.load(d, module) and None,
    )
    return out


def _save_and_load(module: Any, bucket: str, repeats: int, root: Path) -> dict[str, Any]:
    expected = fingerprint(module)
    contenders = _contenders(module, Path(tempfile.mkdtemp(prefix="gcs-work-", dir=root)))
    names = list(contenders)
    samples: dict[str, list[float]] = {}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            save, load = contenders[name]
            target = f"{bucket}/{name.lower()}-{r}/step1"
            with Timer() as t:
                save(target)
            samples.setdefault(f"GCS {name} save", []).append(t.seconds)
            zero_state(module)
            with Timer() as t:
                load(target)
            samples.setdefault(f"GCS {name} load", []).append(t.seconds)
            if fingerprint(module) != expected:
                raise RuntimeError(f"GCS {name} load: the loaded state differs from the saved one")
            done = f"save {samples[f'GCS {name} save'][-1]:.2f}s"
            done += f" load {samples[f'GCS {name} load'][-1]:.2f}s"
            print(f"  repeat {r + 1}/{repeats} GCS {name}: {done}", flush=True)
    order = [f"GCS {n} {op}" for op in ("save", "load") for n in names]
    return {k: _summary(samples[k]) for k in order}


def _make_checkpoint_folder(bucket_name: str, n: int) -> str:
    """`n` committed checkpoints (the three files either library looks for), written directly."""
    from google.cloud import storage

    client = storage.Client()
    bucket = client.bucket(bucket_name)
    meta = json.dumps({"ephemeral": False, "version": "bench"}).encode()
    names = []
    for step in range(1, n + 1):
        names += [
            (f"run/step{step}/model_and_optim/.metadata", b"dcp"),
            (f"run/step{step}/train/rank0.pt", b"state"),
            (f"run/step{step}/.metadata.json", meta),
        ]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda nd: bucket.blob(nd[0]).upload_from_string(nd[1]), names))
    return f"gs://{bucket_name}/run"


def _latest_checkpoint(folder: str, n: int, proxy: Any, repeats: int) -> dict[str, Any]:
    """Time and HTTP requests of each library's `latest_checkpoint` (expects step `n`)."""
    finders: dict[str, Callable[[str], str]] = {"trainckpt": Checkpointer.latest_checkpoint}
    try:
        from olmo_core.train.checkpoint import Checkpointer as OlmoCheckpointer

        finders["OLMo-core"] = OlmoCheckpointer.latest_checkpoint
    except ImportError:
        pass
    out: dict[str, Any] = {}
    for name, find in finders.items():
        times, requests = [], []
        # OLMo-core's takes minutes on a big folder and always sends the same requests: once.
        for _ in range(repeats if name == "trainckpt" else 1):
            before = len(proxy.log)
            with Timer() as t:
                found = find(folder)
            if not str(found).rstrip("/").endswith(f"/step{n}"):
                raise RuntimeError(f"{name}.latest_checkpoint found {found}")
            times.append(t.seconds)
            requests.append(len(proxy.log) - before)
        out[name] = {**_summary(times), "requests": statistics.median(requests)}
    return out


@contextmanager
def _serving(proxy: Any) -> Iterator[None]:
    import threading

    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        proxy.shutdown()
        proxy.server_close()


def _summary(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def _print(results: dict[str, Any], latest: dict[str, Any], nbytes: int, n: int) -> None:
    print()
    head = (
        f"{'GCS (fake-gcs-server, 127.0.0.1)':<40} {'median s':>9} {'min–max s':>13} "
        f"{'MB/s':>6} {'× OLMo':>7}"
    )
    print(head)
    print("-" * len(head))
    for label, r in results.items():
        ref = results.get(label.replace("trainckpt", "OLMo-core"), {}).get("median")
        ratio = f"{r['median'] / ref:.2f}" if ref else "–"
        print(
            f"{label:<40} {r['median']:>9.2f} {r['min']:>6.2f}–{r['max']:<6.2f} "
            f"{nbytes / r['median'] / 1e6:>6.0f} {ratio:>7}"
        )
    for name, r in latest.items():
        print(
            f"{f'{name} latest_checkpoint ({n} ckpts)':<40} {r['median']:>9.2f} "
            f"{r['min']:>6.2f}–{r['max']:<6.2f} {int(r['requests']):>6} requests"
        )
