"""A local-tier part cut into pieces (docs/local-tier.md, "On disk"): the pieces restore
bit-exact, a missing, truncated or changed piece is found and named and the step falls back,
a torn part (no record) never counts, and a part written before pieces existed (one file per
data file) still restores."""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from support import TESTS
from support.models import assert_same_state, fresh_module, make_module

from trainckpt import Checkpointer, CheckpointerConfig, StorageError
from trainckpt.errors import CorruptCheckpointError
from trainckpt.local import part_write
from trainckpt.local.layout import LocalPart, scan
from trainckpt.local.part_check import combined
from trainckpt.storage.checksums import FileEntry, crc32c_bytes
from trainckpt.testing.faults import on_fault_point

PIECES = ["module.0.pt", "module.1.pt", "module.2.pt", "module.3.pt"]


@pytest.fixture(autouse=True)
def _small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 16 KiB, at most 4: the test module's ~110 KB part is cut into 4."""
    monkeypatch.setattr(part_write, "PIECE_BYTES", 16 << 10)
    monkeypatch.setattr(part_write, "max_pieces", lambda: 4)


def _ckpt(tmp_path: Path) -> Checkpointer:
    return CheckpointerConfig(
        local_dir=tmp_path / "local", work_dir=tmp_path / "w", local_keep=3
    ).build()


def _part(tmp_path: Path, step: int) -> Path:
    (part,) = (tmp_path / "local").glob(f"step{step}/*/rank0")
    return part


def test_a_large_part_is_cut_into_pieces_that_restore_bit_exact(tmp_path: Path):
    ckpt = _ckpt(tmp_path)
    saved = make_module(seed=1)
    ckpt.save_local(1, saved, {"step": 1}).result()
    part = _part(tmp_path, 1)
    assert sorted(p.name for p in part.iterdir()) == sorted([*PIECES, "part.json", "train.pt"])
    record = json.loads((part / "part.json").read_text())
    assert sorted(record["files"]) == sorted([*PIECES, "train.pt"])
    sizes = [(part / p).stat().st_size for p in PIECES]
    assert all(s > 0 for s in sizes) and max(sizes[:-1]) - min(sizes[:-1]) <= 1, sizes
    for name, entry in record["files"].items():
        assert crc32c_bytes((part / name).read_bytes()) == entry["crc32c"], name
    into = fresh_module()
    assert ckpt.load_local(1, into) == {"step": 1}
    assert_same_state(into, saved)
    ckpt.close()


@pytest.mark.parametrize("how", ["missing", "truncated", "flipped"])
def test_a_damaged_piece_is_named_and_the_older_step_restored(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
):
    ckpt = _ckpt(tmp_path)
    modules = {step: make_module(seed=step) for step in (1, 2)}
    for step, module in modules.items():
        ckpt.save_local(step, module, {"step": step}).result()
    piece = _part(tmp_path, 2) / "module.2.pt"
    data = piece.read_bytes()
    if how == "missing":
        piece.unlink()
    elif how == "truncated":
        piece.write_bytes(data[: len(data) // 2])
    else:  # same size: the step still counts and fails its check when read
        piece.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    with caplog.at_level(logging.WARNING):
        if how == "flipped":
            assert ckpt.latest_local() == 2
            with pytest.raises(CorruptCheckpointError, match="no intact copy"):
                ckpt.load_local(2, fresh_module())
        else:
            assert ckpt.latest_local() == 1
        into = fresh_module()
        assert ckpt.load_latest_local(into) == (1, {"step": 1})
    assert_same_state(into, modules[1])
    named = [r.getMessage() for r in caplog.records if "module.2.pt" in r.getMessage()]
    assert named, caplog.text  # the warning names the piece
    ckpt.close()


def test_a_save_that_dies_before_every_piece_is_durable_never_counts(tmp_path: Path):
    """The save fails after the module's pieces went to their flushes and before its record
    (the point a SIGKILL stops at in tests/distributed/test_local_tier.py), a piece cut
    short as a power cut may leave an unflushed one: no `part.json`, so the part is a
    leftover, the older step is the newest, and the next start deletes the torn part."""
    ckpt = _ckpt(tmp_path)
    first = make_module(seed=1)
    ckpt.save_local(1, first, {"step": 1}).result()

    def die() -> None:
        (torn,) = (tmp_path / "local").glob("step2/*/rank0")
        with open(torn / "module.1.pt", "r+b") as f:
            f.truncate(10)
        raise OSError("killed between the flushes of the pieces")

    with on_fault_point("local-writing", die), pytest.raises(Exception, match="killed"):
        ckpt.save_local(2, make_module(seed=2), {"step": 2}).result()
    torn = _part(tmp_path, 2)
    assert not (torn / "part.json").exists()
    assert [item.path for item in scan(tmp_path / "local")[1]] == [torn.parent]
    assert ckpt.latest_local() == 1
    ckpt.close()
    again = _ckpt(tmp_path)
    into = fresh_module()
    assert again.load_latest_local(into) == (1, {"step": 1})
    assert_same_state(into, first)
    assert not (tmp_path / "local" / "step2").exists()  # the leftover was deleted
    again.close()


def test_a_part_of_one_file_per_data_file_still_restores(tmp_path: Path):
    """A part as the version before pieces wrote it: `module.pt` and `train.pt`, and a record
    listing exactly those two files."""
    ckpt = _ckpt(tmp_path)
    saved = make_module(seed=1)
    ckpt.save_local(1, saved, {"step": 1}).result()
    part = _part(tmp_path, 1)
    whole = b"".join((part / p).read_bytes() for p in PIECES)
    (part / "module.pt").write_bytes(whole)
    for p in PIECES:
        (part / p).unlink()
    record = json.loads((part / "part.json").read_text())
    record["files"] = {
        "module.pt": {"size": len(whole), "crc32c": crc32c_bytes(whole)},
        "train.pt": record["files"]["train.pt"],
    }
    (part / "part.json").write_text(json.dumps(record))
    ckpt.close()
    again = _ckpt(tmp_path)
    assert again.latest_local() == 1
    into = fresh_module()
    assert again.load_local(1, into) == {"step": 1}
    assert_same_state(into, saved)
    again.close()


def test_a_record_whose_pieces_do_not_line_up_is_refused():
    entry = {"size": 1, "crc32c": "00000000"}
    base = {"step": 1, "attempt": "0" * 16 + "-" + "0" * 8, "owner": 0, "world_size": 1}
    good = LocalPart(**base, files={"module.0.pt": entry, "module.1.pt": entry, "train.pt": entry})
    assert [f for _n, f, _e in good.stream()] == ["module.0.pt", "module.1.pt", "train.pt"]
    assert good.file_size("module.pt") == 2
    for files in (
        {"module.0.pt": entry, "module.2.pt": entry, "train.pt": entry},  # a gap
        {"module.pt": entry, "module.0.pt": entry, "train.pt": entry},  # both forms
        {"module.1.pt": entry, "train.pt": entry},  # no piece 0
        {"module.pt": entry},  # no trainer state
        {"module.pt": entry, "train.pt": entry, "extra.pt": entry},
    ):
        with pytest.raises(ValidationError):
            LocalPart(**base, files=files)


def test_piece_count_follows_the_size_within_the_writer_threads(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(part_write, "PIECE_BYTES", 64 << 20)
    monkeypatch.setattr(part_write, "max_pieces", lambda: 4)
    assert [part_write.piece_count(n << 20) for n in (0, 1, 64, 65, 142, 1000)] == [
        1,
        1,
        1,
        2,
        3,
        4,
    ]


@pytest.mark.parametrize("sizes", [(0, 5), (5, 0), (1, 1), (4096, 12345), (3 << 20, 1 << 20, 7)])
def test_the_pieces_crc32cs_combine_into_the_whole_files(sizes: tuple[int, ...]):
    """What a restore checks a data file in pieces against: the CRC32C of the whole bytes."""
    blobs = [os.urandom(n) for n in sizes]
    pieces = [
        (f"p{i}", FileEntry(size=len(b), crc32c=crc32c_bytes(b))) for i, b in enumerate(blobs)
    ]
    whole = b"".join(blobs)
    assert combined(pieces) == FileEntry(size=len(whole), crc32c=crc32c_bytes(whole))


def test_only_bytes_inside_a_staged_storage_are_handed_over_in_place():
    """What a piece's thread may read after torch.save moved on: bytes of the staged tensors'
    storages, never a buffer torch reuses (anything else is copied first)."""
    a, b = torch.arange(1000, dtype=torch.float32), torch.zeros(10, dtype=torch.int64)
    staged = part_write._Staged({"a": a, "nested": [{"b": b}], "n": 3})
    whole = memoryview(a.numpy()).cast("B")
    assert staged.holds(whole)
    assert staged.holds(whole[100:200])
    assert staged.holds(memoryview(b.numpy()).cast("B")[8:])
    assert not staged.holds(memoryview(bytearray(4000)))
    assert not staged.holds(memoryview(a.clone().numpy()).cast("B"))
    assert not part_write._Staged({}).holds(whole)
    wider = torch.arange(2000, dtype=torch.float32)
    inner = part_write._Staged({"a": wider[:1000]})  # a view: its whole storage is staged
    assert inner.holds(memoryview(wider.numpy()).cast("B")[4000:8000])
    assert not inner.holds(memoryview(torch.arange(3000).numpy()).cast("B"))


def test_torchs_reused_header_buffers_are_copied_and_the_pieces_restore(tmp_path: Path):
    """Small records (headers, padding, data.pkl) go through buffers torch reuses: a piece
    whose thread read them late would hold another record's bytes. Many small tensors, with
    pieces of a few KiB and nothing handed over in place below 1 KiB, restore bit-exact."""
    ckpt = _ckpt(tmp_path)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(part_write, "_HAND_OVER_BYTES", 1 << 10)
        m.setattr(part_write, "_WRITE_BUFFER", 2 << 10)
        saved = make_module(seed=3)
        ckpt.save_local(1, saved, {"step": 1}).result()
    into = fresh_module()
    assert ckpt.load_local(1, into) == {"step": 1}
    assert_same_state(into, saved)
    ckpt.close()


_LIMITED = """
import json, resource, signal, sys
sys.path.insert(0, {tests!r})
from support.models import make_module
from trainckpt import CheckpointerConfig, CheckpointError
from trainckpt.local import part_write
part_write.PIECE_BYTES = 16 << 10
part_write.max_pieces = lambda: 2
ckpt = CheckpointerConfig(local_dir={local!r}, work_dir={work!r}, local_keep=3).build()
ckpt.save_local(1, make_module(seed=1), {{"step": 1}}).result()  # before the limit
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an EFBIG error instead of a killed process
resource.setrlimit(resource.RLIMIT_FSIZE, (40000, 40000))
try:
    ckpt.save_local(2, make_module(seed=2), {{"step": 2}}).result()
    print(json.dumps(["saved", ""]))
except CheckpointError as e:
    print(json.dumps([type(e).__name__, str(e), ckpt.latest_local()]))
ckpt.close()
"""


def test_a_piece_that_cannot_be_written_fails_the_save_and_names_it(tmp_path: Path):
    """A write that fails on a piece's own thread (a file-size limit: each piece is ~55 KB,
    the limit 40 KB) fails the save with a `CheckpointError` naming the piece; the part gets
    no record and the older step stays the newest."""
    code = _LIMITED.format(
        tests=str(TESTS), local=str(tmp_path / "local"), work=str(tmp_path / "w")
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    kind, text, latest = json.loads(proc.stdout.strip().splitlines()[-1])
    assert kind == "StorageError", (kind, text)
    assert "module.0.pt" in text or "module.1.pt" in text, text
    assert latest == 1
    (torn,) = (tmp_path / "local").glob("step2/*/rank0")
    assert not (torn / "part.json").exists()


def test_a_piece_that_cannot_be_created_mid_torch_save_fails_the_save_not_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The second piece is opened from inside torch's C++ writer (its write callback): an
    error thrown back into it terminates the process. A disk full at that moment must be the
    save's `StorageError` naming the piece, the part without a record, the older step kept."""
    ckpt = _ckpt(tmp_path)
    first = make_module(seed=1)
    ckpt.save_local(1, first, {"step": 1}).result()

    def full_disk(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path).name == "module.1.pt":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(part_write, "open", full_disk, raising=False)
    with pytest.raises(StorageError, match=r"module\.1\.pt"):
        ckpt.save_local(2, make_module(seed=2), {"step": 2}).result()
    torn = _part(tmp_path, 2)
    assert not (torn / "part.json").exists()
    assert ckpt.latest_local() == 1
    into = fresh_module()
    assert ckpt.load_latest_local(into) == (1, {"step": 1})
    assert_same_state(into, first)
    ckpt.close()
