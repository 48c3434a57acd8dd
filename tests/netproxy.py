"""A loopback TCP proxy that injects network faults between a client and a server.

`netem` is not available on these machines, so the faults of a real network
are made here, in user space, on 127.0.0.1: a test points a client (an agent,
a coordinator's etcd client, a rank) at `NetProxy.address` instead of the
server, then changes the link while traffic flows. Every fault call returns
the proxy, so faults chain::

    with NetProxy(etcd.endpoint) as link:
        store = Store(link.url)
        link.delay(0.2, jitter=0.05)          # every segment, both ways
        link.hold(UP)                         # client -> server bytes queue up
        wait_for(lambda: link.queued(UP) > 0, 5, "a request on the held link")
        link.release().reset()                # deliver them, then RST every connection
        link.refuse()                         # new connections are reset on accept
        link.heal()                           # a clean link again

Semantics (what a test may rely on):

* Bytes keep their order per direction and connection; a delay or hold never
  reorders or drops them. ``delay(d, jitter=j)`` delivers each segment no
  earlier than ``d ± j`` after it was read (and never before an earlier one).
* `hold` queues a direction's bytes without forwarding them (the peers see a
  silent link: TCP stays up, nothing arrives); `release` forwards what was
  queued, in order. `queued` counts the bytes waiting.
* `drop` discards a direction's bytes (a reply lost on the wire); the peers
  are not told.
* `reset` closes every open connection now with a TCP RST (both sides see
  "connection reset"); what was queued is discarded. `refuse` makes the proxy
  reset each *new* connection as soon as it is accepted (to a gRPC client this
  is as good as a refused port: UNAVAILABLE), until `heal`.
* `heal` clears every fault and releases what was held.

One thread accepts; each connection has a reader and a writer thread per
direction. `close` stops everything (idempotent).
"""

from __future__ import annotations

import collections
import random
import select
import socket
import struct
import threading
import time
from urllib.parse import urlparse

UP = "up"
"""Client -> server."""
DOWN = "down"
"""Server -> client."""
BOTH = (UP, DOWN)


def _rst_close(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _parse(address: str) -> tuple[str, int]:
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"upstream: {address!r} is not HOST:PORT or a URL with a port")
    return parsed.hostname, parsed.port


class _Direction:
    """Fault settings of one direction, shared by every connection."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.jitter_s = 0.0
        self.held = False
        self.dropped = False


class _Pump:
    """Copies one direction of one connection, applying that direction's faults."""

    def __init__(self, proxy: NetProxy, name: str, src: socket.socket, dst: socket.socket,
                 on_close, on_eof) -> None:  # noqa: ANN001
        self.proxy = proxy
        self.name = name
        self.src, self.dst = src, dst
        self.on_close = on_close
        self.on_eof = on_eof
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.closed = False

    def start(self) -> None:
        """Starts copying (after the connection knows both its pumps: a
        failed send resets the whole connection)."""
        threading.Thread(target=self._read, daemon=True, name=f"netproxy-{self.name}-read").start()
        threading.Thread(target=self._write, daemon=True, name=f"netproxy-{self.name}-write").start()

    def queued(self) -> int:
        with self.proxy._cond:
            return sum(len(chunk) for _, chunk in self.queue)

    def _read(self) -> None:
        faults = self.proxy._faults[self.name]
        while not self.closed:
            try:
                ready, _, _ = select.select([self.src], [], [], 0.1)
                if not ready:
                    continue
                chunk = self.src.recv(65536)
            except (OSError, ValueError):
                chunk = b""
            with self.proxy._cond:
                if not chunk:
                    self.queue.append((0.0, b""))  # end of stream, after what is queued
                    self.proxy._cond.notify_all()
                    return
                if faults.dropped:
                    continue
                jitter = random.uniform(-faults.jitter_s, faults.jitter_s) if faults.jitter_s else 0.0
                due = time.monotonic() + max(0.0, faults.delay_s + jitter)
                if self.queue:
                    due = max(due, self.queue[-1][0])  # never overtake an earlier segment
                self.queue.append((due, chunk))
                self.proxy._cond.notify_all()

    def _write(self) -> None:
        faults = self.proxy._faults[self.name]
        cond = self.proxy._cond
        while True:
            with cond:
                while not self.closed and (not self.queue or faults.held
                                           or self.queue[0][0] > time.monotonic()):
                    timeout = 0.1
                    if self.queue and not faults.held:
                        timeout = min(timeout, max(0.0, self.queue[0][0] - time.monotonic()))
                    cond.wait(timeout)
                if self.closed:
                    return
                _, chunk = self.queue.popleft()
            if not chunk:
                try:
                    self.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                self.on_eof()
                return
            try:
                self.dst.sendall(chunk)
            except OSError:
                self.on_close()
                return


class _Connection:
    def __init__(self, proxy: NetProxy, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self._lock = threading.Lock()
        self.open = True
        self._num_eof = 0
        self.pumps = {
            UP: _Pump(proxy, UP, client, server, self.reset, self._eof),
            DOWN: _Pump(proxy, DOWN, server, client, self.reset, self._eof),
        }
        for pump in self.pumps.values():
            pump.start()

    def _eof(self) -> None:
        with self._lock:
            self._num_eof += 1
            done = self._num_eof == 2
        if done:  # both peers closed their side: nothing more will flow
            self.reset()

    def reset(self) -> None:
        with self._lock:
            if not self.open:
                return
            self.open = False
        for pump in self.pumps.values():
            pump.closed = True
            pump.queue.clear()
        _rst_close(self.client)
        _rst_close(self.server)


class NetProxy:
    """Listens on a free loopback port and forwards to `upstream` (``HOST:PORT``
    or a URL such as ``http://127.0.0.1:2379``); see the module docstring."""

    def __init__(self, upstream: str, *, host: str = "127.0.0.1") -> None:
        self.upstream = _parse(upstream)
        self._scheme = urlparse(upstream).scheme if "://" in upstream else ""
        self._cond = threading.Condition()
        self._faults = {UP: _Direction(), DOWN: _Direction()}
        self._refusing = False
        self._connections: list[_Connection] = []
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(128)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self.num_accepted = 0
        self.num_refused = 0
        self.refused_at: list[float] = []  # time.monotonic() of each refusal
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="netproxy-accept").start()

    @property
    def url(self) -> str:
        """The proxy's address in the upstream's form (``http://HOST:PORT`` for a URL)."""
        return f"{self._scheme}://{self.address}" if self._scheme else self.address

    def __enter__(self) -> NetProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- faults (each returns self, so they chain) ---------------------------------

    def _directions(self, direction: str | tuple[str, ...]) -> list[_Direction]:
        names = (direction,) if isinstance(direction, str) else direction
        for name in names:
            if name not in BOTH:
                raise ValueError(f"direction: {name!r} is not {UP!r} or {DOWN!r}")
        return [self._faults[name] for name in names]

    def delay(self, seconds: float, *, jitter: float = 0.0,
              direction: str | tuple[str, ...] = BOTH) -> NetProxy:
        """Delays every segment read from now on by ``seconds ± jitter``."""
        if seconds < 0 or jitter < 0:
            raise ValueError(f"delay: seconds ({seconds}) and jitter ({jitter}) must be >= 0")
        with self._cond:
            for faults in self._directions(direction):
                faults.delay_s, faults.jitter_s = seconds, jitter
        return self

    def hold(self, direction: str | tuple[str, ...] = BOTH) -> NetProxy:
        """Queues bytes in `direction` without forwarding them (a silent link)."""
        with self._cond:
            for faults in self._directions(direction):
                faults.held = True
        return self

    def release(self, direction: str | tuple[str, ...] = BOTH) -> NetProxy:
        """Forwards what `hold` queued, in order, and stops holding."""
        with self._cond:
            for faults in self._directions(direction):
                faults.held = False
            self._cond.notify_all()
        return self

    def drop(self, direction: str | tuple[str, ...] = BOTH) -> NetProxy:
        """Discards bytes in `direction` from now on (the peers are not told)."""
        with self._cond:
            for faults in self._directions(direction):
                faults.dropped = True
        return self

    def reset(self) -> NetProxy:
        """RSTs every open connection now; queued bytes are discarded."""
        with self._cond:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.reset()
        return self

    def refuse(self) -> NetProxy:
        """Resets every new connection as soon as it is accepted, until `heal`."""
        with self._cond:
            self._refusing = True
        return self

    def heal(self) -> NetProxy:
        """Clears every fault; held bytes are released."""
        with self._cond:
            self._refusing = False
            for faults in self._faults.values():
                faults.delay_s = faults.jitter_s = 0.0
                faults.held = faults.dropped = False
            self._cond.notify_all()
        return self

    # -- observation ----------------------------------------------------------------

    def queued(self, direction: str = UP) -> int:
        """Bytes read in `direction` and not yet forwarded (held or delayed)."""
        self._directions(direction)
        with self._cond:
            connections = list(self._connections)
        return sum(c.pumps[direction].queued() for c in connections if c.open)

    def num_open(self) -> int:
        with self._cond:
            return sum(1 for c in self._connections if c.open)

    # -- plumbing -------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._cond:
                refusing = self._refusing
            if refusing:
                self.num_refused += 1
                self.refused_at.append(time.monotonic())
                _rst_close(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _rst_close(client)
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(self, client, server)
            with self._cond:
                self.num_accepted += 1
                self._connections = [c for c in self._connections if c.open] + [connection]

    def close(self) -> None:
        """Stops accepting and resets every connection (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        self.reset()
