"""The `.metadata` reader (CPython's C unpickler behind an exact allow-list) refuses every way
a pickle reaches code: each opcode family that takes a global, calls, builds or sets state,
extension codes that copyreg's registry and cache would answer, persistent ids and out-of-band
buffers; each crafted payload first proven live under `pickle.loads`. Bombs stay within a
memory bound, deep nesting costs no stack."""

from __future__ import annotations

import copyreg
import os
import pickle
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.hostile import MARK, POP, call, ext1, ext2, ext4, glob, inst, program, stack_glob, text

from trainckpt import CorruptCheckpointError, UnsafeCheckpointError
from trainckpt.format.safe_unpickle import load_dcp_metadata
from trainckpt.format.safe_unpickle.dcp_allow_list import _IDLE

DCP_MD = "torch.distributed.checkpoint.metadata"
EMPTY_TUPLE, REDUCE, BUILD, NEWOBJ, OBJ, DUP = b")", b"R", b"b", b"\x81", b"o", b"2"


def _mkdir(marker: Path) -> bytes:
    """Pushes `os.mkdir(marker)`: the payload whose directory proves code ran."""
    return call(glob("os", "mkdir"), text(str(marker)))


@pytest.fixture
def extension_code():
    """An extension code (copyreg's registry) naming `os.mkdir`, as a victim process could
    have registered; removed after the test."""
    copyreg.add_extension("os", "mkdir", 0xF1)
    yield 0xF1
    copyreg.remove_extension("os", "mkdir", 0xF1)


def _refused_and_inert(data: bytes, marker: Path, match: str) -> None:
    """`data` makes `marker` under pickle.loads (checked first); the loader refuses it and
    makes nothing."""
    pickle.loads(data, buffers=[b"buffer"])  # the payload is live
    assert marker.is_dir()
    os.rmdir(marker)
    with pytest.raises(UnsafeCheckpointError, match=rf"md: .*{match}") as info:
        load_dcp_metadata(data, "md")
    assert "nothing from it was run" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    "kind", ["GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "NEWOBJ", "out of band", "text"]
)
def test_each_opcode_family_with_a_disallowed_global_runs_nothing(kind, tmp_path):
    marker = tmp_path / "ran"
    m = text(str(marker))
    payloads = {
        "GLOBAL": (program(_mkdir(marker)), "global 'os.mkdir'"),
        "STACK_GLOBAL": (
            program(stack_glob("os", "mkdir") + MARK + m + b"tR"),
            "global 'os.mkdir'",
        ),
        "INST": (program(MARK + m + inst("os", "mkdir")), "global 'os.mkdir'"),
        "OBJ": (program(MARK + glob("os", "mkdir") + m + OBJ), "global 'os.mkdir'"),
        "NEWOBJ": (program(glob("os", "mkdir") + MARK + m + b"t" + NEWOBJ), "global 'os.mkdir'"),
        "out of band": (program(b"\x97" + POP + _mkdir(marker), protocol=5), "NEXT_BUFFER"),
        "text": (program(b"S'x'\n" + POP + _mkdir(marker)), "global 'os.mkdir'"),
    }
    data, match = payloads[kind]
    if kind == "NEWOBJ":  # os.mkdir is no class: pickle refuses NEWOBJ; still never named here
        with pytest.raises(UnsafeCheckpointError, match=match):
            load_dcp_metadata(data, "md")
        return
    _refused_and_inert(data, marker, match)


@pytest.mark.parametrize("ext", [ext1, ext2, ext4])
def test_extension_codes_in_copyregs_cache_run_nothing(ext, tmp_path, extension_code):
    """copyreg's cache answers an extension code without asking `find_class`: with the code
    registered and cached (by pickle's own load first), it is still refused."""
    marker = tmp_path / "ran"
    data = program(ext(extension_code) + MARK + text(str(marker)) + b"tR")
    _refused_and_inert(data, marker, f"opcode {ext.__name__.upper()} at byte 2")


def test_an_unregistered_extension_code_is_an_error():
    assert not copyreg._inverted_registry  # type: ignore[attr-defined]
    with pytest.raises(CorruptCheckpointError, match="md"):
        load_dcp_metadata(program(ext1(0xF2)), "md")


def test_persistent_ids_are_refused():
    for data in (program(b"Pid\n"), program(text("id") + b"Q")):
        with pytest.raises(UnsafeCheckpointError, match="persistent id"):
            load_dcp_metadata(data, "md")


def _metadata_with_storage(path_after: str | None) -> bytes:
    """A `Metadata` with one storage record, whose path is "a"; with `path_after`, that record
    is fetched from the memo after the Metadata was built and BUILT again with that path."""
    fs = "torch.distributed.checkpoint.filesystem"

    def fields(*pairs: bytes) -> bytes:
        return b"}(" + b"".join(pairs) + b"u" + BUILD

    def info(path: str) -> bytes:
        zero = b"K\x00"
        return fields(
            text("relative_path") + text(path), text("offset") + zero, text("length") + zero
        )

    index = (
        stack_glob(DCP_MD, "MetadataIndex") + EMPTY_TUPLE + NEWOBJ + fields(text("fqn") + text("w"))
    )
    record = stack_glob(fs, "_StorageInfo") + EMPTY_TUPLE + NEWOBJ + b"q\x01" + info("a")
    storage = b"}" + index + record + b"s"
    body = stack_glob(DCP_MD, "Metadata") + EMPTY_TUPLE + NEWOBJ
    body += fields(text("state_dict_metadata") + b"}", text("storage_data") + storage)
    if path_after is not None:
        body += b"h\x01" + info(path_after) + POP
    return program(body, protocol=4)


def test_a_record_is_checked_as_it_ends_up_not_as_it_was_first_built():
    read = load_dcp_metadata(_metadata_with_storage(None), "md")
    assert [i.relative_path for i in read.storage_data.values()] == ["a"]
    assert type(read).__module__ == DCP_MD  # DCP's own classes, not trainckpt's stand-ins
    with pytest.raises(UnsafeCheckpointError, match="relative_path.*outside the checkpoint"):
        load_dcp_metadata(_metadata_with_storage("../x"), "md")


def test_build_cannot_change_an_allowed_callable_and_records_stay_in_their_fields():
    """BUILD on a checking constructor; a record (or record class) anywhere but where DCP's
    `Metadata` declares one; a record called with arguments: all refused."""
    chunk = stack_glob(DCP_MD, "ChunkStorageMetadata")
    cases = {
        "callable": (glob("collections", "OrderedDict") + b"}" + BUILD, "BUILD of"),
        "record outside": (chunk + EMPTY_TUPLE + NEWOBJ, "ChunkStorageMetadata record outside"),
        "class outside": (b"]" + chunk + b"a", "ChunkStorageMetadata record outside"),
        "in planner data": (
            stack_glob(DCP_MD, "Metadata")
            + EMPTY_TUPLE
            + NEWOBJ
            + b"}("
            + text("state_dict_metadata")
            + b"}"
            + text("planner_data")
            + chunk
            + EMPTY_TUPLE
            + NEWOBJ
            + b"ub",
            "ChunkStorageMetadata record outside",
        ),
        "called": (chunk + MARK + text("p") + b"tR", "called"),
    }
    for body, match in cases.values():
        with pytest.raises(UnsafeCheckpointError, match=match):
            load_dcp_metadata(program(body, protocol=4), "md")


def test_an_allow_list_is_reused_only_after_a_load_that_ended_well():
    """Loads take an allow-list a good load gave back (its stand-in classes free again); one
    whose load was refused is never used again, and reuse never lets a crafted record through,
    with loads on several threads at once."""
    good = _metadata_with_storage(None)
    leaked = program(stack_glob(DCP_MD, "ChunkStorageMetadata") + EMPTY_TUPLE + NEWOBJ, protocol=4)
    _IDLE.clear()
    load_dcp_metadata(good, "md")
    (idle,) = _IDLE
    with pytest.raises(UnsafeCheckpointError, match="record outside"):
        load_dcp_metadata(leaked, "md")  # took `idle`, and a record of its classes lives on
    assert idle not in _IDLE
    assert type(load_dcp_metadata(good, "md")).__module__ == DCP_MD

    def rounds(seed: int) -> list[str]:
        seen = []
        for i in range(60):
            if (i + seed) % 3:
                read = load_dcp_metadata(good, "md")
                seen.append(type(next(iter(read.storage_data.values()))).__module__)
            else:
                with pytest.raises(UnsafeCheckpointError, match="record outside"):
                    load_dcp_metadata(leaked, "md")
        return seen

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(rounds, range(6)))
    assert {m for r in results for m in r} == {"torch.distributed.checkpoint.filesystem"}
    assert sum(map(len, results)) == 6 * 40
    assert len(_IDLE) <= 4


@pytest.mark.parametrize(
    "bomb",
    [
        b"(" + b"\x8f" * 200_000 + b"t",  # empty sets: the most memory per opcode byte
        b"(" + b"]" * 200_000 + b"t",  # empty lists
        b"(]" + DUP * 400_000 + b"t",  # one list, many references (DUP)
        b"]q\x00(" + b"h\x00" * 200_000 + b"e",  # memo references appended (BINGET, APPENDS)
    ],
)
def test_amplification_bombs_stay_within_a_memory_bound(bomb):
    """Memory stays linear in the file: at most 256 bytes per byte of pickle (tracemalloc)."""
    data = program(bomb)
    tracemalloc.start()
    try:
        load_dcp_metadata(data, "md")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 256 * len(data) + (4 << 20), (peak, len(data))


def test_a_huge_length_prefix_is_an_error_not_an_allocation():
    for op in (b"\x8e", b"\x96", b"\x8d"):  # BINBYTES8, BYTEARRAY8, BINUNICODE8
        data = program(op + (1 << 62).to_bytes(8, "little") + b"x", protocol=5)
        with pytest.raises(CorruptCheckpointError, match="md"):
            load_dcp_metadata(data, "md")


def test_deep_nesting_costs_no_stack():
    depth = 200_000
    data = program(b"]" * depth + b"a" * (depth - 1))
    read = load_dcp_metadata(data, "md")
    for _ in range(depth - 1):
        read = read[0]
    assert read == []


def test_every_admitted_argument_form_reads_as_pickle_does():
    """Ints, floats, bytes and text of every length form, sets, and memo indices past 255
    (LONG_BINPUT/LONG_BINGET), against pickle's own read."""
    names = [f"name{i}" for i in range(300)]
    value = {
        "ints": [0, 255, 65535, -1, 2**31 - 1, 2**70, -(2**2000)],
        "floats": (1.5, -0.0),
        "bytes": [b"", b"x" * 300],
        "text": ["", "\u00e9" * 300],
        "flags": (True, False, None),
        "sets": ({1, 2}, frozenset({3})),
        "memo": [names, names[-1]],
    }
    for protocol in (3, 4, 5):  # protocol 2 pickles bytes as a call of _codecs.encode
        data = pickle.dumps(value, protocol=protocol)
        assert load_dcp_metadata(data, "md") == pickle.loads(data) == value
