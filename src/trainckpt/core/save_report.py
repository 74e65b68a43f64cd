"""What one save cost, handed to the trainer: `SaveReport`, and the timing of a rank's writes.

Every save logs a line; this is the same in figures a trainer can put on its dashboard beside
loss and throughput (`SaveReport.metrics()`). Built on the rank that saved, from its own clock:
`bytes` and `files` are this rank's part, the phases are how long this rank waited for each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from trainckpt.core.rank_write import RankFiles, WriteTarget
from trainckpt.storage.checksums import FileEntry


@dataclass(frozen=True)
class SaveReport:
    """Figures of one committed save, as seen by this rank.

    Phases, in seconds: `staging` (copy of the state to CPU memory; 0 for a blocking save),
    `writing` (this rank's files written; on object stores their uploads start as each file is
    done), `commit` (the rest until committed: remaining uploads, the ranks' agreement, manifest,
    commit record, rename). `blocked` is how long training waited; `total` from the call to the
    commit.
    """

    path: str
    blocked: float
    staging: float
    writing: float
    commit: float
    total: float
    bytes: int
    """Bytes of this rank's files (trainer state and its DCP shards)."""
    files: int
    """Number of this rank's files."""

    @property
    def throughput(self) -> float:
        """This rank's bytes per second of the whole save (call to commit)."""
        return self.bytes / self.total if self.total > 0 else 0.0

    def metrics(self, prefix: str = "checkpoint/") -> dict[str, float]:
        """The figures under stable names (documented in docs/performance.md), e.g. for
        OLMo-core's `trainer.record_metric` or torchtitan's logger."""
        return {
            f"{prefix}blocked_s": self.blocked,
            f"{prefix}staging_s": self.staging,
            f"{prefix}writing_s": self.writing,
            f"{prefix}commit_s": self.commit,
            f"{prefix}total_s": self.total,
            f"{prefix}bytes": float(self.bytes),
            f"{prefix}files": float(self.files),
            f"{prefix}throughput_mb_s": self.throughput / 1e6,
        }


class SavedPath(str):
    """The committed path a save returns (a `str`, as before), carrying its `report`."""

    report: SaveReport

    def __new__(cls, path: str, report: SaveReport) -> SavedPath:
        saved = super().__new__(cls, path)
        saved.report = report
        return saved

    def __reduce__(self) -> tuple[type[SavedPath], tuple[str, SaveReport]]:
        return SavedPath, (str(self), self.report)  # pickles (across ranks, processes) whole


@dataclass
class TimedFiles:
    """A rank's files (`RankFiles`) whose `write` is timed and whose entries are kept, so the
    save's report can say how long writing took and how many bytes it wrote."""

    inner: RankFiles
    started: float = 0.0
    finished: float = 0.0
    entries: dict[str, FileEntry] = field(default_factory=dict)

    def write(self, to: WriteTarget) -> dict[str, FileEntry]:
        """Called on: all ranks, by the commit protocol (as the files it wraps)."""
        self.started = time.perf_counter()
        self.entries = self.inner.write(to)
        self.finished = time.perf_counter()
        return self.entries

    def report(
        self, path: str, start: float, staged: float, blocked: float | None = None
    ) -> SavedPath:
        """The committed `path` with the report of a save called at `start` (perf_counter),
        staged by `staged`, that blocked training until `blocked` (None: until committed)."""
        end = time.perf_counter()
        written = self.finished or end
        return SavedPath(
            path,
            SaveReport(
                path=path,
                blocked=(end if blocked is None else blocked) - start,
                staging=staged - start,
                writing=written - (self.started or written),
                commit=end - written,
                total=end - start,
                bytes=sum(e.size for e in self.entries.values()),
                files=len(self.entries),
            ),
        )
