"""Storage failures under real conditions (issue 13, case 7): a full filesystem (a tmpfs sized
to fail at the exact file under test), a read-only mount, permission denied (a process without
the capabilities that let root ignore permissions), a file where the save folder should be,
and a file-size limit (`RLIMIT_FSIZE`, needs no root).

Each must be a `StorageError` (a `CheckpointError`) naming the path, with advice for a write
(space, permissions, another folder) when a write failed; nothing is committed and no `-tmp`
is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import TESTS
from support.models import fresh_module, make_module

from trainckpt import Checkpointer, CheckpointerConfig, StorageError
from trainckpt.testing.faults import ENV_VAR

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TRAINCKPT = Path(sys.executable).with_name("trainckpt")
PAGE = 4096
RECORDS = (".manifest.json", ".metadata.json")
LOAD_ADVICE = ("verify", "load an older", "restore")

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="mounting a tmpfs needs root (RLIMIT_FSIZE covers other users)"
)


class Tmpfs:
    """A tmpfs mounted at one path, remountable with another size or read-only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        self.mounted = False

    def mount(self, size: int) -> None:
        self.umount()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path)], check=True
        )
        self.mounted = True

    def read_only(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)

    def umount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=True)
            self.mounted = False


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    fs = Tmpfs(tmp_path / "mnt")
    try:
        yield fs
    finally:
        fs.umount()


def assert_write_error(error: BaseException, path: Path, *advice: str) -> None:
    text = str(error)
    assert isinstance(error, StorageError), repr(error)
    assert f"cannot write '{path}'" in text, text
    for a in advice:
        assert a in text, (a, text)
    assert not any(a in text for a in LOAD_ADVICE), text


def assert_refused(text: str, run: Path, why: str) -> None:
    """A refused write under `run`: the path named, the reason, no load advice (the message
    may come from any step that writes first: a working folder, a claim, a deletion)."""
    assert f"'{run}{os.sep}" in text and why in text.lower(), text
    assert not any(a in text for a in LOAD_ADVICE), text


def assert_nothing_committed(run: Path) -> None:
    assert not run.exists() or not any(run.iterdir()), list(run.iterdir())


# -- a full filesystem -----------------------------------------------------------------------------


@needs_root
@pytest.mark.parametrize("record", RECORDS)
def test_no_space_for_a_record(tmpfs: Tmpfs, ckpt: Checkpointer, tmp_path: Path, record: str):
    """A save killed just before it writes the manifest (`before-manifest`) shows how many
    pages the filesystem holds at that moment; a fresh tmpfs of exactly that size (plus the
    manifest's page when the commit record is under test) makes the write of `record` the one
    that finds no space."""
    run = tmpfs.path / "run"
    tmpfs.mount(8 << 20)
    killed = save_in_subprocess(run / "step1", tmp_path / "work", fault="before-manifest")
    assert killed == ("killed", ""), killed
    st = os.statvfs(tmpfs.path)
    pages = (st.f_blocks - st.f_bfree) * st.f_frsize // PAGE + RECORDS.index(record)
    tmpfs.mount(pages * PAGE)  # a fresh, smaller filesystem at the same path

    with pytest.raises(StorageError) as info:
        ckpt.save(run / "step1", make_module(), {"step": 1})
    assert_write_error(info.value, run / "step1-tmp" / record, "no space left", "another disk")
    assert_nothing_committed(run)
    assert ckpt.find_latest_good(run) is None


@needs_root
def test_no_space_for_the_shards(tmpfs: Tmpfs, ckpt: Checkpointer):
    """Full while DCP writes its shards (in its own writer threads): still our error, with write
    advice, not the load advice of a failed DCP call."""
    run = tmpfs.path / "run"
    tmpfs.mount(16 * PAGE)  # the trainer state fits, the shards do not
    with pytest.raises(StorageError) as info:
        ckpt.save(run / "step1", make_module(), {"step": 1})
    text = str(info.value)
    assert f"'{run / 'step1-tmp' / 'model_and_optim'}" in text, text
    assert "no space left" in text and not any(a in text for a in LOAD_ADVICE), text
    assert_nothing_committed(run)


# -- a read-only filesystem ------------------------------------------------------------------------


@needs_root
def test_read_only_filesystem(tmpfs: Tmpfs, ckpt: Checkpointer):
    run = tmpfs.path / "run"
    tmpfs.mount(8 << 20)
    ckpt.save(run / "step1", make_module(), {"step": 1})
    ckpt.save(run / "step2", make_module(), {"step": 2}, ephemeral=True)
    shutil.copytree(run / "step1", run / "step3-tmp")  # a crashed save's working folder
    tmpfs.read_only()
    before = sorted(p.relative_to(run) for p in run.rglob("*"))

    for step in (3, 4):  # with a leftover to clear first, and without
        with pytest.raises(StorageError) as info:
            ckpt.save(run / f"step{step}", make_module(), {"step": step})
        assert_refused(str(info.value), run, "read-only")
    with pytest.raises(StorageError) as info:
        ckpt.write_file(run, "config.yaml", "lr: 1")
    assert_write_error(info.value, run / "config.yaml", "read-only", "writable folder")
    prune = subprocess.run(
        [str(TRAINCKPT), "prune", str(run), "-k", "1"], capture_output=True, text=True, timeout=300
    )
    assert prune.returncode == 2 and "Traceback" not in prune.stderr, prune
    assert_refused(prune.stderr, run, "read-only")
    # reading is unaffected, and nothing changed
    assert ckpt.load(ckpt.find_latest_good(run), fresh_module()) == {"step": 2}
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


# -- permission denied -----------------------------------------------------------------------------


def run_without_override(
    code: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run Python `code` (or, with `args`, the `trainckpt` command) in a process that cannot
    ignore file permissions: as root, with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped
    from its bounding set; as any other user, as it is."""
    cmd = [str(TRAINCKPT), *args] if args else [sys.executable, "-c", code]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=env)


SAVE = """
import json, sys
sys.path.insert(0, {tests!r})
from support.models import make_module
from trainckpt import CheckpointerConfig
c = CheckpointerConfig(work_dir={work!r}).build()
try:
    c.save({target!r}, make_module(), {{"step": 1}})
    print(json.dumps(["saved", ""]))
except BaseException as e:
    print(json.dumps([type(e).__name__, str(e)]))
"""


def save_in_subprocess(target: Path, work: Path, fault: str | None = None) -> tuple[str, str]:
    """Save one checkpoint in a process that cannot ignore permissions; (error type, message),
    ("saved", "") or, when SIGKILLed at the `fault` point, ("killed", "")."""
    code = SAVE.format(tests=str(TESTS), work=str(work), target=str(target))
    env = {**os.environ, ENV_VAR: fault} if fault else None
    proc = run_without_override(code, env=env)
    if fault and proc.returncode == -signal.SIGKILL:
        return "killed", ""
    assert proc.returncode == 0, proc.stderr
    kind, text = json.loads(proc.stdout.strip().splitlines()[-1])
    return kind, text


def test_permission_denied_on_the_save_folder(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o555)
    try:
        kind, text = save_in_subprocess(run / "step1", tmp_path / "work")
    finally:
        run.chmod(0o755)
    assert kind == "StorageError", (kind, text)
    assert_refused(text, run, "permission denied")
    assert "write access" in text or "writable" in text, text
    assert_nothing_committed(run)


def test_verify_deep_of_an_unreadable_shard(tmp_path: Path, ckpt: Checkpointer):
    saved = Path(ckpt.save(tmp_path / "run" / "step1", make_module(), {"step": 1}))
    shard = next((saved / "model_and_optim").glob("*.distcp"))
    shard.chmod(0o000)
    proc = run_without_override("", "verify", "--deep", str(saved))
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert f"cannot read '{shard}': permission denied" in err and "read access" in err, err


# -- a file where a folder should be ---------------------------------------------------------------


def test_save_folder_that_is_a_file(tmp_path: Path, ckpt: Checkpointer):
    afile = tmp_path / "run"
    afile.write_text("not a folder")
    for target in (afile / "step1", afile / "sub" / "step1"):
        with pytest.raises(StorageError) as info:
            ckpt.save(target, make_module(), {"step": 1})
        text = str(info.value)
        assert f"'{afile}' is a file, not a folder" in text and "another save folder" in text
    assert afile.read_text() == "not a folder"


def test_work_dir_that_is_a_file(tmp_path: Path):
    afile = tmp_path / "scratch"
    afile.write_text("not a folder")
    for work_dir in (afile, afile / "sub"):
        with pytest.raises(StorageError) as info:
            CheckpointerConfig(work_dir=str(work_dir)).build()
        assert f"'{afile}' is a file, not a folder" in str(info.value)
    assert afile.read_text() == "not a folder"


# -- a file-size limit (any user) ------------------------------------------------------------------

SAVE_LIMITED = """
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an EFBIG error instead of a killed process
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
"""


def test_file_size_limit(tmp_path: Path):
    run = tmp_path / "run"
    code = SAVE_LIMITED + SAVE.format(
        tests=str(TESTS), work=str(tmp_path / "work"), target=str(run / "step1")
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    kind, text = json.loads(proc.stdout.strip().splitlines()[-1])
    assert kind == "StorageError", (kind, text)
    assert f"cannot write '{run / 'step1-tmp'}" in text and "ulimit" in text, text
    assert not any(a in text for a in LOAD_ADVICE), text
    assert_nothing_committed(run)
    shutil.rmtree(tmp_path / "work", ignore_errors=True)


@pytest.mark.parametrize("limit", [1_500_000, 3_000_000, 5_000_000])
def test_a_failed_item_write_leaves_nothing_that_aborts_the_process_later(
    tmp_path: Path, limit: int
):
    """A write that fails inside a tensor item (the file-size limit hits at several depths)
    must not leave torch's zip writer unfinished: finished in its C++ destructor when garbage
    is collected, its failing write would throw out of a destructor and abort the process
    ("Fatal Python error: Aborted" in an unrelated test, much later)."""
    run = tmp_path / "run"
    code = SAVE_LIMITED.replace("20000", str(limit)) + SAVE.format(
        tests=str(TESTS), work=str(tmp_path / "work"), target=str(run / "step1")
    )
    # Tensors of 2.4 MB: larger than the checksummed file's write buffer, so the limit is hit
    # inside torch's zip writer, not at a later flush.
    code = code.replace("make_module()", "make_module(steps=1, width=768)")
    code += "import gc\ngc.collect()\nprint('collected')\n"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "collected"
    kind, _ = json.loads(proc.stdout.strip().splitlines()[-2])
    assert kind == "StorageError"
    assert_nothing_committed(run)


def test_unwritable_work_dir_of_an_object_store_save(gcs_bucket: str, tmp_path: Path):
    """Saves to gs:// stage their files in `work_dir`: a file in its place is a StorageError
    naming it, and nothing is uploaded."""
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    blocker = tmp_path / "work"
    shutil.rmtree(blocker)
    blocker.write_text("not a folder")
    with pytest.raises(StorageError, match=f"'{blocker}' is a file, not a folder"):
        ckpt.save(f"{gcs_bucket}/run/step1", make_module(), {"step": 1})
    assert list(Checkpointer.find_checkpoints(f"{gcs_bucket}/run")) == []
    ckpt.close()
