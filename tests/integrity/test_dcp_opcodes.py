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
from trainckpt.errors import CheckpointError
from trainckpt.format.safe_unpickle import load_dcp_metadata

pytestmark = pytest.mark.usefixtures("record_steps")  # C and Python steps alike (conftest)

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


def _with_planner_data(value: bytes) -> bytes:
    """A `Metadata` without tensors whose `planner_data` is what `value` (opcodes) pushes."""
    return program(
        stack_glob(DCP_MD, "Metadata")
        + EMPTY_TUPLE
        + NEWOBJ
        + b"}("
        + text("state_dict_metadata")
        + b"}"
        + text("planner_data")
        + value
        + b"u"
        + BUILD,
        protocol=4,
    )


def test_build_cannot_change_an_allowed_callable_and_records_stay_in_their_fields():
    """BUILD on a checking constructor or on a record class; a record (or record class)
    anywhere but where DCP's `Metadata` declares one; a record called with arguments: all
    refused, and DCP's record classes stay as DCP defined them."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    chunk = stack_glob(DCP_MD, "ChunkStorageMetadata")
    setting = chunk + b"N}" + text("offsets") + b"K\x01s\x86" + BUILD  # (None, {...}): setattr
    unsafe = {
        "BUILD of a callable": (glob("collections", "OrderedDict") + b"}" + BUILD, "BUILD of"),
        "BUILD of a record class": (setting, "BUILD of ChunkStorageMetadata"),
        "called": (chunk + MARK + text("p") + b"tR", "ChunkStorageMetadata called"),
    }
    for body, match in unsafe.values():
        with pytest.raises(UnsafeCheckpointError, match=match):
            load_dcp_metadata(program(body, protocol=4), "md")
    assert "offsets" not in vars(ChunkStorageMetadata)
    for value in (chunk + EMPTY_TUPLE + NEWOBJ, b"]" + chunk + b"a"):
        with pytest.raises(UnsafeCheckpointError, match="planner_data holding a value of type"):
            load_dcp_metadata(_with_planner_data(value), "md")
    for body in (chunk + EMPTY_TUPLE + NEWOBJ, b"]" + chunk + b"a"):
        with pytest.raises(UnsafeCheckpointError, match="outside DCP's Metadata"):
            load_dcp_metadata(program(body, protocol=4), "md")
    with pytest.raises(CorruptCheckpointError, match="a pickled list where DCP writes"):
        load_dcp_metadata(program(b"]", protocol=4), "md")  # plain data: not crafted, damaged


def test_what_the_record_makers_rely_on_holds_for_the_installed_torch():
    """A record maker makes a bare record with `object.__new__`, and BUILD fills it: DCP's own
    code runs only in `TensorProperties.__setstate__` (which assigns its fields) and in the
    frozen `MetadataIndex`'s refusal to set an attribute. A torch whose record classes gained
    a `__new__`, a `__setstate__`, an attribute hook or a property would change what a pickle
    reaches: this fails first."""
    from trainckpt.format.safe_unpickle.dcp_allow_list import allow_list

    for cls in allow_list().fields:
        own = {name: v for c in cls.__mro__[:-1] for name, v in vars(c).items()}
        assert cls.__new__ is object.__new__, cls
        assert ("__setstate__" in own) == (cls.__name__ == "TensorProperties"), cls
        assert "__getattr__" not in own and "__getattribute__" not in own, cls
        assert "__setattr__" not in own or cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]
        setters = [n for n, v in own.items() if hasattr(type(v), "__set__")]
        assert set(setters) <= {"__dict__", "__weakref__"}, (cls, setters)


def test_a_crafted_file_cannot_change_how_later_loads_read():
    """BUILD on a record class, its result dropped, in front of a well-formed `Metadata`:
    refused, and a good file loaded next in the same process reads as before (when record
    classes were reused between loads, this made every later load fail, so good checkpoints
    looked damaged)."""
    good = _metadata_with_storage(None)
    expected = pickle.loads(good)
    for name in ("__new__", "__init__", "__hash__", "relative_path"):
        for record in ("ChunkStorageMetadata", "MetadataIndex"):
            set_it = b"N}" + text(name) + stack_glob("torch", "Size") + b"s\x86" + BUILD
            body = stack_glob(DCP_MD, record) + set_it + POP
            body += stack_glob(DCP_MD, "Metadata") + EMPTY_TUPLE + NEWOBJ
            body += b"}(" + text("state_dict_metadata") + b"}u" + BUILD
            with pytest.raises(UnsafeCheckpointError, match=f"BUILD of {record}"):
                load_dcp_metadata(program(body, protocol=4), "md")
            assert load_dcp_metadata(good, "md") == expected


def test_loads_on_many_threads_at_once_share_nothing():
    """Good and crafted `.metadata` files loaded on several threads at once: each good one
    reads as DCP's own records, each crafted one is refused, whatever ran beside it."""
    good = _metadata_with_storage(None)
    crafted = (
        _with_planner_data(stack_glob(DCP_MD, "ChunkStorageMetadata") + EMPTY_TUPLE + NEWOBJ),
        _metadata_with_storage("../x"),
    )
    expected = pickle.loads(good)

    def rounds(seed: int) -> int:
        read = 0
        for i in range(60):
            if (i + seed) % 3:
                assert load_dcp_metadata(good, "md") == expected
                read += 1
            else:
                with pytest.raises(UnsafeCheckpointError):
                    load_dcp_metadata(crafted[i % 2], "md")
        return read

    with ThreadPoolExecutor(6) as pool:
        assert sum(pool.map(rounds, range(6))) == 6 * 40


@pytest.mark.parametrize(
    "bomb",
    [
        b"(" + b"\x8f" * 200_000 + b"t",  # empty sets: the most memory per opcode byte
        b"(" + b"]" * 200_000 + b"t",  # empty lists
        b"(]" + DUP * 400_000 + b"t",  # one list, many references (DUP)
        b"]q\x00(" + b"h\x00" * 200_000 + b"e",  # memo references appended (BINGET, APPENDS)
        b"N" + b"2\x86" * 60,  # pairs of the pair before (DUP, TUPLE2): 2**60 leaves to walk
        b"Nr" + (1 << 24).to_bytes(4, "little"),  # LONG_BINPUT far out: a memo of 2**25 slots
        b"Np16777216\n",  # PUT far out, as text
        b"\x95" + (7).to_bytes(8, "little") + b"Nr\xff\xff\xff\x00",  # in a frame (with STOP)
    ],
)
def test_amplification_bombs_stay_within_a_memory_bound(bomb):
    """Memory stays linear in the file: at most 256 bytes per byte of pickle (tracemalloc)."""
    data = program(bomb)
    load_dcp_metadata(_metadata_with_storage(None), "md")  # DCP imported before, not counted
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="md"):  # no Metadata; never a MemoryError
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
    """Neither the unpickler nor the check of `planner_data` recurses."""
    depth = 200_000
    data = _with_planner_data(b"]" * depth + b"a" * (depth - 1))
    read = load_dcp_metadata(data, "md").planner_data
    for _ in range(depth - 1):
        read = read[0]
    assert read == []


def test_every_admitted_argument_form_reads_as_pickle_does():
    """Ints, floats, bytes and text of every length form, sets, and memo indices past 255
    (LONG_BINPUT/LONG_BINGET), in a `Metadata`'s free `planner_data`, against pickle's own
    read."""
    from torch.distributed.checkpoint.metadata import Metadata

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
        data = pickle.dumps(Metadata({}, planner_data=value), protocol=protocol)
        assert load_dcp_metadata(data, "md").planner_data == pickle.loads(data).planner_data
        assert pickle.loads(data).planner_data == value


@pytest.mark.parametrize("index", [1 << 24, 1 << 25])
def test_a_memo_index_past_the_file_is_refused_before_the_unpickler_runs(index):
    """CPython's unpickler grows its memo to twice an index at once (16 bytes per index): a
    12-byte file naming memo slot 2**31 would take 32 GB and the job with it (indices of
    2**24 and 2**25 here, so that a broken check fails this test, not the machine). Refused
    unread, whatever the protocol and however the index is written; a real file's indices
    pass (every protocol: test_safe_unpickle)."""
    for data in (
        program(b"Nr" + index.to_bytes(4, "little"), protocol=2),
        program(b"Np" + str(index).encode() + b"\n", protocol=0),
        program(b"Np" + str(index).encode() + b"\n", protocol=4),
    ):
        tracemalloc.start()
        try:
            with pytest.raises(UnsafeCheckpointError, match="memo index at byte"):
                load_dcp_metadata(data, "md")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, peak
