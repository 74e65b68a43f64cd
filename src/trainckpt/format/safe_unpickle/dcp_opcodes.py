"""The opcodes of DCP's `.metadata` pickles: a dispatch table, as CPython's own `Unpickler`
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
from typing import Any

from trainckpt.format.safe_unpickle.dcp_machine import (
    Handler,
    Machine,
    Malformed,
    call_checked,
    container,
    lookup,
    pop_mark,
    take,
    text,
)
from trainckpt.format.safe_unpickle.refusal import Refused, short

_U16 = struct.Struct("<H").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_F64 = struct.Struct(">d").unpack_from


# -- framing ------------------------------------------------------------------------------------


def _proto(m: Machine) -> None:
    if take(m, 1)[0] > 5:
        raise Malformed("unsupported pickle protocol")


def _frame(m: Machine) -> None:
    take(m, 8)  # a buffering hint; the whole pickle is in memory


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
    m.stack.append(_I32(take(m, 4))[0])


def _binint1(m: Machine) -> None:
    m.stack.append(m.data[m.pos])
    m.pos += 1


def _binint2(m: Machine) -> None:
    m.stack.append(_U16(m.data, m.pos)[0])
    m.pos += 2


def _long1(m: Machine) -> None:
    m.stack.append(int.from_bytes(take(m, take(m, 1)[0]), "little", signed=True))


def _long4(m: Machine) -> None:
    n = _I32(take(m, 4))[0]
    m.stack.append(int.from_bytes(take(m, n), "little", signed=True))


def _binfloat(m: Machine) -> None:
    m.stack.append(_F64(take(m, 8))[0])


def _short_binunicode(m: Machine) -> None:
    data, pos = m.data, m.pos
    n = data[pos]
    m.stack.append(text(data[pos + 1 : pos + 1 + n]))
    m.pos = pos + 1 + n


def _binunicode(m: Machine) -> None:
    m.stack.append(text(take(m, _U32(take(m, 4))[0])))


def _binunicode8(m: Machine) -> None:
    m.stack.append(text(take(m, _U64(take(m, 8))[0])))


def _short_binbytes(m: Machine) -> None:
    m.stack.append(take(m, take(m, 1)[0]))


def _binbytes(m: Machine) -> None:
    m.stack.append(take(m, _U32(take(m, 4))[0]))


def _binbytes8(m: Machine) -> None:
    m.stack.append(take(m, _U64(take(m, 8))[0]))


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
    m.stack.append(tuple(pop_mark(m)))


def _empty_list(m: Machine) -> None:
    m.stack.append([])


def _append(m: Machine) -> None:
    item = m.stack.pop()
    container(m, list).append(item)


def _appends(m: Machine) -> None:
    items = pop_mark(m)
    container(m, list).extend(items)


def _empty_dict(m: Machine) -> None:
    m.stack.append({})


def _setitem(m: Machine) -> None:
    value, key = m.stack.pop(), m.stack.pop()
    container(m, dict)[key] = value


def _setitems(m: Machine) -> None:
    items = pop_mark(m)
    target = container(m, dict)
    if len(items) % 2:
        raise Malformed("SETITEMS with a key and no value")
    for i in range(0, len(items), 2):
        target[items[i]] = items[i + 1]


def _empty_set(m: Machine) -> None:
    m.stack.append(set())


def _additems(m: Machine) -> None:
    items = pop_mark(m)
    container(m, set).update(items)


def _frozenset(m: Machine) -> None:
    m.stack.append(frozenset(pop_mark(m)))


# -- stack and memo -------------------------------------------------------------------------------


def _mark(m: Machine) -> None:
    m.marks.append(len(m.stack))


def _pop(m: Machine) -> None:
    if m.marks and m.marks[-1] == len(m.stack):
        m.marks.pop()
    else:
        m.stack.pop()


def _pop_mark_op(m: Machine) -> None:
    pop_mark(m)


def _memoize(m: Machine) -> None:
    memo = m.memo
    memo[len(memo)] = m.stack[-1]


def _binput(m: Machine) -> None:
    m.memo[m.data[m.pos]] = m.stack[-1]
    m.pos += 1


def _long_binput(m: Machine) -> None:
    m.memo[_U32(m.data, m.pos)[0]] = m.stack[-1]
    m.pos += 4


def _binget(m: Machine) -> None:
    m.stack.append(m.memo[m.data[m.pos]])
    m.pos += 1


def _long_binget(m: Machine) -> None:
    m.stack.append(m.memo[_U32(m.data, m.pos)[0]])
    m.pos += 4


# -- globals and objects: only the table's ----------------------------------------------------


def _global(m: Machine) -> None:
    module = _line(m)
    name = _line(m)
    m.stack.append(lookup(m, module, name))


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
    m.stack.append(lookup(m, module, name))


def _reduce(m: Machine) -> None:
    args = m.stack.pop()
    func = m.stack[-1]
    if id(func) not in m.globals.constructors or type(args) is not tuple:
        raise Refused(f"REDUCE of {short(func)}: only the table's constructors")
    m.stack[-1] = call_checked(func, args)


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
    call_checked(record.build, (inst, state))


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
_NOT_WRITTEN = "a protocol 0/1 form, or one pickle.dumps never writes for DCP's records"

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
"""Every opcode the interpreter refuses, with why. Besides the ones that reach code or data
outside the pickle, these are forms a real `.metadata` never holds: refusing them keeps the
interpreter small."""

_NAMES = {op.code.encode("latin-1"): op.name for op in pickletools.opcodes}


def _refuser(code: bytes) -> Handler:
    name, why = _NAMES[code], REFUSED[code]

    def refuse(m: Machine) -> None:
        raise Refused(f"opcode {name} at byte {m.pos - 1} ({why})")

    return refuse


def _not_an_opcode(m: Machine) -> None:
    byte = m.data[m.pos - 1 : m.pos]
    raise Refused(f"byte {byte!r} at {m.pos - 1}: not a data opcode (no pickle opcode at all)")


DISPATCH: list[Handler] = [_not_an_opcode] * 256
"""Handler of each byte value: the admitted opcode's function, a refusal by name, or a refusal
of a byte that is no opcode."""
for _code, _handler in HANDLED.items():
    DISPATCH[_code[0]] = _handler
for _code in REFUSED:
    DISPATCH[_code[0]] = _refuser(_code)
