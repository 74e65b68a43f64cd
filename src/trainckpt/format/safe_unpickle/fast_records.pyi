# The signatures of fast_records.c (what each does is said there).
from typing import Any

class RecordBase: ...

def bind(maker: type[RecordBase], record: type, /) -> None: ...
def check_records(
    records: list[Any],
    cls: type,
    names: tuple[str, ...],
    kinds: tuple[frozenset[type] | None, ...],
    optional: tuple[bool, ...],
    keep: tuple[bool, ...],
    /,
) -> tuple[list[Any], ...] | None: ...
def by_class(values: list[Any], classes: tuple[type, ...], /) -> tuple[list[Any], ...] | None: ...
def plain(
    value: Any, budget: int, leaves: frozenset[type], containers: frozenset[type], /
) -> bool: ...
def memo_beyond(data: bytes, kinds: tuple[int, ...], limit: int, /) -> int: ...
