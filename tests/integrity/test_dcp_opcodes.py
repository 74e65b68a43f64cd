"""The `.metadata` interpreter's opcode table is total: every pickle opcode is either run by its
own function or refused by name, and every byte that is no opcode is refused; a crafted pickle
of each refused class runs nothing through the public loader."""

from __future__ import annotations

import copyreg
import os
import pickle
import pickletools
from pathlib import Path

import pytest
from support.hostile import MARK, POP, call, ext1, glob, inst, program, text

from trainckpt import UnsafeCheckpointError
from trainckpt.format.safe_unpickle import load_dcp_metadata
from trainckpt.format.safe_unpickle.dcp_opcodes import DISPATCH, HANDLED, REFUSED

OPCODES = {op.code.encode("latin-1"): op.name for op in pickletools.opcodes}


def test_every_opcode_is_handled_or_refused_by_name():
    assert not HANDLED.keys() & REFUSED.keys()
    assert HANDLED.keys() | REFUSED.keys() == OPCODES.keys()
    for code, name in OPCODES.items():
        if code in HANDLED:
            assert DISPATCH[code[0]] is HANDLED[code]
            continue
        # The refused opcode first, with enough bytes after it for any argument it reads.
        with pytest.raises(UnsafeCheckpointError, match=rf"opcode {name} at byte 2 \("):
            load_dcp_metadata(b"\x80\x02" + code + b"0\n" * 8 + b".", "md")


def test_a_byte_that_is_no_opcode_is_refused():
    for byte in sorted(set(range(256)) - {code[0] for code in OPCODES}):
        with pytest.raises(UnsafeCheckpointError, match="no pickle opcode"):
            load_dcp_metadata(b"\x80\x02" + bytes([byte]) + b".", "md")


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


@pytest.mark.parametrize("kind", ["calls code: INST", "calls code: EXT1", "out of band", "text"])
def test_crafted_pickle_of_each_refused_class_runs_nothing(kind, tmp_path, extension_code):
    """Each payload makes `marker` when pickle itself loads it (checked first); through the
    loader it is refused at its refused opcode and makes nothing."""
    marker = tmp_path / "ran"
    m = text(str(marker))
    payloads = {
        "calls code: INST": (program(MARK + m + inst("os", "mkdir")), "INST"),
        "calls code: EXT1": (program(ext1(extension_code) + MARK + m + b"tR"), "EXT1"),
        "out of band": (program(b"\x97" + POP + _mkdir(marker), protocol=5), "NEXT_BUFFER"),
        "text": (program(b"S'x'\n" + POP + _mkdir(marker)), "STRING"),
    }
    data, opcode = payloads[kind]

    pickle.loads(data, buffers=[b"buffer"])  # the payload is live
    assert marker.is_dir()
    os.rmdir(marker)

    with pytest.raises(UnsafeCheckpointError, match=rf"md: .*opcode {opcode} at byte") as info:
        load_dcp_metadata(data, "md")
    assert "nothing from it was run" in str(info.value)
    assert not marker.exists()


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
