"""Prometheus metrics through `prometheus-client`, collected at scrape time.

A `Registry` wraps a `prometheus_client.CollectorRegistry` of its own (not
the process-global one, so two servers in one process do not collide). Values
are read when Prometheus scrapes, by callbacks (`add`) or by collectors that
yield whole metric families, histograms included (`add_collector`); nothing is
updated on hot paths. `serve` runs a daemon HTTP server on ``HOST:PORT``
(port 0 picks a free one, optionally over TLS) answering ``GET /metrics``
with `prometheus_client.generate_latest`, plus any extra read-only pages (the
coordinator's dashboard), all behind an optional bearer token; a browser trades
the token for a session (`Sessions`) once, by ``POST /login`` (`login_page`:
never in an address, where it would land in logs and history; refused over
plain HTTP from a non-loopback peer), and its cookie holds only the session
id; ``POST /logout`` ends it (`LOGOUT_FORM`, added to the pages a session
opened). Every response carries `SECURITY_HEADERS`.

Failure semantics: a callback or collector that raises is logged and its
family left out of that scrape (counted in ``springback_metrics_collect_errors_total``);
a scrape never fails because one source did.
"""

from __future__ import annotations

import hmac
import html
import http.cookies
import http.server
import ipaddress
import logging
import re
import secrets
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

Sample = tuple[dict[str, str], float]
COOKIE = "springback_session"
SESSION_TTL_S = 12 * 3600.0
"""How long a dashboard session lasts after the login that made it."""
MAX_SESSIONS = 10_000
"""Sessions kept at most (the oldest goes first): logins cannot grow memory."""
LOGIN = "/login"
"""``POST`` here (form fields ``token`` and ``next``) opens a session."""
LOGOUT = "/logout"
"""``POST`` here ends the cookie's session (a GET changes nothing: 405)."""
LOGOUT_FORM = (b"<form id='logout' method='post' action='/logout' style='float:right'>"
               b"<button type='submit'>Log out</button></form>")
"""The logout control, put first in the body of every HTML page served to a
session (a form, not a link: only a POST logs out, and SameSite=Strict keeps
the cookie off another site's POST)."""
SECURITY_HEADERS = {
    # the pages' script is served from /live.js and their images from the
    # same origin; styles stay inline (the pages' <style> and the plots' SVG)
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; "
                               "style-src 'self' 'unsafe-inline'; img-src 'self'; "
                               "object-src 'none'; base-uri 'none'; form-action 'self'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
"""Sent with every response of `serve`."""
MAX_FORM_BYTES = 65536
"""The largest login or logout body read; a longer one is refused."""
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


class Sessions:
    """Dashboard sessions, in this process's memory: id -> (role, expiry).
    An id is `secrets.token_urlsafe` (256 bits); a restart, or
    `SESSION_TTL_S` after the login, ends it (the browser logs in again).
    Thread-safe."""

    def __init__(self, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self._max, self._clock = ttl_s, max_sessions, clock
        self._sessions: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def open(self, role: str) -> str:
        """A new session of `role`; returns its id."""
        session_id = secrets.token_urlsafe(32)
        now = self._clock()
        with self._lock:
            for sid in [sid for sid, (_, end) in self._sessions.items() if end <= now]:
                del self._sessions[sid]
            while len(self._sessions) >= self._max:
                del self._sessions[next(iter(self._sessions))]  # the oldest (insertion order)
            self._sessions[session_id] = (role, now + self.ttl_s)
        return session_id

    def role(self, session_id: str) -> str | None:
        """The role of a live session, None for an unknown or expired id."""
        with self._lock:
            found = self._sessions.get(session_id)
            if found is None:
                return None
            if found[1] <= self._clock():
                del self._sessions[session_id]
                return None
            return found[0]

    def close(self, session_id: str) -> bool:
        """Ends a session now (logout); False if it was not open."""
        with self._lock:
            return self._sessions.pop(session_id, None) is not None


def login_page(next_path: str, why: str) -> bytes:
    """The login form (HTML, no script): it POSTs the token to `LOGIN`, then
    the browser is sent on to `next_path`; `why` is said above it."""
    return (b"<!doctype html><html><head><meta charset='utf-8'><title>Springback: log in"
            b"</title></head><body><h1>Springback: log in</h1><p id='why'>"
            + html.escape(why).encode() + b"</p><form id='login' method='post' action='"
            + LOGIN.encode() + b"'><input type='hidden' name='next' value='"
            + html.escape(next_path, quote=True).encode() + b"'><label>Token <input "
            b"type='password' name='token' autocomplete='current-password' autofocus>"
            b"</label> <button type='submit'>Log in</button></form></body></html>")


def _local_path(given: str) -> str:
    """`given` if it is a path on this server, else ``/`` (no open redirect)."""
    ok = given.startswith("/") and not given.startswith("//") and "\\" not in given
    return given if ok and given.isprintable() else "/"


class _Server(http.server.ThreadingHTTPServer):
    """The HTTP server of `serve`; its handler reads what to serve from here."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], registry: Registry,
                 routes: dict[str, Page], token: str | None,
                 viewer_token: str | None = None) -> None:
        super().__init__(address, _Handler)
        self.registry = registry
        self.routes = routes
        self.tokens = tuple((t, role) for t, role in ((token, "operator"),
                                                      (viewer_token, "viewer")) if t)
        self.sessions = Sessions()
        self.secure = False


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    _session = False  # this request was let in by a session cookie
    timeout = 30.0  # a client that stalls (mid-handshake too) frees its thread after this

    def setup(self) -> None:
        super().setup()  # applies `timeout` to the socket
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()  # here, on this request's thread, not in accept()

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        path = self.path.split("?")[0]
        if path == "/metrics":
            # job ids and generations: the same credential as the pages (a
            # scraper sends it as ``Authorization: Bearer``)
            if self.server.tokens and not self._authorized(self.server.tokens):
                return
            self._reply(200, CONTENT_TYPE_LATEST, self.server.registry.render())
            return
        if path == LOGIN and self.server.tokens:
            self._reply(200, "text/html; charset=utf-8", login_page("/", "Log in."))
            return
        if path == LOGOUT:  # a link or an <img> must not end a session
            self._reply(405, "text/plain", b"log out with POST /logout\n", {"Allow": "POST"})
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
        if self._session and content_type.startswith("text/html"):
            body = re.sub(rb"(<body[^>]*>)", lambda m: m.group(1) + LOGOUT_FORM, body, count=1)
        self._reply(status, content_type, body)

    def do_POST(self) -> None:  # noqa: N802 (http.server naming)
        """``POST /login`` (`_login`), or ``POST /logout``: ends the cookie's
        session here, clears the cookie and redirects to ``/`` (which asks for
        a login again); without a live session it only clears the cookie. Any
        other POST is 405; a body over `MAX_FORM_BYTES` is 413."""
        given = self.headers.get("Content-Length", "0")
        length = int(given) if given.isdigit() else -1
        if not 0 <= length <= MAX_FORM_BYTES:
            self._reply(413, "text/plain", b"Content-Length: not a number, or over 64 KiB\n",
                        {"Connection": "close"})
            self.close_connection = True
            return
        body = self.rfile.read(length) if length else b""  # off the connection either way
        path = self.path.split("?")[0]
        if path == LOGIN and self.server.tokens:
            self._login(body)
            return
        if path != LOGOUT:
            self._reply(405, "text/plain", b"the dashboard is read-only\n", {"Allow": "GET"})
            return
        cookies = http.cookies.SimpleCookie(self.headers.get("Cookie", ""))
        if COOKIE in cookies:
            self.server.sessions.close(cookies[COOKIE].value)
        self._reply(303, "text/plain", b"", {"Location": "/", "Set-Cookie": self._cookie("", 0)})

    def _cookie(self, value: str, max_age: int) -> str:
        return (f"{COOKIE}={value}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age}"
                + ("; Secure" if self.server.secure else ""))

    def _role_of(self, given: str) -> str | None:
        # every token compared, in constant time each: no early exit
        matches = [role for token, role in self.server.tokens
                   if hmac.compare_digest(given.encode(), token.encode())]
        return matches[0] if matches else None

    def _login(self, body: bytes) -> None:
        """``POST /login`` of the form `login_page` shows: a right ``token``
        opens a session, sets its cookie and redirects (303) to ``next`` (a
        path on this server); a wrong or missing one is 401 with the form
        again. Refused (403, no session, the token not compared) over plain
        HTTP from a peer that is not loopback: the token would have crossed
        the network in clear."""
        peer = ipaddress.ip_address(self.client_address[0].split("%")[0])
        peer = getattr(peer, "ipv4_mapped", None) or peer
        if not self.server.secure and not peer.is_loopback:
            self._reply(403, "text/plain",
                        f"token: login over plain HTTP from {peer} refused: the token would "
                        "cross the network in clear; serve the dashboard over HTTPS "
                        "(--metrics-tls-cert and --metrics-tls-key) or reach it through a "
                        "loopback tunnel (ssh -L, kubectl port-forward)\n".encode())
            return
        form = urllib.parse.parse_qs(body.decode("utf-8", errors="replace"))
        next_path = _local_path(form.get("next", ["/"])[0])
        role = self._role_of(form.get("token", [""])[0])
        if role is None:
            self._reply(401, "text/html; charset=utf-8",
                        login_page(next_path, "token: missing or wrong; try again."))
            return
        cookie = self._cookie(self.server.sessions.open(role), int(self.server.sessions.ttl_s))
        self._reply(303, "text/plain", b"", {"Location": next_path, "Set-Cookie": cookie})

    def _authorized(self, tokens: tuple[tuple[str, str], ...]) -> bool:
        """True for a request carrying one of the tokens, or the cookie of a
        live session; otherwise replies and returns False: 400 for a token in
        the address (``?token=``: it would land in logs and history), else
        401 with the login form (`login_page`)."""
        split = urllib.parse.urlsplit(self.path)
        if "token" in urllib.parse.parse_qs(split.query):
            self._reply(400, "text/plain",
                        b"token: not accepted in the address (it lands in logs and browser "
                        b"history): log in with the form at " + LOGIN.encode() + b" (a POST)\n")
            return False
        cookies = http.cookies.SimpleCookie(self.headers.get("Cookie", ""))
        bearer = self.headers.get("Authorization", "").removeprefix("Bearer ")
        if bearer and self._role_of(bearer) is not None:
            return True
        if COOKIE in cookies and self.server.sessions.role(cookies[COOKIE].value):
            self._session = True
            return True
        self._reply(401, "text/html; charset=utf-8",
                    login_page(_local_path(self.path), "Missing or wrong bearer token, or the "
                               "session ended: log in."), {"WWW-Authenticate": "Bearer"})
        return False

    def _reply(self, status: int, content_type: str, body: bytes,
               headers: dict[str, Any] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in SECURITY_HEADERS.items():
            self.send_header(k, v)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass


def serve(registry: Registry, listen: str, *, pages: dict[str, Page] | None = None,
          token: str | None = None, viewer_token: str | None = None,
          tls_cert: str | None = None,
          tls_key: str | None = None) -> http.server.ThreadingHTTPServer:
    """Starts the endpoint; returns the server (``server_address`` has the port).

    ``/metrics`` and `pages` (path prefix -> handler) require the token when
    `token` is set (without one, as on a node agent's listener, they are
    open): ``Authorization: Bearer <token>`` (Prometheus:
    ``authorization: {credentials_file: ...}``), or for a browser the session cookie
    that ``POST /login`` sets (the form of `login_page`, shown with every 401
    and at ``GET /login``): the token opens a server-side session (`Sessions`)
    and the cookie holds only its random id (HttpOnly, SameSite=Strict,
    Path=/, Secure over TLS). The login is refused (403) over plain HTTP
    from a peer that is not loopback, and a token in an address
    (``?token=``) is 400: it would land in logs and history. Anything else,
    an expired session too, gets 401. ``POST /logout`` ends the cookie's
    session and clears the cookie (a GET of it is 405: logging out needs
    the POST of `LOGOUT_FORM`, which HTML pages served to a session get at
    the top of their body). `viewer_token`, when given, opens the
    pages too (they only read). `tls_cert` and `tls_key` (PEM files, both
    or neither) serve HTTPS; the TLS handshake runs on the request's own
    thread, so a slow client holds up no other. Raises OSError if `listen`
    cannot be bound, ValueError for one of `tls_cert` / `tls_key` alone,
    ssl.SSLError for files that do not hold a matching certificate and key.
    """
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key: give both or neither")
    host, _, port = listen.rpartition(":")
    server = _Server((host or "127.0.0.1", int(port)), registry, dict(pages or {}), token,
                     viewer_token)
    if tls_cert and tls_key:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(tls_cert, tls_key)
        except (OSError, ssl.SSLError):
            server.server_close()
            raise
        server.socket = context.wrap_socket(server.socket, server_side=True,
                                            do_handshake_on_connect=False)
        server.secure = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
