"""Restart mode's authenticated way into a generation's TCPStore (issue 44).

An unmodified torchrun script's ``init_process_group`` (env://, torch's
agent-store mode) connects to MASTER_ADDR:MASTER_PORT as a plain TCPStore
client and writes torch's keys under no secret, so the store itself must not
be reachable from the network. Node rank 0's agent serves it on 127.0.0.1
only; what the other nodes reach is its `StoreGate`, a listener on the node's
advertised address (`startup.listen_on`) that splices a connection through to
the loopback store only after the connection's first `PROOF_BYTES` bytes are
the generation's proof (`store_proof`: HMAC-SHA256 under the plan's
`rendezvous_secret`, which only the plan's members hold). Every node's agent
(node rank 0's too) runs a `StoreForwarder` on 127.0.0.1, which the ranks get
as MASTER_ADDR:MASTER_PORT: each connection a rank opens (a TCPStore client
opens several) is connected to the gate, the proof sent, and then spliced
both ways. The script sees an ordinary TCPStore.

Failure semantics:

* The gate unreachable (node rank 0 gone): the forwarder logs it and closes
  the rank's connection, so the rank's ``init_process_group`` (or its next
  store call) fails, as it would against a dead master; the agent handles the
  rank's exit as any other.
* A wrong or short proof, or none within the gate's deadline
  (`PROOF_TIMEOUT_S`): the connection is closed before a byte reaches the
  store, a warning names the peer's address, and `StoreGate.refused` counts
  it. At most `MAX_UNPROVEN` connections wait for their proof at once; more
  are closed at once (a flood costs the gate no thread per connection).
* A half-close is forwarded as one (EOF one way, the other way open); a
  reset either way ends both. `close` stops the listener and every spliced
  connection and joins their threads: a generation's gate and forwarder end
  with it.

What this does not do: the proof is a fixed value per generation, sent in
the clear, so a party that can sniff the link between two nodes can replay
it (and read the store's traffic); gloo's own connections after the
rendezvous are not authenticated either (docs/security.md). No torch here.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import select
import socket
import threading
import time
from collections.abc import Callable

from springback.worker.agent.startup import listen_on, self_address

log = logging.getLogger("springback.agent")

PROOF_BYTES = 32
"""The length of `store_proof` (SHA-256)."""
PROOF_TIMEOUT_S = 5.0
"""How long the gate waits for a connection's proof."""
CONNECT_TIMEOUT_S = 10.0
"""The forwarder's connect to the gate, the gate's to the loopback store."""
MAX_UNPROVEN = 64
"""Connections waiting for their proof at once; more are closed on arrival."""
CLOSE_JOIN_S = 5.0
_CHUNK = 1 << 16
LOOPBACK = "127.0.0.1"


def store_proof(secret: str, job_id: str, generation: int) -> bytes:
    """What opens the gate of `job_id`'s `generation`: HMAC-SHA256 of
    ``restart-store/<job>/g<generation>`` under the plan's rendezvous secret."""
    return hmac.new(secret.encode(), f"restart-store/{job_id}/g{generation}".encode(),
                    hashlib.sha256).digest()


class _Splicer:
    """A listening socket whose connections are each served in a thread by
    `_serve`; tracks every socket and thread so that `close` ends them all."""

    def __init__(self, listening: socket.socket, name: str) -> None:
        self._listening = listening
        self._name = name
        self.port: int = listening.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._acceptor = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._acceptor.start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        raise NotImplementedError

    def _accept_loop(self) -> None:
        while True:
            readable, _, _ = select.select([self._listening, self._wake_r], [], [])
            if self._wake_r in readable:
                return
            try:
                conn, address = self._listening.accept()
            except OSError:
                continue  # e.g. the peer reset it while queued
            if not self._track(conn):
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = "%s:%d" % address[:2]
            self._spawn(self._serve_then_close, conn, peer)

    def _serve_then_close(self, conn: socket.socket, peer: str) -> None:
        try:
            self._serve(conn, peer)
        finally:
            self._discard(conn)

    def _spawn(self, target: Callable[..., None], *args: object) -> threading.Thread:
        def run() -> None:
            try:
                target(*args)
            finally:
                with self._lock:
                    self._threads.discard(thread)

        thread = threading.Thread(target=run, name=self._name, daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()
        return thread

    def _track(self, sock: socket.socket) -> bool:
        """Adds `sock` to what `close` ends; False (and `sock` closed) once closing."""
        with self._lock:
            if not self._closed:
                self._sockets.add(sock)
                return True
        sock.close()
        return False

    def _discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        sock.close()

    def _connect(self, address: tuple[str, int]) -> socket.socket | None:
        """A tracked connection to `address`; None (logged) when it fails or
        the splicer is closing."""
        try:
            sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
        except OSError as e:
            log.warning("%s: cannot reach %s:%d: %s", self._name, address[0], address[1], e)
            return None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock if self._track(sock) else None

    def _splice(self, a: socket.socket, b: socket.socket) -> None:
        """Copies bytes both ways until both directions ended (the caller closes)."""
        other = self._spawn(_pump, b, a)
        _pump(a, b)
        other.join()

    def close(self) -> None:
        """Stops accepting, ends every connection, joins the threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake_w.send(b"x")
        self._acceptor.join()
        self._listening.close()
        deadline = time.monotonic() + CLOSE_JOIN_S
        while time.monotonic() < deadline:  # a splice may start its second pump meanwhile
            with self._lock:
                live = list(self._sockets)
                threads = list(self._threads)
            if not threads:
                break
            for sock in live:
                _shut(sock, socket.SHUT_RDWR)  # wakes a pump in recv or sendall
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        self._wake_r.close()
        self._wake_w.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """One direction: EOF from `src` half-closes `dst`; an error ends both."""
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        _shut(src, socket.SHUT_RDWR)
        _shut(dst, socket.SHUT_RDWR)


def _shut(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass  # not connected (any more), or closed


def _read_exactly(sock: socket.socket, n: int) -> tuple[bytes, str]:
    """Up to `n` bytes within the socket's timeout, and why fewer came ("" if none missing)."""
    got = b""
    try:
        while len(got) < n:
            chunk = sock.recv(n - len(got))
            if not chunk:
                return got, f"closed after {len(got)} bytes"
            got += chunk
    except socket.timeout:
        return got, f"{len(got)} bytes in {sock.gettimeout():.0f}s"
    except OSError as e:
        return got, str(e)
    return got, ""


class StoreGate(_Splicer):
    """Node rank 0: the generation store's door on the node's advertised
    address `host` (`listen_on`); a connection that opens with `proof` is
    spliced to 127.0.0.1:`store_port`, any other is closed (see the module
    docstring). `refused`: connections closed for their proof;
    `last_refusal`: the newest one, ``"<peer>: <why>"`` ("" while none)."""

    def __init__(self, host: str, store_port: int, proof: bytes, *, label: str,
                 proof_timeout_s: float = PROOF_TIMEOUT_S) -> None:
        self._store = (LOOPBACK, store_port)
        self._proof = proof
        self._label = label
        self._proof_timeout_s = proof_timeout_s
        self._unproven = 0
        self.refused = 0
        self.last_refusal = ""
        listening = listen_on(host)
        #: where a process on this node reaches the gate
        self.local_address: tuple[str, int] = (self_address(listening),
                                               listening.getsockname()[1])
        super().__init__(listening, f"store-gate {label}")

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with self._lock:
            full = self._unproven >= MAX_UNPROVEN
            if not full:
                self._unproven += 1
        if full:
            self._refuse(peer, f"{MAX_UNPROVEN} connections already wait for their proof")
            return
        try:
            conn.settimeout(self._proof_timeout_s)
            got, why = _read_exactly(conn, PROOF_BYTES)
        finally:
            with self._lock:
                self._unproven -= 1
        if why or not hmac.compare_digest(got, self._proof):
            self._refuse(peer, why or "a wrong proof")
            return
        conn.settimeout(None)
        store = self._connect(self._store)
        if store is None:
            return
        try:
            self._splice(conn, store)
        finally:
            self._discard(store)

    def _refuse(self, peer: str, why: str) -> None:
        with self._lock:
            self.refused += 1
            self.last_refusal = f"{peer}: {why}"
        log.warning("store gate of %s: refused a connection from %s: %s (not a member of the "
                    "generation; docs/security.md)", self._label, peer, why)


class StoreForwarder(_Splicer):
    """Every node: 127.0.0.1:`port` for the ranks (MASTER_ADDR:MASTER_PORT);
    each connection is connected to the gate at `gate`, opened with `proof`,
    and spliced (see the module docstring)."""

    def __init__(self, gate: tuple[str, int], proof: bytes, *, label: str) -> None:
        self._gate = gate
        self._proof = proof
        super().__init__(listen_on(LOOPBACK), f"store-forwarder {label}")

    def _serve(self, conn: socket.socket, peer: str) -> None:
        gate = self._connect(self._gate)
        if gate is None:
            return  # the rank sees its store connection closed, as with a dead master
        try:
            gate.sendall(self._proof)
            self._splice(conn, gate)
        except OSError as e:
            log.warning("%s: %s", self._name, e)
        finally:
            self._discard(gate)
