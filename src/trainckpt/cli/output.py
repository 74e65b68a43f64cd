"""What the `trainckpt` command prints: tables, human-readable sizes and ages, progress bars.

Kept apart from `cli.py` (what each subcommand does) so either can change alone.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm import tqdm


class ProgressBar:
    """A `format.verify.Progress` (a byte-count callback) driving a tqdm bar on stderr. The bar
    appears at `set_total` (or the first update), so it starts with its total when known."""

    def __init__(self, desc: str) -> None:
        self.desc = desc
        self.bar: tqdm | None = None

    def set_total(self, total: int | None) -> None:
        if self.bar is None:
            from tqdm import tqdm  # only when a bar is shown

            self.bar = tqdm(
                desc=self.desc,
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
            )

    def __call__(self, nbytes: int) -> None:
        self.set_total(None)
        assert self.bar is not None
        self.bar.update(nbytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def progress_bar(desc: str, wanted: bool | None) -> Iterator[ProgressBar | None]:
    """A bar on stderr when `wanted`, or, with None, when stderr is a terminal."""
    if wanted is False or (wanted is None and not sys.stderr.isatty()):
        yield None
        return
    progress = ProgressBar(desc)
    try:
        yield progress
    finally:
        progress.close()


def human_size(n: int) -> str:
    """Bytes in binary units: `512 B`, `9.1 MiB`."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def human_age(seconds: float | None) -> str:
    """`45s`, `12m`, `5h`, `3d`; `-` when unknown."""
    if seconds is None:
        return "-"
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if seconds < limit:
            return f"{int(seconds // div)}{unit}"
    return f"{int(seconds // 86400)}d"


def table(header: list[str], rows: list[list[str]], *, right: set[str], indent: str = "") -> str:
    """Columns padded to their widest cell; columns named in `right` right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        cells = [
            c.rjust(w) if h in right else c.ljust(w)
            for c, w, h in zip(row, widths, header, strict=True)
        ]
        return (indent + "  ".join(cells)).rstrip()

    return "\n".join(fmt(r) for r in [header, *rows])


def age_seconds(created_at: str | None, now: _dt.datetime | None = None) -> float | None:
    """Seconds since an ISO-8601 timestamp, or None when there is none or it cannot be parsed."""
    if not created_at:
        return None
    try:
        then = _dt.datetime.fromisoformat(created_at)
    except ValueError:
        return None
    if then.tzinfo is None:
        then = then.replace(tzinfo=_dt.timezone.utc)
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return max(0.0, (now - then).total_seconds())
