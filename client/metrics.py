"""Prometheus metrics through `prometheus-client`, collected at scrape time.

A `Registry` wraps a `prometheus_client.CollectorRegistry` of its own (not
the process-global one, so two servers in one process do not collide). Values
are read when Prometheus scrapes, by callbacks (`add`) or by collectors that
yield whole metric families, histograms included (`add_collector`); nothing is
updated on hot paths. `serve` runs a daemon HTTP server on ``HOST:PORT``
(port 0 picks a free one) answering ``GET /metrics`` with
`prometheus_client.generate_latest`, plus any extra read-only pages (the
coordinator's dashboard) behind an optional bearer token.

Failure semantics: a callback or collector that raises is logged and its
family left out of that scrape (counted in ``springback_metrics_collect_errors_total``);
a scrape never fails because one source did.
"""

from __future__ import annotations

import hmac
import http.cookies
import http.server
import logging
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

Sample = tuple[dict[str, str], float]
COOKIE = "springback_token"
Page = Callable[[str], tuple[int, str, bytes]]
"""A page handler: request path (with query) -> (status, content type, body)."""


class _Callback(Collector):
    def __init__(self, name: str, kind: str, help_text: str,
                 collect: Callable[[], Iterable[Sample] | float]) -> None:
        if kind not in ("gauge", "counter"):
            raise ValueError(f"metric {name}: kind must be gauge or counter, got {kind!r}")
        self.name, self.kind, self.help_text, self._collect = name, kind, help_text, collect

    def collect(self) -> Iterator[Metric]:
        value = self._collect()
        samples = [({}, float(value))] if isinstance(value, (int, float)) else list(value)
        labels = sorted(samples[0][0]) if samples else []
        family_type = GaugeMetricFamily if self.kind == "gauge" else CounterMetricFamily
        family = family_type(self.name, self.help_text, labels=labels)
        for sample_labels, sample_value in samples:
            family.add_metric([str(sample_labels[k]) for k in labels], float(sample_value))
        yield family


class _Guarded(Collector):
    """Leaves a failing collector's families out of the scrape, and counts it."""

    def __init__(self, inner: Collector, errors: list[int]) -> None:
        self._inner, self._errors = inner, errors

    def collect(self) -> Iterator[Metric]:
        try:
            families = list(self._inner.collect())
        except Exception:  # noqa: BLE001 (a scrape must not fail because one source did)
            self._errors[0] += 1
            log.exception("metrics collector %r failed", self._inner)
            return
        yield from families


class Registry:
    """The metrics one server exposes."""

    def __init__(self) -> None:
        self.prometheus = CollectorRegistry(auto_describe=False)
        self._errors = [0]
        self.add("springback_metrics_collect_errors_total", "counter",
                 "Metric sources that failed during a scrape.", lambda: self._errors[0])

    def add(self, name: str, kind: str, help_text: str,
            collect: Callable[[], Iterable[Sample] | float]) -> None:
        """Registers `name` (kind 'gauge' or 'counter'); `collect` returns a
        number or (labels, value) samples, all with the same label names."""
        self.add_collector(_Callback(name, kind, help_text, collect))

    def add_collector(self, collector: Collector) -> None:
        """Registers a collector yielding prometheus-client metric families."""
        self.prometheus.register(_Guarded(collector, self._errors))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric, now."""
        return generate_latest(self.prometheus)


class _Server(http.server.ThreadingHTTPServer):
    """The HTTP server of `serve`; its handler reads what to serve from here."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], registry: Registry,
                 routes: dict[str, Page], token: str | None,
                 viewer_token: str | None = None) -> None:
        super().__init__(address, _Handler)
        self.registry = registry
        self.routes = routes
        self.tokens = tuple(t for t in (token, viewer_token) if t)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        path = self.path.split("?")[0]
        if path == "/metrics":
            self._reply(200, CONTENT_TYPE_LATEST, self.server.registry.render())
            return
        handler = next((h for p, h in self.server.routes.items()
                        if path == p or path.startswith(p.rstrip("/") + "/")), None)
        if handler is None:
            self._reply(404, "text/plain", b"not found: /metrics and the dashboard are served\n")
            return
        if self.server.tokens and not self._authorized(self.server.tokens):
            return
        try:
            status, content_type, body = handler(self.path)
        except Exception as e:  # noqa: BLE001 (one bad page must not stop the server)
            log.exception("page %s failed", self.path)
            status, content_type, body = 500, "text/plain", f"internal error: {e}\n".encode()
        self._reply(status, content_type, body)

    def _authorized(self, tokens: tuple[str, ...]) -> bool:
        """True for a request carrying one of the tokens; otherwise replies
        (401 or the redirect that sets the cookie) and returns False."""
        def same(given: str) -> bool:
            # every token compared, in constant time each: no early exit
            return sum(hmac.compare_digest(given.encode(), t.encode()) for t in tokens) > 0

        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        given = query.get("token", [""])[0]
        if same(given):
            self._reply(303, "text/plain", b"", {
                "Location": urllib.parse.urlsplit(self.path).path,
                "Set-Cookie": f"{COOKIE}={given}; HttpOnly; SameSite=Strict; Path=/"})
            return False
        cookies = http.cookies.SimpleCookie(self.headers.get("Cookie", ""))
        if same(self.headers.get("Authorization", "").removeprefix("Bearer ")) or (
                COOKIE in cookies and same(cookies[COOKIE].value)):
            return True
        self._reply(401, "text/plain",
                    b"missing or wrong bearer token (browsers: open the page with ?token=...)\n",
                    {"WWW-Authenticate": "Bearer"})
        return False

    def _reply(self, status: int, content_type: str, body: bytes,
               headers: dict[str, Any] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass


def serve(registry: Registry, listen: str, *, pages: dict[str, Page] | None = None,
          token: str | None = None,
          viewer_token: str | None = None) -> http.server.ThreadingHTTPServer:
    """Starts the endpoint; returns the server (``server_address`` has the port).

    ``/metrics`` is always open (Prometheus scrapers rarely carry tokens);
    `pages` (path prefix -> handler) require the token when `token` is set:
    ``Authorization: Bearer <token>``, or for a browser the cookie that
    opening any page with ``?token=<token>`` sets (HttpOnly, SameSite=Strict;
    the reply redirects to the page without the token in its address).
    Anything else gets 401. `viewer_token`, when given, opens the pages
    too (they only read). Raises OSError if `listen` cannot be bound.
    """
    host, _, port = listen.rpartition(":")
    server = _Server((host or "127.0.0.1", int(port)), registry, dict(pages or {}), token,
                     viewer_token)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
