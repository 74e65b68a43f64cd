"""The finders' cost on a bucket, counted in real HTTP requests to fake-gcs-server.

The counter wraps the SDK client's HTTP session (every request still goes to the server).
Bound: a constant number of list requests, plus at most one metadata request per candidate
the answer needs; `latest_checkpoint` probes from the newest step down and stops at the first
committed one.
"""

from __future__ import annotations

import urllib.parse
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainckpt import Checkpointer
from trainckpt.storage import resolve
from trainckpt.storage.gcs import GCSStorage

COMMITTED = 50
UNCOMMITTED_NEWEST = 3  # crashed saves newer than every committed checkpoint


class RequestCounter:
    """Counts the requests an SDK client sends, by kind: `list`, `object` (metadata or media of
    one object), `bucket-check`, `other`.

    `bucket-check` is the SDK's own background probe (`GET /b/BUCKET?fields=name`) that its
    bucket metadata cache fires after a download answered 404 (a missing commit record): it
    runs on an SDK thread, never in the finder's path, so it is counted apart."""

    def __init__(self) -> None:
        self.kinds: Counter[str] = Counter()
        self.log: list[str] = []

    def classify(self, method: str, url: str) -> str:
        parts = urllib.parse.urlsplit(url)
        path = parts.path
        if method == "GET" and path.endswith("/o"):
            return "list"
        if (
            method == "GET"
            and path.rstrip("/").split("/")[-2] == "b"
            and "fields=name" in parts.query
        ):
            return "bucket-check"
        if "/o/" in path:
            return "object"
        return "other"

    def wrap(self, session: object, monkeypatch: pytest.MonkeyPatch) -> None:
        real = session.request  # type: ignore[attr-defined]

        def counting(method: str, url: str, *args: object, **kwargs: object) -> object:
            self.kinds[self.classify(method, url)] += 1
            self.log.append(f"{method} {url}")
            return real(method, url, *args, **kwargs)

        monkeypatch.setattr(session, "request", counting)

    def reset(self) -> None:
        self.kinds.clear()
        self.log.clear()


@pytest.fixture
def run_folder(gcs_bucket: str, tmp_path: Path) -> str:
    """50 committed checkpoints (every 4th ephemeral) and 3 newer uncommitted ones."""
    storage, run = resolve(f"{gcs_bucket}/run")
    src = tmp_path / "f"
    src.write_bytes(b"shard")
    pairs: list[tuple[Path, str]] = []
    for i in range(1, COMMITTED + UNCOMMITTED_NEWEST + 1):
        step = storage.join(run, f"step{i * 100}")
        pairs.append((src, storage.join(step, "model_and_optim/__0_0.distcp")))
        if i <= COMMITTED:
            ephemeral = "true" if i % 4 == 0 else "false"
            record = tmp_path / f"record-{ephemeral}"
            record.write_text(f'{{"ephemeral": {ephemeral}, "version": "t"}}')
            pairs.append((record, storage.join(step, ".metadata.json")))
    storage.upload_many(pairs)
    return run


@pytest.fixture
def counter(run_folder: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[RequestCounter]:
    storage, _ = resolve(run_folder)  # the instance the classmethods use
    assert isinstance(storage, GCSStorage)
    c = RequestCounter()
    c.wrap(storage.client._http, monkeypatch)
    yield c


def test_latest_checkpoint_lists_once_and_probes_from_the_newest(run_folder, counter):
    latest = Checkpointer.latest_checkpoint(run_folder)
    assert latest == f"{run_folder}/step{COMMITTED * 100}"
    assert counter.kinds["list"] == 1, counter.log
    # the three uncommitted newest folders, then the newest committed one: no more
    assert counter.kinds["object"] == UNCOMMITTED_NEWEST + 1, counter.log
    assert counter.kinds["other"] == 0, counter.log


def test_find_checkpoints_costs_one_request_per_folder(run_folder, counter):
    found = list(Checkpointer.find_checkpoints(run_folder))
    assert [s for s, _ in found] == [i * 100 for i in range(1, COMMITTED + 1)]
    assert counter.kinds["list"] == 1
    assert counter.kinds["object"] == COMMITTED + UNCOMMITTED_NEWEST

    counter.reset()
    ephemeral = [s for s, _ in Checkpointer.find_checkpoints(run_folder, ephemeral=True)]
    assert ephemeral == [i * 100 for i in range(4, COMMITTED + 1, 4)]
    assert counter.kinds["list"] == 1
    assert counter.kinds["object"] == COMMITTED + UNCOMMITTED_NEWEST, "one read per folder"


def test_contains_checkpoint_stops_at_the_first_hit(run_folder, counter):
    assert Checkpointer.contains_checkpoint(run_folder)
    # dir_is_checkpoint of the folder itself (2 probes), then latest_checkpoint's 1 + 4
    assert counter.kinds["list"] == 1
    assert counter.kinds["object"] == 2 + UNCOMMITTED_NEWEST + 1
