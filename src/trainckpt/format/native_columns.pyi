# The signatures of native_columns.c (what each does is said there).
from typing import Any

def tensors(
    records: list[Any],
    table: memoryview,
    files: list[str],
    dtypes: dict[str, Any],
    entries: dict[str, Any],
    lazy: int,
    max_ndim: int,
    classes: tuple[type, type, type, type, type],
    /,
) -> tuple[dict[str, Any], dict[str, Any], list[str], list[int], list[int]] | None: ...
def byte_values(
    records: list[Any], files: list[str], entries: dict[str, Any], info_cls: type, /
) -> tuple[dict[str, Any], list[int]] | None: ...
