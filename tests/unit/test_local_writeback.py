"""The own part's early writeback (`part_write.start_writeback`, docs/local-tier.md, "Layout"):
while a piece is written the kernel is asked, on a flusher thread, to start writing what is in
it so far. Each request must reach the piece's own open descriptor (never one closed and
reused meanwhile), cover only bytes already written, and change nothing the commit protocol
promises: a save that dies with requests still running leaves no record, and the older step
is the newest."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from support.models import assert_same_state, fresh_module, make_module

from trainckpt import Checkpointer, CheckpointerConfig
from trainckpt.local import part_write
from trainckpt.local.layout import scan
from trainckpt.testing.faults import on_fault_point


class _Requests:
    """Every writeback request, checked as it runs: the descriptor names an open piece of a
    part (`/proc/self/fd`), and the range ends where that file's bytes end at most."""

    def __init__(self, delay: float = 0.0) -> None:
        self.seen: list[tuple[str, int, int]] = []
        self.wrong: list[str] = []
        self.delay = delay
        self._lock = threading.Lock()
        self._real = part_write.start_writeback

    def __call__(self, fd: int, start: int, end: int) -> None:
        time.sleep(self.delay)  # a slow disk queue: the file is still open afterwards
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
            size = os.fstat(fd).st_size
        except OSError as e:
            name, size = f"<closed: {e}>", -1
        with self._lock:
            self.seen.append((name, start, end))
            if "/rank" not in name or not Path(name).name.startswith("module."):
                self.wrong.append(f"fd {fd} is {name}")
            elif not 0 <= start < end <= size:
                self.wrong.append(f"{name}: [{start}, {end}) beyond its {size} bytes")
        self._real(fd, start, end)


def _ckpt(tmp_path: Path) -> Checkpointer:
    return CheckpointerConfig(
        local_dir=tmp_path / "local", work_dir=tmp_path / "w", local_keep=3
    ).build()


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> _Requests:
    """Pieces of 32 KiB, a file buffer of 1 KiB, writeback asked for every 4 KiB: many
    requests on the test module's ~110 KB part."""
    monkeypatch.setattr(part_write, "PIECE_BYTES", 32 << 10)
    monkeypatch.setattr(part_write, "_WRITE_BUFFER", 1 << 10)
    monkeypatch.setattr(part_write, "max_pieces", lambda: 2)
    monkeypatch.setattr(part_write, "WRITEBACK_BYTES", 4 << 10)
    seen = _Requests()
    monkeypatch.setattr(part_write, "start_writeback", seen)
    return seen


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_writeback_requests_reach_only_the_open_piece_and_the_part_restores(
    tmp_path: Path, requests: _Requests
):
    ckpt = _ckpt(tmp_path)
    saved = make_module(seed=1)
    ckpt.save_local(1, saved, {"step": 1}).result()
    assert requests.wrong == []
    pieces = {Path(name).name for name, _s, _e in requests.seen}
    assert pieces == {"module.0.pt", "module.1.pt"}, requests.seen
    for piece in pieces:  # from the start on, no byte asked for twice (they run on a pool)
        ranges = sorted((s, e) for name, s, e in requests.seen if Path(name).name == piece)
        assert ranges[0][0] == 0
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), ranges
    into = fresh_module()
    assert ckpt.load_local(1, into) == {"step": 1}
    assert_same_state(into, saved)
    ckpt.close()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_a_save_that_dies_with_writeback_requests_running_never_counts(
    tmp_path: Path, requests: _Requests
):
    """The save fails once the module's pieces are handed over, while slow writeback
    requests still run: the pieces are closed only after their requests (each request still
    finds its own piece open), the part has no record, and the older step is the newest."""
    ckpt = _ckpt(tmp_path)
    first = make_module(seed=1)
    ckpt.save_local(1, first, {"step": 1}).result()
    requests.seen.clear()
    requests.delay = 0.05

    def die() -> None:
        raise OSError("killed while the writeback requests run")

    with on_fault_point("local-writing", die), pytest.raises(Exception, match="killed"):
        ckpt.save_local(2, make_module(seed=2), {"step": 2}).result()
    assert requests.seen and requests.wrong == []
    (torn,) = (tmp_path / "local").glob("step2/*/rank0")
    assert not (torn / "part.json").exists()
    assert [item.path for item in scan(tmp_path / "local")[1]] == [torn.parent]
    assert ckpt.latest_local() == 1
    into = fresh_module()
    assert ckpt.load_latest_local(into) == (1, {"step": 1})
    assert_same_state(into, first)
    ckpt.close()
