"""A real S3-compatible server on 127.0.0.1 for the S3 tests: moto in server mode (one thread of
this process speaking the S3 REST API over HTTP), plus `S3Proxy`, a real HTTP proxy in front of
it that records every request and can answer chosen ones with S3 errors (503 SlowDown, 500, 403)
or hold them until several run at once.

The clients find the server the way users point them at R2 or MinIO: `AWS_ENDPOINT_URL_S3`.
Credentials are dummies, and `AWS_EC2_METADATA_DISABLED=true` keeps boto3 from probing the cloud
metadata address. Imported by `tests/conftest.py`, like `servers.py`.
"""

from __future__ import annotations

import http.client
import http.server
import logging
import os
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

_ENV = {
    "AWS_ACCESS_KEY_ID": "trainckpt-test",
    "AWS_SECRET_ACCESS_KEY": "trainckpt-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


_PUT_LOCK = threading.Lock()


def _atomic_conditional_puts() -> None:
    """Make moto's conditional `PutObject` (If-None-Match, If-Match) atomic, as S3's is: moto
    checks the condition and stores the object in two steps, so two racing create-only writes
    could both succeed on its threaded server. One lock around each PutObject closes that gap
    (only this process's server is affected; the requests still go over HTTP)."""
    from moto.s3.responses import S3Response

    put = S3Response.put_object
    if getattr(put, "_trainckpt_atomic", False):
        return

    def locked(self: Any) -> Any:
        with _PUT_LOCK:
            return put(self)

    locked._trainckpt_atomic = True  # type: ignore[attr-defined]
    S3Response.put_object = locked  # type: ignore[method-assign]


class MotoS3:
    """moto's S3 in server mode on 127.0.0.1 (a free port)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        _atomic_conditional_puts()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        self._server.stop()

    def client(self, endpoint: str | None = None) -> Any:
        """A plain boto3 client for test setup and inspection (not the library's)."""
        import boto3

        return boto3.client("s3", endpoint_url=endpoint or self.url)

    def objects(self, url: str) -> dict[str, bytes]:
        """Every object under `url` (an s3:// folder) by name relative to it, read with a plain
        boto3 client (what the server really holds, not what trainckpt reads)."""
        client = self.client()
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        out = {}
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        for page in pages:
            for obj in page.get("Contents", []):
                body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
                out[obj["Key"][len(prefix) + 1 :]] = body
        return out

    def put_many(self, bucket: str, keys: list[str], data: bytes) -> None:
        """Store many small objects straight into the server's store (it runs in this
        process): test setup of thousands of objects without thousands of HTTP requests."""
        from moto.backends import get_backend
        from moto.core import DEFAULT_ACCOUNT_ID

        backend = get_backend("s3")[DEFAULT_ACCOUNT_ID]["global"]
        for key in keys:
            backend.put_object(bucket, key, data)

    def create_bucket(self) -> str:
        name = f"trainckpt-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


def use_s3_endpoint(url: str) -> None:
    """Point boto3 (ours and cached-path's) at the S3 endpoint `url`."""
    os.environ["AWS_ENDPOINT_URL_S3"] = url
    from cached_path.schemes.s3 import _get_s3_resource_client

    _get_s3_resource_client.cache_clear()  # cached-path builds its client once per process


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3]:
    """The session's moto S3 server, with dummy credentials and the clients pointed at it."""
    empty = tmp_path_factory.mktemp("aws-config")
    env = {
        **_ENV,
        # This machine's ~/.aws files (if any) must not change what the tests do.
        "AWS_CONFIG_FILE": str(empty / "config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(empty / "credentials"),
    }
    saved = {k: os.environ.get(k) for k in [*env, "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"]}
    os.environ.update(env)
    os.environ.pop("AWS_PROFILE", None)
    server = MotoS3()
    use_s3_endpoint(server.url)
    yield server
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_server: MotoS3) -> str:
    """`s3://<fresh bucket>`: every test starts from an empty bucket."""
    use_s3_endpoint(s3_server.url)  # a test may have pointed the clients elsewhere
    return f"s3://{s3_server.create_bucket()}"


# -- a recording, fault-injecting proxy ---------------------------------------------------------


@dataclass
class Request:
    """One request the proxy received."""

    method: str
    path: str
    query: dict[str, list[str]]
    body: bytes
    copy_source: str | None = None
    """The `x-amz-copy-source` header: set on server-side copies."""

    @property
    def operation(self) -> str:
        """The S3 operation, named as in the API reference (enough of it for the tests)."""
        q, m = self.query, self.method
        if "delete" in q and m == "POST":
            return "DeleteObjects"
        if "uploads" in q:
            return "CreateMultipartUpload"
        if "uploadId" in q:
            if m == "PUT":
                return "UploadPartCopy" if self.copy_source else "UploadPart"
            return {"POST": "CompleteMultipartUpload", "DELETE": "AbortMultipartUpload"}.get(
                m, "ListParts"
            )
        if m == "GET" and ("list-type" in q or self.path.count("/") == 1):
            return "ListObjectsV2"
        if m == "PUT" and self.copy_source:
            return "CopyObject"
        return {"GET": "GetObject", "HEAD": "HeadObject", "PUT": "PutObject"}.get(m, "DeleteObject")


@dataclass
class Fault:
    """Answer the next `times` requests that `match` with `status` and S3 error `code`;
    `status=0` drops the connection without any answer instead."""

    match: Callable[[Request], bool]
    status: int
    code: str
    times: int


@dataclass
class Gate:
    """Hold requests that `match` until `count` of them are in flight at once (or `timeout`
    passes); `met` tells whether they ever were. Proves parallelism without timing anything."""

    match: Callable[[Request], bool]
    count: int
    timeout: float
    in_flight: int = 0
    met: threading.Event = field(default_factory=threading.Event)


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as boto3 expects
    server: S3Proxy

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._relay()

    def do_HEAD(self) -> None:
        self._relay()

    def do_PUT(self) -> None:
        self._relay()

    def do_POST(self) -> None:
        self._relay()

    def do_DELETE(self) -> None:
        self._relay()

    def _relay(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query, True)
        req = Request(self.command, url.path, query, body, self.headers.get("x-amz-copy-source"))
        fault = self.server.record(req)
        if fault is not None:
            self._send_error(fault)
            return
        gate = self.server.gate
        if gate is not None and gate.match(req):
            self._pass_gate(gate)
        try:
            self._forward(body)
        finally:
            if gate is not None and gate.match(req):
                with self.server.lock:
                    gate.in_flight -= 1

    def _pass_gate(self, gate: Gate) -> None:
        with self.server.lock:
            gate.in_flight += 1
            if gate.in_flight >= gate.count:
                gate.met.set()
        gate.met.wait(gate.timeout)

    def _send_error(self, fault: Fault) -> None:
        if fault.status == 0:
            self.close_connection = True  # the client sees the connection close, no answer
            return
        xml = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{fault.code}</Code>'
            f"<Message>injected by the test proxy</Message></Error>"
        ).encode()
        self.send_response(fault.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(xml)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(xml)

    def _forward(self, body: bytes) -> None:
        up = urllib.parse.urlsplit(self.server.upstream)
        conn = http.client.HTTPConnection(up.hostname or "127.0.0.1", up.port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() != "expect"}
            conn.request(self.command, self.path, body=body or None, headers=headers)
            answer = conn.getresponse()
            data = answer.read()
        finally:
            conn.close()
        self.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        # HEAD answers carry the object's length without a body.
        length = answer.getheader("Content-Length") if self.command == "HEAD" else len(data)
        self.send_header("Content-Length", str(length or 0))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class S3Proxy(http.server.ThreadingHTTPServer):
    """Relays to `upstream`, recording each request; `fail` and `gate` change what it does."""

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream = upstream
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self.gate: Gate | None = None
        self.lock = threading.Lock()

    def fail(self, match: Callable[[Request], bool], status: int, code: str, times: int) -> None:
        with self.lock:
            self.faults.append(Fault(match, status, code, times))

    def record(self, req: Request) -> Fault | None:
        """Log `req`; return the fault it triggers, if any (counting it down)."""
        with self.lock:
            self.requests.append(req)
            for fault in self.faults:
                if fault.times > 0 and fault.match(req):
                    fault.times -= 1
                    return fault
        return None

    def ops(self, name: str) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.operation == name]


@pytest.fixture
def s3_proxy(s3_server: MotoS3) -> Iterator[S3Proxy]:
    """A proxy in front of the session's server, with the clients pointed at it."""
    proxy = S3Proxy(s3_server.url)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    use_s3_endpoint(proxy.url)
    yield proxy
    use_s3_endpoint(s3_server.url)
    proxy.shutdown()  # returns at once when a test already shut it down
    proxy.server_close()
    thread.join()


def write_local(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
