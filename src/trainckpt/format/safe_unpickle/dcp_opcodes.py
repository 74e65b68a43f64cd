"""The interpreter of DCP's `.metadata` pickles: a dispatch table, as CPython's own `Unpickler`
has, of one small function per admitted opcode, and an explicit table of the opcodes it refuses.

It admits the data opcodes of protocols 2 to 5 that `pickle.dumps` writes. Globals come only
from the exact table of `dcp_globals`; REDUCE calls only that table's checking constructors;
NEWOBJ and BUILD build only DCP's record dataclasses; items are added only to plain lists,
dicts and sets. Every other opcode is refused by name (`REFUSED`), every byte that is no opcode
at all as such: nothing falls through.
"""

from __future__ import annotations

import pickle
import pickletools
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from trainckpt.format.safe_unpickle.dcp_globals import DcpGlobals, Record
from trainckpt.format.safe_unpickle.refusal import Refused, short


class Malformed(Exception):
    """The pickle is not a well-formed program (truncated, stack or memo misuse)."""


class Machine:
    """One run: the pickle's bytes and read position, its stack, marks and memo, and the
    records built so far (checked complete at STOP)."""

    __slots__ = ("data", "pos", "stack", "marks", "memo", "built", "globals")

    def __init__(self, data: bytes, admitted: DcpGlobals) -> None:
        self.data = data
        self.pos = 0
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.built: list[tuple[Record, Any]] = []
        self.globals = admitted


Handler = Callable[[Machine], "tuple[Any] | None"]
"""An opcode's function: reads its argument at `m.pos`, works the stack; returns None, or (for
STOP) a 1-tuple of the result."""

_unpack = struct.unpack_from


def _take(m: Machine, n: int) -> bytes:
    """The next `n` bytes of the program."""
    pos = m.pos
    if n < 0 or pos + n > len(m.data):
        raise Malformed("truncated")
    m.pos = pos + n
    return m.data[pos : pos + n]


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogatepass")


def _pop_mark(m: Machine) -> list[Any]:
    """The items above the newest MARK, taken off the stack."""
    start = m.marks.pop()
    items = m.stack[start:]
    del m.stack[start:]
    return items


def _target(m: Machine, kind: type) -> Any:
    """The container on top of the stack, if it is exactly `kind` (or an OrderedDict for a
    dict): items are never added to a record or anything else with its own methods."""
    target = m.stack[-1]
    if type(target) is not kind and not (kind is dict and type(target) is OrderedDict):
        raise Refused(f"adding items to {short(type(target))}")
    return target


def _lookup(m: Machine, module: Any, name: Any) -> Any:
    """The global (module, name) if the table has exactly it: no dotted-name walk, no import."""
    if type(module) is not str or type(name) is not str:
        raise Refused("a global named by something other than two names")
    try:
        return m.globals.by_name[(module, name)]
    except KeyError:
        raise Refused(
            f"global {short(f'{module}.{name}')} (not one of DCP's records, "
            "torch sizes/dtypes/layouts/devices or plain containers)"
        ) from None


def _call(func: Any, args: tuple[Any, ...]) -> Any:
    """A checking constructor or record build; any failure inside it is a refusal."""
    try:
        return func(*args)
    except Refused:
        raise
    except Exception as e:
        raise Refused(f"{getattr(func, '__qualname__', func)} refused its arguments: {e}") from e


# -- framing ------------------------------------------------------------------------------------


def _proto(m: Machine) -> None:
    if _take(m, 1)[0] > 5:
        raise Malformed("unsupported pickle protocol")


def _frame(m: Machine) -> None:
    _take(m, 8)  # a buffering hint; the whole pickle is in memory


def _stop(m: Machine) -> tuple[Any]:
    if len(m.stack) != 1 or m.marks:
        raise Malformed("STOP with a stack that is not one value")
    for record, inst in m.built:
        record.complete(inst)
    return (m.stack[0],)


# -- scalars --------------------------------------------------------------------------------------


def _none(m: Machine) -> None:
    m.stack.append(None)


def _newtrue(m: Machine) -> None:
    m.stack.append(True)


def _newfalse(m: Machine) -> None:
    m.stack.append(False)


def _binint(m: Machine) -> None:
    m.stack.append(_unpack("<i", _take(m, 4))[0])


def _binint1(m: Machine) -> None:
    m.stack.append(m.data[m.pos])
    m.pos += 1


def _binint2(m: Machine) -> None:
    m.stack.append(_unpack("<H", m.data, m.pos)[0])
    m.pos += 2


def _long1(m: Machine) -> None:
    m.stack.append(int.from_bytes(_take(m, _take(m, 1)[0]), "little", signed=True))


def _long4(m: Machine) -> None:
    n = _unpack("<i", _take(m, 4))[0]
    m.stack.append(int.from_bytes(_take(m, n), "little", signed=True))


def _binfloat(m: Machine) -> None:
    m.stack.append(_unpack(">d", _take(m, 8))[0])


def _short_binunicode(m: Machine) -> None:
    data, pos = m.data, m.pos
    n = data[pos]
    m.stack.append(_text(data[pos + 1 : pos + 1 + n]))
    m.pos = pos + 1 + n


def _binunicode(m: Machine) -> None:
    m.stack.append(_text(_take(m, _unpack("<I", _take(m, 4))[0])))


def _binunicode8(m: Machine) -> None:
    m.stack.append(_text(_take(m, _unpack("<Q", _take(m, 8))[0])))


def _short_binbytes(m: Machine) -> None:
    m.stack.append(_take(m, _take(m, 1)[0]))


def _binbytes(m: Machine) -> None:
    m.stack.append(_take(m, _unpack("<I", _take(m, 4))[0]))


def _binbytes8(m: Machine) -> None:
    m.stack.append(_take(m, _unpack("<Q", _take(m, 8))[0]))


# -- containers -----------------------------------------------------------------------------------


def _empty_tuple(m: Machine) -> None:
    m.stack.append(())


def _tuple1(m: Machine) -> None:
    m.stack[-1] = (m.stack[-1],)


def _tuple2(m: Machine) -> None:
    stack = m.stack
    stack[-2:] = [(stack[-2], stack[-1])]


def _tuple3(m: Machine) -> None:
    stack = m.stack
    stack[-3:] = [(stack[-3], stack[-2], stack[-1])]


def _tuple(m: Machine) -> None:
    m.stack.append(tuple(_pop_mark(m)))


def _empty_list(m: Machine) -> None:
    m.stack.append([])


def _append(m: Machine) -> None:
    item = m.stack.pop()
    _target(m, list).append(item)


def _appends(m: Machine) -> None:
    items = _pop_mark(m)
    _target(m, list).extend(items)


def _empty_dict(m: Machine) -> None:
    m.stack.append({})


def _setitem(m: Machine) -> None:
    value, key = m.stack.pop(), m.stack.pop()
    _target(m, dict)[key] = value


def _setitems(m: Machine) -> None:
    items = _pop_mark(m)
    target = _target(m, dict)
    if len(items) % 2:
        raise Malformed("SETITEMS with a key and no value")
    for i in range(0, len(items), 2):
        target[items[i]] = items[i + 1]


def _empty_set(m: Machine) -> None:
    m.stack.append(set())


def _additems(m: Machine) -> None:
    items = _pop_mark(m)
    _target(m, set).update(items)


def _frozenset(m: Machine) -> None:
    m.stack.append(frozenset(_pop_mark(m)))


# -- stack and memo -------------------------------------------------------------------------------


def _mark(m: Machine) -> None:
    m.marks.append(len(m.stack))


def _pop(m: Machine) -> None:
    if m.marks and m.marks[-1] == len(m.stack):
        m.marks.pop()
    else:
        m.stack.pop()


def _pop_mark_op(m: Machine) -> None:
    _pop_mark(m)


def _memoize(m: Machine) -> None:
    memo = m.memo
    memo[len(memo)] = m.stack[-1]


def _binput(m: Machine) -> None:
    m.memo[m.data[m.pos]] = m.stack[-1]
    m.pos += 1


def _long_binput(m: Machine) -> None:
    m.memo[_unpack("<I", m.data, m.pos)[0]] = m.stack[-1]
    m.pos += 4


def _binget(m: Machine) -> None:
    m.stack.append(m.memo[m.data[m.pos]])
    m.pos += 1


def _long_binget(m: Machine) -> None:
    m.stack.append(m.memo[_unpack("<I", m.data, m.pos)[0]])
    m.pos += 4


# -- globals and objects: only the table's ----------------------------------------------------


def _global(m: Machine) -> None:
    module = _line(m)
    name = _line(m)
    m.stack.append(_lookup(m, module, name))


def _line(m: Machine) -> str:
    """GLOBAL's next newline-ended argument (a name: at most 256 bytes)."""
    data, pos = m.data, m.pos
    end = data.find(b"\n", pos, pos + 256)
    if end < 0:
        raise Malformed("GLOBAL without its name")
    m.pos = end + 1
    return data[pos:end].decode()


def _stack_global(m: Machine) -> None:
    name, module = m.stack.pop(), m.stack.pop()
    m.stack.append(_lookup(m, module, name))


def _reduce(m: Machine) -> None:
    args = m.stack.pop()
    func = m.stack[-1]
    if id(func) not in m.globals.constructors or type(args) is not tuple:
        raise Refused(f"REDUCE of {short(func)}: only the table's constructors")
    m.stack[-1] = _call(func, args)


def _newobj(m: Machine) -> None:
    args = m.stack.pop()
    cls = m.stack[-1]
    record = m.globals.records.get(id(cls))
    if record is None or record.cls is not cls or args != ():
        raise Refused(f"NEWOBJ of {short(cls)}{short(args)}: only DCP's records")
    inst: Any = object.__new__(cls)
    m.built.append((record, inst))
    m.stack[-1] = inst


def _build(m: Machine) -> None:
    state = m.stack.pop()
    inst = m.stack[-1]
    record = m.globals.records.get(id(type(inst)))
    if record is None:
        raise Refused(f"BUILD of {short(type(inst))}: only DCP's records")
    _call(record.build, (inst, state))


HANDLED: dict[bytes, Handler] = {
    pickle.PROTO: _proto,
    pickle.FRAME: _frame,
    pickle.STOP: _stop,
    pickle.NONE: _none,
    pickle.NEWTRUE: _newtrue,
    pickle.NEWFALSE: _newfalse,
    pickle.BININT: _binint,
    pickle.BININT1: _binint1,
    pickle.BININT2: _binint2,
    pickle.LONG1: _long1,
    pickle.LONG4: _long4,
    pickle.BINFLOAT: _binfloat,
    pickle.SHORT_BINUNICODE: _short_binunicode,
    pickle.BINUNICODE: _binunicode,
    pickle.BINUNICODE8: _binunicode8,
    pickle.SHORT_BINBYTES: _short_binbytes,
    pickle.BINBYTES: _binbytes,
    pickle.BINBYTES8: _binbytes8,
    pickle.EMPTY_TUPLE: _empty_tuple,
    pickle.TUPLE1: _tuple1,
    pickle.TUPLE2: _tuple2,
    pickle.TUPLE3: _tuple3,
    pickle.TUPLE: _tuple,
    pickle.EMPTY_LIST: _empty_list,
    pickle.APPEND: _append,
    pickle.APPENDS: _appends,
    pickle.EMPTY_DICT: _empty_dict,
    pickle.SETITEM: _setitem,
    pickle.SETITEMS: _setitems,
    pickle.EMPTY_SET: _empty_set,
    pickle.ADDITEMS: _additems,
    pickle.FROZENSET: _frozenset,
    pickle.MARK: _mark,
    pickle.POP: _pop,
    pickle.POP_MARK: _pop_mark_op,
    pickle.MEMOIZE: _memoize,
    pickle.BINPUT: _binput,
    pickle.LONG_BINPUT: _long_binput,
    pickle.BINGET: _binget,
    pickle.LONG_BINGET: _long_binget,
    pickle.GLOBAL: _global,
    pickle.STACK_GLOBAL: _stack_global,
    pickle.REDUCE: _reduce,
    pickle.NEWOBJ: _newobj,
    pickle.BUILD: _build,
}
"""Every opcode the interpreter runs, with its function."""

_CALLS_CODE = "it calls, imports or looks up code outside the table"
_OUT_OF_BAND = "its data lies outside the pickle (out-of-band buffers)"
_NOT_WRITTEN = "pickle.dumps of protocol 2 to 5 does not write it for DCP's records"

REFUSED: dict[bytes, str] = {
    pickle.PERSID: _CALLS_CODE,
    pickle.BINPERSID: _CALLS_CODE,
    pickle.EXT1: _CALLS_CODE,
    pickle.EXT2: _CALLS_CODE,
    pickle.EXT4: _CALLS_CODE,
    pickle.INST: _CALLS_CODE,
    pickle.OBJ: _CALLS_CODE,
    pickle.NEWOBJ_EX: _CALLS_CODE,
    pickle.NEXT_BUFFER: _OUT_OF_BAND,
    pickle.READONLY_BUFFER: _OUT_OF_BAND,
    pickle.BYTEARRAY8: _NOT_WRITTEN,
    pickle.INT: _NOT_WRITTEN,
    pickle.LONG: _NOT_WRITTEN,
    pickle.FLOAT: _NOT_WRITTEN,
    pickle.STRING: _NOT_WRITTEN,
    pickle.BINSTRING: _NOT_WRITTEN,
    pickle.SHORT_BINSTRING: _NOT_WRITTEN,
    pickle.UNICODE: _NOT_WRITTEN,
    pickle.LIST: _NOT_WRITTEN,
    pickle.DICT: _NOT_WRITTEN,
    pickle.DUP: _NOT_WRITTEN,
    pickle.GET: _NOT_WRITTEN,
    pickle.PUT: _NOT_WRITTEN,
}
"""Every opcode the interpreter refuses, with why (the text protocols 0/1 and the rest that
`pickle.dumps` writes for DCP's records never appear in a real `.metadata`)."""

_NAMES = {op.code.encode("latin-1"): op.name for op in pickletools.opcodes}


def _refuser(code: bytes) -> Handler:
    name, why = _NAMES[code], REFUSED[code]

    def refuse(m: Machine) -> None:
        raise Refused(f"opcode {name} at byte {m.pos - 1} ({why})")

    return refuse


def _not_an_opcode(m: Machine) -> None:
    raise Refused(f"byte {m.data[m.pos - 1 : m.pos]!r} at {m.pos - 1}, which is no pickle opcode")


DISPATCH: list[Handler] = [_not_an_opcode] * 256
"""Handler of each byte value: the admitted opcode's function, a refusal by name, or a refusal
of a byte that is no opcode."""
for _code, _handler in HANDLED.items():
    DISPATCH[_code[0]] = _handler
for _code in REFUSED:
    DISPATCH[_code[0]] = _refuser(_code)


def run(data: bytes, admitted: DcpGlobals) -> Any:
    """The object the pickle program in `data` builds. Raises `Refused` for anything the
    tables do not admit and `Malformed` (or the IndexError/KeyError of a stack or memo misuse)
    for a broken program."""
    m = Machine(data, admitted)
    dispatch = DISPATCH
    try:
        while True:
            op = data[m.pos]
            m.pos += 1
            done = dispatch[op](m)
            if done is not None:
                return done[0]
    except IndexError:
        if m.pos >= len(data):
            raise Malformed("truncated") from None
        raise
