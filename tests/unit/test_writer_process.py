"""`async_writer="process"`: a separate process writes the shard files of async saves from
shared memory. The files must be the threads' files, a dead or failing writer must fail the save
(nothing committed, the next save works), and the writer must not outlive a killed trainer."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import wait
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.damage import split_item_record
from support.models import assert_same_state, fresh_module, make_module

from trainckpt import Checkpointer, CheckpointerConfig, StorageError
from trainckpt.core.dcp import save_state
from trainckpt.core.shared_memory import locate
from trainckpt.core.staging import Stager
from trainckpt.core.writer_process import WriterProcess
from trainckpt.storage.checksums import crc32c_file
from trainckpt.testing.faults import ENV_VAR

pytestmark = pytest.mark.ckpt(async_writer="process")


def _awkward_state() -> dict:
    """Every kind of item a state can hold: dtypes, strides, empty and 0-d tensors, objects."""
    torch.manual_seed(0)
    return {
        "f32": torch.randn(300, 7),
        "bf16": torch.randn(64).to(torch.bfloat16),
        "bool": torch.rand(33) > 0.5,
        "i64": torch.arange(17),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(5, 9).t(),
        "obj": {"lr": 0.1, "name": "x", "betas": (0.9, 0.95)},
    }


def test_the_writer_process_writes_the_threads_files(tmp_path: Path) -> None:
    """Staged tensors (in the arena) and tensors outside it (a view of a larger storage, a
    non-contiguous one: copied into a scratch arena laid out the same) give the same items,
    byte for byte, as the threads write; DCP reads them back."""
    stager = Stager()
    staged = stager.stage(_awkward_state(), shared=True)
    tensors = [t for t in staged.values() if isinstance(t, torch.Tensor) and t.numel()]
    assert all(locate(t) is not None for t in tensors)
    big = torch.arange(10_000, dtype=torch.float32)
    staged["view"] = big[100:150]  # outside every arena
    staged["strided"] = torch.randn(6, 4).t()
    assert locate(staged["view"]) is None

    writer = WriterProcess()
    try:
        by_process = save_state(
            staged, tmp_path / "p" / "dcp", group=None, thread_count=3, shard_writer=writer
        )
        assert writer._proc is not None  # the scratch arena of the views is unmapped
        assert _staging_maps(writer._proc.pid) == {a.id[:8] for a in stager._arenas}
    finally:
        writer.close()
    by_threads = save_state(staged, tmp_path / "t" / "dcp", group=None, thread_count=3)

    shards = sorted(rel for rel in by_threads if rel.endswith(".distcp"))
    assert shards == sorted(rel for rel in by_process if rel.endswith(".distcp"))
    assert len(shards) == 3
    for rel in shards:
        assert by_process[rel] == crc32c_file(tmp_path / "p" / rel)  # what the process reported
        items_p, record_p = split_item_record(tmp_path / "p" / rel)
        items_t, record_t = split_item_record(tmp_path / "t" / rel)
        assert items_p == items_t and record_p["items"] == record_t["items"], rel
    out = {k: torch.zeros_like(v) for k, v in staged.items() if isinstance(v, torch.Tensor)}
    out["obj"] = {"lr": 0.0, "name": "", "betas": (0.0, 0.0)}
    dcp.load(out, checkpoint_id=str(tmp_path / "p" / "dcp"), no_dist=True)
    for key, value in staged.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(out[key], value), key
        else:
            assert out[key] == value, key


def test_the_writer_process_and_its_arena_are_reused(ckpt: Checkpointer, tmp_path: Path) -> None:
    """Later saves reuse the process and the staging arena; each checkpoint holds the state as
    of its own call, though the trainer changes the model right after it."""
    module = make_module(width=64)
    expected = [copy.deepcopy(module)]
    first = ckpt.save_async(tmp_path / "run" / "step1", module, {"step": 1}).result()
    pid, mapped = ckpt._writer._proc.pid, set(ckpt._writer._mapped)
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(1.0)
    expected.append(copy.deepcopy(module))
    second = ckpt.save_async(tmp_path / "run" / "step2", module, {"step": 2})
    with torch.no_grad():
        for p in module.model.parameters():
            p.mul_(-3.0)  # the trainer goes on while the save writes
    paths = [first, second.result()]
    assert (ckpt._writer._proc.pid, ckpt._writer._mapped) == (pid, mapped)
    for step, (path, want) in enumerate(zip(paths, expected, strict=True), start=1):
        loaded = fresh_module(width=64)
        assert ckpt.load(path, loaded) == {"step": step}
        assert_same_state(want, loaded)
    proc = ckpt._writer._proc
    ckpt.close()
    assert proc.poll() is not None  # close() ended it


def test_a_killed_writer_process_fails_the_save_and_the_next_one_starts_a_new_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, "writer-process-writing")  # inherited by the writer process
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", async_writer="process").build()
    try:
        _killed_writer_then_new_one(ckpt, tmp_path, monkeypatch)
    finally:
        ckpt.close()


def _killed_writer_then_new_one(
    ckpt: Checkpointer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead writer's `StorageError` is raised once: by the future when it is read, else by
    the next call, with its own type either way; never again by a later call."""
    module = make_module(width=64)
    step1 = tmp_path / "run" / "step1"
    died = r"writer process \(pid \d+\) died \(killed by signal 9\)"
    future = ckpt.save_async(step1, module, {"step": 1})
    with pytest.raises(StorageError, match=died):
        future.result()
    assert not Checkpointer.dir_is_checkpoint(step1)
    assert list(Checkpointer.find_checkpoints(tmp_path / "run")) == []
    unread = ckpt.save_async(step1, module, {"step": 1})  # read already: not raised again
    wait([unread])  # a new writer process, killed too (waiting reads nothing)
    monkeypatch.delenv(ENV_VAR)
    with pytest.raises(StorageError, match=died) as raised:  # nobody read this one
        ckpt.save_async(tmp_path / "run" / "step2", module, {"step": 2})
    assert raised.value is unread.exception() and type(raised.value) is StorageError
    for step in (1, 2):  # the failed step too: its leftover does not block it
        path = ckpt.save_async(tmp_path / "run" / f"step{step}", module, {"step": step}).result()
        report = Checkpointer.verify(path, deep=True)
        assert report.ok and not report.unverifiable, report
        loaded = fresh_module(width=64)
        assert ckpt.load(path, loaded) == {"step": step}  # no stale error
        assert_same_state(module, loaded)


def _file_size_limit(limit: int) -> contextlib.AbstractContextManager[None]:
    """RLIMIT_FSIZE of this process (and of any process it starts meanwhile) set to `limit`."""

    @contextlib.contextmanager
    def limited() -> Iterator[None]:
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    return limited()


def test_a_write_error_in_the_writer_process_names_the_file(tmp_path: Path) -> None:
    """A file-size limit on the writer process only (it inherits the limit it started under)
    makes its shard writes fail: the save fails with the write error naming the shard; the
    process stays alive until close."""
    with _file_size_limit(256 << 10):
        ckpt = CheckpointerConfig(work_dir=tmp_path / "work", async_writer="process").build()
    module = make_module(width=256)  # shards of about 1 MB
    future = ckpt.save_async(tmp_path / "run" / "step1", module, {"step": 1})
    with pytest.raises(
        StorageError, match=r"cannot write '.*step1-tmp/model_and_optim/__0_\d\.distcp'"
    ):
        future.result()
    writer = ckpt._writer._proc
    assert writer.poll() is None  # an error, not a death
    assert not Checkpointer.dir_is_checkpoint(tmp_path / "run" / "step1")
    ckpt.close()  # the future reported the error: close does not raise it again
    assert writer.poll() is not None


UNDER_A_FILE_SIZE_LIMIT = textwrap.dedent(
    """
    import json, resource, sys
    sys.path.insert(0, sys.argv[2])
    import torch
    from support.models import assert_same_state, fresh_module, make_module
    from trainckpt import CheckpointerConfig, ModelAndOptim, StorageError
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    root = sys.argv[1]
    ckpt = CheckpointerConfig(
        work_dir=root + "/work", async_writer="process", save_thread_count=4
    ).build()
    module = make_module(width=192)  # 2 MB of state; its 4 shard files are below 1 MiB
    ckpt.save(root + "/run/step1", module, {"step": 1})  # the threads write it
    path = ckpt.save_async(root + "/run/step2", module, {"step": 2}).result()
    loaded = fresh_module(width=192)
    ckpt.load(path, loaded)
    assert_same_state(module, loaded)
    big = ModelAndOptim(torch.nn.Linear(600, 500), None)  # a 1.2 MB weight: no file can hold it
    errors = []
    for save in (ckpt.save, lambda *a: ckpt.save_async(*a).result()):
        try:
            save(root + "/big/step3", big, {"step": 3})
        except StorageError as e:
            errors.append(str(e))
    print(json.dumps(errors))
    """
)


def test_under_a_file_size_limit_the_process_writes_what_the_threads_write(
    tmp_path: Path,
) -> None:
    """A file-size limit (`ulimit -f`) below the state's size but above each shard file's: the
    writer process saves what the threads save (its shared memory, which counts against the
    limit, comes in pieces within it). A tensor above the limit fails both with the same
    StorageError, naming the file and the limit."""
    tests = Path(__file__).parents[1]
    run = subprocess.run(
        [sys.executable, "-c", UNDER_A_FILE_SIZE_LIMIT, str(tmp_path), str(tests)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    by_threads, by_process = json.loads(run.stdout.splitlines()[-1])
    assert re.search(
        r"cannot write '.*big/step3-tmp/model_and_optim/__0_\d\.distcp': .*"
        r"RLIMIT_FSIZE, ulimit -f: 1048576 bytes",
        by_threads,
    ), by_threads
    assert by_process == by_threads


def _staging_maps(pid: int) -> set[str]:
    """The staging arenas process `pid` maps (by the first 8 digits of their ids)."""
    return set(re.findall(r"trainckpt-staging-(\w{8})", Path(f"/proc/{pid}/maps").read_text()))


def test_after_a_shape_change_the_writer_lets_go_of_the_old_arena(
    ckpt: Checkpointer, tmp_path: Path
) -> None:
    """New shapes, new arenas: the writer process unmaps the old ones before they are
    allocated (not at the next job), so the old memory is freed then."""
    ckpt.save_async(tmp_path / "step1", make_module(width=32), {"step": 1}).result()
    pid = ckpt._writer._proc.pid
    old = {a.id[:8] for a in ckpt._stager._arenas}
    assert _staging_maps(pid) == old
    future = ckpt.save_async(tmp_path / "step2", make_module(width=48), {"step": 2})
    assert not _staging_maps(pid) & old  # staged anew: the old arena is gone already
    future.result()
    new = {a.id[:8] for a in ckpt._stager._arenas}
    assert _staging_maps(pid) == new and not new & old


TRAINER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[2])
    from support.models import make_module
    from trainckpt import CheckpointerConfig
    ckpt = CheckpointerConfig(work_dir=sys.argv[1] + "/work", async_writer="process").build()
    module = make_module(width=512)
    ckpt.save_async(sys.argv[1] + "/run/step1", module, {"step": 1}).result()
    print(ckpt._writer._proc.pid, flush=True)
    ckpt.save_async(sys.argv[1] + "/run/step2", module, {"step": 2})
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has exited


def test_the_writer_process_exits_when_the_trainer_is_killed(tmp_path: Path) -> None:
    tests = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", TRAINER, str(tmp_path), str(tests)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    writer = int(done.stdout.split()[0])
    deadline = time.monotonic() + 60  # it checks its parent every second
    while _alive(writer) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(writer):
        os.kill(writer, signal.SIGKILL)
        pytest.fail(f"the writer process {writer} outlived its killed trainer")
    assert Checkpointer.dir_is_checkpoint(tmp_path / "run" / "step1")
    assert not Checkpointer.dir_is_checkpoint(tmp_path / "run" / "step2")


@pytest.mark.parametrize("overlap", [False, True])
def test_two_ranks_save_through_writer_processes(tmp_path: Path, overlap: bool) -> None:
    from support.multiproc import run_ranks

    results = run_ranks(_two_ranks, 2, str(tmp_path), overlap)
    assert results == ["ok", "ok"]


def _two_ranks(rank: int, world_size: int, folder: str, overlap: bool) -> str:
    """Called on: both ranks. Both save (DCP splits the replicated state between them) through
    their own writer process, then load it back exactly."""
    ckpt = CheckpointerConfig(
        work_dir=f"{folder}/work{rank}", async_writer="process", collective_timeout=60
    ).build()
    try:
        module = make_module(width=64)
        future = ckpt.save_async(
            f"{folder}/run/step1", module, {"step": 1}, overlap_staging=overlap
        )
        ckpt.wait_for_staging()
        path = future.result()
        report = Checkpointer.verify(path, deep=True)
        assert report.ok, report
        loaded = fresh_module(width=64)
        assert ckpt.load(path, loaded) == {"step": 1}
        assert_same_state(module, loaded)
        return "ok"
    finally:
        ckpt.close()


def test_an_object_store_save_goes_through_the_writer_process(
    ckpt: Checkpointer, gcs_bucket: str
) -> None:
    """Shards the process writes into the staging folder are uploaded as each is reported."""
    module = make_module(width=64)
    path = ckpt.save_async(f"{gcs_bucket}/step1", module, {"step": 1}).result()
    assert ckpt._writer._mapped  # the process wrote it
    report = Checkpointer.verify(path, deep=True)
    assert report.ok and not report.unverifiable, report
    loaded = fresh_module(width=64)
    assert ckpt.load(path, loaded) == {"step": 1}
    assert_same_state(module, loaded)
