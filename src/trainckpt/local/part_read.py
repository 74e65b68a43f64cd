"""A local-tier part as one stream of bytes (its files in `LocalPart.stream` order: the data
files in `PART_FILES` order, each piece by piece, each exactly the size its `part.json` says):
`PartReader` reads a part's files out as that stream (the source of a replica or a restore
copy), `Splitter` cuts an incoming stream back into its files."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

from trainckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from trainckpt.local.layout import LocalPart


class PartReader:
    """The files of a part as one stream, in `LocalPart.stream` order, each exactly the size
    its record says (a shorter file is an error naming it; the reader never reads past a
    size)."""

    def __init__(self, folder: Path, part: LocalPart | None) -> None:
        if part is None:
            raise CheckpointNotFoundError(f"no part record for '{folder}'")
        self._plan = [(folder / f, e.size) for _name, f, e in part.stream()]
        self._stack = ExitStack()
        self._file: Any = None
        self._left = 0

    def readinto(self, buf: memoryview) -> int:
        """Fill `buf` from the files, straight from the kernel (no copy in between)."""
        done = 0
        while done < len(buf):
            if self._left == 0:
                if self._file is not None:
                    self._file.close()
                    self._file = None
                if not self._plan:
                    break
                path, self._left = self._plan.pop(0)
                self._file = self._stack.enter_context(open(path, "rb", buffering=0))
                continue
            got = self._file.readinto(buf[done : done + min(len(buf) - done, self._left)])
            if not got:
                raise CorruptCheckpointError(f"'{self._file.name}' is shorter than its record")
            done += got
            self._left -= got
        return done

    def close(self) -> None:
        self._stack.close()


class Splitter:
    """Cuts the incoming stream of a part into its files (pieces), by the sizes in its
    record."""

    def __init__(self, part: LocalPart) -> None:
        self.part = part
        self._plan = [(f, e.size) for _name, f, e in part.stream()]
        self._index = 0
        self._left = self._plan[0][1]

    @property
    def finished(self) -> bool:
        return self._index == len(self._plan)

    def pieces(self, data: memoryview) -> list[tuple[str, memoryview, bool]]:
        """(file name on disk, bytes of it, whether that file is complete after them)."""
        out = []
        pos = 0
        while self._index < len(self._plan):
            name = self._plan[self._index][0]
            take = min(self._left, len(data) - pos)
            self._left -= take
            done = self._left == 0
            out.append((name, data[pos : pos + take], done))
            pos += take
            if not done:
                break
            self._index += 1
            if self._index < len(self._plan):
                self._left = self._plan[self._index][1]
        if pos != len(data):
            raise CorruptCheckpointError("received more bytes than the part's record lists")
        return out
