"""The state of one run of the `.metadata` interpreter, and the checks its opcode functions
share: reading the program, taking items off the stack, adding items only to plain containers,
looking globals up in the exact table, calling only checking constructors."""

from __future__ import annotations

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


def take(m: Machine, n: int) -> bytes:
    """The next `n` bytes of the program."""
    pos = m.pos
    if n < 0 or pos + n > len(m.data):
        raise Malformed("truncated")
    m.pos = pos + n
    return m.data[pos : pos + n]


def text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogatepass")


def pop_mark(m: Machine) -> list[Any]:
    """The items above the newest MARK, taken off the stack."""
    start = m.marks.pop()
    items = m.stack[start:]
    del m.stack[start:]
    return items


def container(m: Machine, kind: type) -> Any:
    """The container on top of the stack, if it is exactly `kind` (or an OrderedDict for a
    dict): items are never added to a record or anything else with its own methods."""
    target = m.stack[-1]
    if type(target) is not kind and not (kind is dict and type(target) is OrderedDict):
        raise Refused(f"adding items to {short(type(target))}")
    return target


def lookup(m: Machine, module: Any, name: Any) -> Any:
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


def call_checked(func: Any, args: tuple[Any, ...]) -> Any:
    """A checking constructor or record build; any failure inside it is a refusal."""
    try:
        return func(*args)
    except Refused:
        raise
    except Exception as e:
        raise Refused(f"{getattr(func, '__qualname__', func)} refused its arguments: {e}") from e
