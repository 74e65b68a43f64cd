"""One retry policy for every remote back end, tested once for each against real servers (the
127.0.0.1 HTTP server, moto behind a fault proxy, fake-gcs-server behind a fault proxy): a
server that fails N times then answers, one that never answers well (the deadline ends it), one
that refuses the request (not retried), and the waits between attempts, which are google-api-
core's (exponential ceilings, drawn with jitter) for all three."""

from __future__ import annotations

import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from google.api_core.retry import retry_unary
from support.servers import fault_proxy

from trainckpt.errors import StorageError
from trainckpt.storage import Storage, StorageOptions, storage_for
from trainckpt.storage.retry import INITIAL_DELAY, MAXIMUM_DELAY, MULTIPLIER, RETRY_STATUS

DATA = b"0123456789" * 10
S3_CODES = {408: "RequestTimeout", 429: "TooManyRequests", 500: "InternalError", 503: "SlowDown"}


@dataclass
class Flaky:
    """One back end whose server answers reads of `location` as told."""

    location: str
    fail: Callable[[int, int], None]
    """(status, times): answer the next `times` reads of `location` with `status`."""
    reads: Callable[[], int]
    """Reads of `location` the server received so far."""

    def storage(self, deadline: float) -> Storage:
        return storage_for(self.location, StorageOptions(thread_count=2, retry_deadline=deadline))


@pytest.fixture(params=["http", "s3", "gcs"])
def flaky(request: pytest.FixtureRequest) -> Iterator[Flaky]:
    kind = request.param
    if kind == "http":
        server = request.getfixturevalue("http_server")
        folder, url = request.getfixturevalue("http_folder")
        (folder / "f.bin").write_bytes(DATA)
        path = url[len(server.url) :] + "/f.bin"

        def fail_http(status: int, times: int) -> None:
            server.failure_path = path
            server.failures[:] = [status] * times

        yield Flaky(
            f"{url}/f.bin",
            fail_http,
            lambda: sum(1 for m, p, _ in server.requests if m == "GET" and p == path),
        )
        server.failures.clear()  # the server lives for the session
        server.failure_path = None
    elif kind == "s3":
        s3_server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket").removeprefix("s3://")
        proxy = request.getfixturevalue("s3_proxy")
        key = f"{uuid.uuid4().hex}/f.bin"
        s3_server.put_many(bucket, [key], DATA)

        def fail_s3(status: int, times: int) -> None:
            code = S3_CODES.get(status, "AccessDenied" if status == 403 else "ServiceUnavailable")
            proxy.fail(lambda r: r.operation == "GetObject" and key in r.path, status, code, times)

        yield Flaky(
            f"s3://{bucket}/{key}",
            fail_s3,
            lambda: sum(1 for r in proxy.ops("GetObject") if key in r.path),
        )
    else:
        gcs_server = request.getfixturevalue("gcs_server")
        with fault_proxy(gcs_server) as gcs_proxy:
            location = f"gs://{gcs_server.create_bucket()}/f.bin"
            storage_for(location).write_bytes(location, DATA)
            yield Flaky(
                location,
                lambda status, times: gcs_proxy.fail("GET", "alt=media", status, times),
                lambda: gcs_proxy.downloads("f.bin"),
            )


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits google-api-core's retry loop takes (still taken: the deadline stays real), in
    threads started by this test only: a thread an earlier test left retrying against its own
    server (the GCS SDK's loop runs on in the background) would otherwise add its waits here."""
    taken: list[float] = []
    earlier = {t.ident for t in threading.enumerate()} - {threading.get_ident()}

    def sleep(seconds: float) -> None:
        if threading.get_ident() not in earlier:
            taken.append(seconds)
        time.sleep(seconds)

    clock: Any = types.SimpleNamespace(sleep=sleep, monotonic=time.monotonic)
    monkeypatch.setattr(retry_unary, "time", clock)
    return taken


@pytest.mark.parametrize("status", sorted(RETRY_STATUS))
def test_a_server_that_fails_then_answers_is_retried(flaky: Flaky, status: int) -> None:
    flaky.fail(status, 2)
    assert flaky.storage(deadline=30).read_bytes(flaky.location) == DATA
    assert flaky.reads() == 3


def test_the_waits_are_the_one_policys(flaky: Flaky, waits: list[float]) -> None:
    """Every back end waits through the same loop: exponential ceilings, each wait drawn below
    its ceiling (jitter), not the ceiling itself."""
    flaky.fail(503, 4)
    assert flaky.storage(deadline=60).read_bytes(flaky.location) == DATA
    assert flaky.reads() == 5
    assert len(waits) == 4, waits
    ceilings = [min(INITIAL_DELAY * MULTIPLIER**i, MAXIMUM_DELAY) for i in range(4)]
    assert all(0 <= w <= c for w, c in zip(waits, ceilings, strict=True)), (waits, ceilings)
    assert waits != ceilings


def test_a_server_that_never_answers_well_fails_at_the_deadline(flaky: Flaky) -> None:
    flaky.fail(503, 10_000)
    with pytest.raises(StorageError, match="retry_deadline=1.5s") as info:
        flaky.storage(deadline=1.5).read_bytes(flaky.location)
    assert "503" in str(info.value) and flaky.location in str(info.value)
    assert flaky.reads() >= 2, "it was not retried"


def test_a_refusal_is_not_retried(flaky: Flaky) -> None:
    flaky.fail(403, 1)
    with pytest.raises(StorageError):
        flaky.storage(deadline=30).read_bytes(flaky.location)
    assert flaky.reads() == 1
