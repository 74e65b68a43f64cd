"""Building blocks of hostile pickles: hand-assembled opcode programs (any opcode, any global
name, dotted or not) and objects whose pickles call a chosen function. Each payload here would
run `touch <marker>` if anything unpickled it unsafely; the tests prove that first."""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable
from typing import Any

import torch

# -- opcodes (protocol 0-5), as bytes ------------------------------------------------------------
MARK, STOP, POP, TUPLE, TUPLE1, TUPLE2 = b"(", b".", b"0", b"t", b"\x85", b"\x86"
EMPTY_DICT, EMPTY_TUPLE, EMPTY_LIST, SETITEMS, APPEND = b"}", b")", b"]", b"u", b"a"
REDUCE, BUILD, NEWOBJ, NEWOBJ_EX, OBJ, NONE = b"R", b"b", b"\x81", b"\x92", b"o", b"N"
STACK_GLOBAL, MEMOIZE, BINPERSID = b"\x93", b"\x94", b"Q"


def proto(n: int) -> bytes:
    return b"\x80" + bytes([n])


def text(s: str) -> bytes:
    """BINUNICODE: a str on the stack."""
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def glob(module: str, name: str) -> bytes:
    """GLOBAL (protocol 0-3): `module` and `name` exactly as given, dots and all."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def stack_glob(module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4+)."""
    return text(module) + text(name) + STACK_GLOBAL


def inst(module: str, name: str) -> bytes:
    """INST (protocol 0): MARK args INST module name."""
    return b"i" + module.encode() + b"\n" + name.encode() + b"\n"


def ext1(code: int) -> bytes:
    return b"\x82" + bytes([code])


def ext2(code: int) -> bytes:
    return b"\x83" + struct.pack("<H", code)


def ext4(code: int) -> bytes:
    return b"\x84" + struct.pack("<i", code)


def call(func: bytes, *args: bytes) -> bytes:
    """`func(*args)` by REDUCE; `func` and each arg are opcode programs that push one value."""
    return func + MARK + b"".join(args) + TUPLE + REDUCE


def program(*parts: bytes, protocol: int = 2) -> bytes:
    return proto(protocol) + b"".join(parts) + STOP


def shell(marker: Any) -> str:
    return f"touch '{marker}'"


# -- objects that pickle as a call of a real function --------------------------------------------


class Calls:
    """Pickles as `func(*args)` (then `BUILD state` if given), `func` by its real name."""

    def __init__(self, func: Callable[..., Any], *args: Any, state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> tuple[Any, ...]:
        if self.state is None:
            return (self.func, self.args)
        return (self.func, self.args, self.state)


# -- torch.save files with a chosen data.pkl -----------------------------------------------------


def torch_save_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def torch_file_with_pickle(data_pkl: bytes, base: bytes | None = None) -> bytes:
    """A `torch.save` zip (valid CRCs, every other record genuine, from `base` or a small
    state) whose `data.pkl` is `data_pkl`: how an attacker gets any pickle program past the
    container check."""
    source = zipfile.ZipFile(io.BytesIO(base or torch_save_bytes({"step": 1})))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in source.infolist():
            data = data_pkl if info.filename.endswith("/data.pkl") else source.read(info)
            z.writestr(info.filename, data)
    return out.getvalue()


def data_pkl_of(torch_file: bytes) -> bytes:
    """The pickle program inside a `torch.save` zip."""
    z = zipfile.ZipFile(io.BytesIO(torch_file))
    return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
