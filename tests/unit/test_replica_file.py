"""`local/replica_file.py`: each disk's way of writing replicas is measured once and kept, the
faster way wins (`O_DIRECT` only by a clear margin), and both ways write exactly the bytes
given with the CRC32C a plain read computes."""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import pytest

from trainckpt.local import replica_file
from trainckpt.local.replica_file import MODE_FILE, WriteMode, decide, read_mode
from trainckpt.storage.checksums import crc32c_file


def test_a_disk_is_measured_once_and_the_verdict_kept(tmp_path: Path):
    mode = decide(tmp_path)
    assert mode.page_seconds > 0 and mode.probe_bytes == replica_file.PROBE_BYTES
    if mode.direct:
        assert mode.direct_seconds is not None
        assert mode.direct_seconds <= replica_file.MARGIN * mode.page_seconds
    assert read_mode(tmp_path) == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODE_FILE]  # no probe file left
    kept = json.loads((tmp_path / MODE_FILE).read_text()) | {"direct": not mode.direct}
    (tmp_path / MODE_FILE).write_text(json.dumps(kept))
    assert decide(tmp_path).direct is not mode.direct  # the kept verdict, not measured again


@pytest.mark.parametrize(
    ("page", "direct", "chosen"),
    [
        (1.0, 0.5, True),  # clearly faster past the page cache
        (1.0, 0.95, False),  # within the margin: the page cache
        (0.5, 1.0, False),
        (1.0, None, False),  # the filesystem refuses O_DIRECT
    ],
)
def test_o_direct_only_where_it_measured_clearly_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page: float, direct: float | None, chosen: bool
):
    times = {False: page, True: direct}
    monkeypatch.setattr(replica_file, "_probe", lambda root, way, chunk: times[way])
    mode = decide(tmp_path)
    assert mode == WriteMode(chosen, page, direct, replica_file.PROBE_BYTES)
    assert read_mode(tmp_path) == mode


def test_an_unreadable_verdict_is_measured_again(tmp_path: Path):
    (tmp_path / MODE_FILE).write_text("{not json")
    (tmp_path / ".write-probe.dead.tmp").write_bytes(b"x")  # of a probe that crashed
    assert read_mode(tmp_path) is None
    mode = decide(tmp_path)
    assert read_mode(tmp_path) == mode
    assert not list(tmp_path.glob(".write-probe.*"))


@pytest.mark.parametrize("direct", [False, True])
def test_both_ways_write_exactly_the_bytes_given(tmp_path: Path, direct: bool):
    aligned = mmap.mmap(-1, 3 << 20)
    aligned.write(os.urandom(3 << 20))
    pieces = [memoryview(aligned), memoryview(bytearray(b"tail" * 1001)), memoryview(b"")]
    path = tmp_path / "replica"
    with replica_file.replica_file(path, direct) as w:
        for piece in pieces:
            w.write(piece)
    expected = b"".join(bytes(p) for p in pieces)
    assert path.read_bytes() == expected
    assert w.entry().size == len(expected)
    assert w.entry().crc32c == crc32c_file(path).crc32c
