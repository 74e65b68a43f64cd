"""A seekable reader over a remote file that fetches byte ranges on demand.

Remote back ends (GCS, HTTP) return it from `open_read`, so DCP reads only the slices of a shard
file that this rank needs instead of downloading the whole file first.
"""

from __future__ import annotations

import io
from collections.abc import Callable

Fetch = Callable[[int, int], "bytes | memoryview"]
"""Returns bytes `[start, end)` of the remote file."""


class RangeReader(io.RawIOBase):
    """Read-only, seekable view of a remote file of known `size`; each read is one range fetch.
    `on_close` releases what the fetch holds (an open connection), if anything."""

    def __init__(
        self, name: str, size: int, fetch: Fetch, on_close: Callable[[], None] | None = None
    ) -> None:
        super().__init__()
        self.name = name
        self.size = size
        self._fetch = fetch
        self._on_close = on_close
        self._pos = 0

    def close(self) -> None:
        if not self.closed and self._on_close is not None:
            self._on_close()
        super().close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position in '{self.name}'")
        self._pos = base + offset
        return self._pos

    def read_range(self, start: int, length: int) -> bytes | memoryview:
        """Exactly `length` bytes from `start` (fewer only at the end of the file)."""
        end = min(start + length, self.size)
        if end <= start:
            return b""
        data = self._fetch(start, end)
        self._pos = start + len(data)
        return data

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.read_range(self._pos, len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return bytes(self.read_range(self._pos, self.size - self._pos))
