"""An S3 endpoint that fails on demand: a fault-injecting HTTP proxy in front
of a real S3 server (moto), shared by the storage tests (tests/storage/conftest.py's
``faulty_s3``) and the end-to-end ones (tests/worker/test_storage_brownout.py).

`FaultInjector` is the chainable failure plan; `FaultyS3` serves it on
127.0.0.1 (port 0) in front of an upstream endpoint::

    with FaultyS3(moto_url) as proxy:
        proxy.injector.fail(2, "503").rate(seed=7)
        ... point clients at proxy.url ...
"""

from __future__ import annotations

import contextlib
import http.client
import random
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Iterator
from typing import Any


class FaultInjector:
    """Chainable failure plan for the proxy: ``inj.fail(2, "503").fail(1, "reset", method="PUT")``.

    Each rule fails the next ``count`` matching requests; ``injected`` records
    what was actually done, for exact assertions. ``"truncate"`` forwards the
    request but sends only half of the answer's body (with the full
    Content-Length) and closes the connection; ``path=`` limits a rule to
    request paths containing that text. ``slow(delay_s)`` holds every
    matching request for ``delay_s`` before forwarding it (a slow store, until
    ``clear()``); with ``until=`` (an Event) it holds it until the event is
    set (at most ``delay_s``): a request kept in flight for as long as a test
    needs, whatever the machine's load.

    ``rate(seed)`` fails a random share of *every* request (after the rules,
    until ``clear()``): a brown-out. Each request draws once, from a
    generator seeded with ``seed``: ``throttle`` (503 SlowDown), ``reset``
    (before forwarding), ``reset_after`` (forwarded, the upstream answered,
    then the connection is reset instead of answering), ``truncate`` (GETs
    only).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[list[Any]] = []  # [remaining, mode, method, delay_s, path, until]
        self._rate: list[tuple[float, str]] = []  # (cumulative probability, mode)
        self._rng = random.Random(0)
        self.injected: list[tuple[str, str, str]] = []  # (mode, method, path)
        self.forwarded = 0

    def rate(self, seed: int, *, throttle: float = 0.15, reset: float = 0.05, reset_after: float = 0.05,
             truncate: float = 0.10) -> FaultInjector:
        """Fail that share of every request from now on (see the class docstring)."""
        assert throttle + reset + reset_after + truncate <= 1
        with self._lock:
            self._rng = random.Random(seed)
            self._rate, total = [], 0.0
            for mode, p in (("throttle", throttle), ("reset", reset), ("reset_after", reset_after),
                            ("truncate", truncate)):
                total += p
                self._rate.append((total, mode))
        return self

    def fail(self, count: int, mode: str, *, method: str | None = None, path: str = "") -> FaultInjector:
        assert mode in ("503", "reset", "reset_after", "throttle", "truncate")
        with self._lock:
            self._rules.append([count, mode, method, 0.0, path, None])
        return self

    def slow(self, delay_s: float, *, method: str | None = None, count: int = 10**9, path: str = "",
             until: threading.Event | None = None) -> FaultInjector:
        with self._lock:
            self._rules.append([count, "delay", method, delay_s, path, until])
        return self

    def clear(self) -> FaultInjector:
        """Drop the remaining rules (what was injected stays recorded)."""
        with self._lock:
            self._rules.clear()
            self._rate = []
        return self

    def _take(self, method: str, path: str) -> tuple[str | None, float, threading.Event | None]:
        """The fault for this request: (mode or None, delay before forwarding,
        the event that ends the delay sooner)."""
        with self._lock:
            for rule in self._rules:
                if rule[0] > 0 and (rule[2] is None or rule[2] == method) and rule[4] in path:
                    rule[0] -= 1
                    self.injected.append((rule[1], method, path))
                    if rule[1] in ("delay", "truncate", "reset_after"):
                        self.forwarded += 1
                    return rule[1], rule[3], rule[5]
            if self._rate:
                u = self._rng.random()
                mode = next((m for p, m in self._rate if u < p), None)
                if mode is not None and (mode != "truncate" or method == "GET"):
                    self.injected.append((mode, method, path))
                    if mode != "reset":
                        self.forwarded += 1
                    return mode, 0.0, None
            self.forwarded += 1
        return None, 0.0, None


_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


def _make_handler(upstream: tuple[str, int], injector: FaultInjector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _handle(self) -> None:
            body = self._body()
            mode, delay_s, until = injector._take(self.command, self.path)
            if until is not None:
                until.wait(delay_s)  # held in flight until the test lets it go
            elif delay_s:
                time.sleep(delay_s)  # the injected fault itself: a slow store
            if mode == "reset":
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                self.close_connection = True
                self.connection.close()
                return
            if mode in ("503", "throttle"):
                code = "SlowDown" if mode == "throttle" else "ServiceUnavailable"
                payload = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            conn = http.client.HTTPConnection(*upstream, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            if mode == "reset_after":  # the request took effect upstream; its answer is lost
                conn.close()
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                self.close_connection = True
                self.connection.close()
                return
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            # HEAD has no body: pass the upstream length through (s3fs sizes files by it)
            length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
            self.send_header("Content-Length", length)
            self.end_headers()
            if mode == "truncate" and data:
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
            elif self.command != "HEAD":
                self.wfile.write(data)
            conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    return Handler


class FaultyS3:
    """The proxy, serving `injector` (a fresh one unless given) on 127.0.0.1,
    port 0, in front of ``upstream`` (``http://host:port``) until `close`
    (or the end of a ``with`` block)."""

    def __init__(self, upstream: str, injector: FaultInjector | None = None) -> None:
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.injector = injector or FaultInjector()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler((host, int(port)), self.injector))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        """The endpoint URL clients use instead of the upstream's."""

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultyS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def moto_bucket(prefix: str) -> Iterator[tuple[str, str]]:
    """A moto S3 server on loopback with a fresh bucket made directly (not
    through any proxy): yields (bucket name, the server's URL); stopped after."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        bucket = f"{prefix}-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                     aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=bucket)
        yield bucket, f"http://{host}:{port}"
    finally:
        server.stop()


def agent_s3_env(endpoint: str) -> dict[str, str]:
    """What an agent (and its ranks) needs to reach the S3 server at `endpoint`."""
    return {"SPRINGBACK_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
