"""Restart mode's gate to a generation's TCPStore (worker/agent/storegate.py,
issue 44): a real torch TCPStore on 127.0.0.1 behind a real gate and
forwarder; clients through the forwarder use it as any store, a connection
to the gate without the generation's proof reaches nothing."""

from __future__ import annotations

import datetime
import logging
import socket
import threading

import pytest
import torch.distributed as dist

from springback.worker.agent.startup import serve_store
from springback.worker.agent.storegate import (
    PROOF_BYTES, StoreForwarder, StoreGate, store_proof)

pytestmark = pytest.mark.timeout(60)

PROOF = store_proof("0123456789abcdef0123456789abcdef", "job", 3)


def client(port: int, timeout_s: float = 10.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def assert_closed_unanswered(sock: socket.socket) -> None:
    """The peer closed `sock` without a byte back (a reset where what was
    sent was left unread)."""
    try:
        assert sock.recv(100) == b""
    except ConnectionResetError:
        pass


@pytest.fixture
def gated():
    """(store, gate, forwarder): the store on loopback, the gate before it, a
    forwarder with the right proof."""
    store = serve_store("127.0.0.1")
    gate = StoreGate("127.0.0.1", store.port, PROOF, label="generation 3",
                     proof_timeout_s=1.0)
    forwarder = StoreForwarder(gate.local_address, PROOF, label="generation 3")
    try:
        yield store, gate, forwarder
    finally:
        forwarder.close()
        gate.close()


def test_the_proof_is_bound_to_the_secret_the_job_and_the_generation():
    assert len(PROOF) == PROOF_BYTES
    assert PROOF == store_proof("0123456789abcdef0123456789abcdef", "job", 3)
    assert PROOF != store_proof("0123456789abcdef0123456789abcdeX", "job", 3)
    assert PROOF != store_proof("0123456789abcdef0123456789abcdef", "job2", 3)
    assert PROOF != store_proof("0123456789abcdef0123456789abcdef", "job", 4)


def test_clients_through_the_forwarder_share_the_store_with_several_connections(gated):
    store, gate, forwarder = gated
    a, b = client(forwarder.port), client(forwarder.port)
    a.set("k", "v")
    assert b.get("k") == b"v"
    assert store.get("k") == b"v"  # the real store behind the gate
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5
    # a blocking wait on one connection while another writes: both spliced at once
    waited: list[bytes] = []
    waiter = threading.Thread(target=lambda: (a.wait(["late"]), waited.append(a.get("late"))))
    waiter.start()
    b.set("late", "x" * 200_000)  # larger than one chunk of the splice
    waiter.join(20)
    assert waited == [b"x" * 200_000]
    assert gate.refused == 0


def test_without_the_proof_the_gate_lets_no_key_be_read_or_written(gated, caplog):
    store, gate, forwarder = gated
    caplog.set_level(logging.WARNING, logger="springback.agent")
    client(forwarder.port).set("k", "v")

    # a TCPStore client straight at the gate: its handshake is no proof
    with pytest.raises((RuntimeError, dist.DistError)):
        intruder = client(gate.port, timeout_s=3)
        intruder.set("k", "forged")
    # a wrong proof followed by a well-formed store request: closed unanswered
    with socket.create_connection(gate.local_address, timeout=10) as raw:
        raw.sendall(b"\0" * PROOF_BYTES + b"anything the store would parse")
        assert_closed_unanswered(raw)
    # nothing at all: closed at the proof's deadline
    with socket.create_connection(gate.local_address, timeout=10) as raw:
        assert_closed_unanswered(raw)
    # a forwarder with another generation's proof gets nowhere either
    other = StoreForwarder(gate.local_address, store_proof("0123456789abcdef0123456789abcdef",
                                                           "job", 4), label="generation 4")
    try:
        with pytest.raises((RuntimeError, dist.DistError)):
            client(other.port, timeout_s=3).set("k", "forged")
    finally:
        other.close()

    assert store.get("k") == b"v" and store.num_keys() == 1  # untouched, nothing added
    assert client(forwarder.port).get("k") == b"v"  # the members' way still works
    assert gate.refused >= 4
    assert "refused a connection from 127.0.0.1:" in caplog.text
    assert "a wrong proof" in caplog.text and "0 bytes in 1s" in caplog.text


def test_half_close_is_forwarded_and_close_ends_every_connection_and_thread():
    # an echo server that answers after the client's EOF: a half-close must pass
    # through the forwarder and the gate, and the answer come back
    echo = socket.create_server(("127.0.0.1", 0))

    def serve_echo() -> None:
        conn, _ = echo.accept()
        with conn:
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
            conn.sendall(data[::-1])
        conn, _ = echo.accept()  # then one held open, answered once
        with conn:
            conn.sendall(conn.recv(1).upper())
            while conn.recv(4096):
                pass

    server = threading.Thread(target=serve_echo)
    server.start()
    before = set(threading.enumerate())
    gate = StoreGate("127.0.0.1", echo.getsockname()[1], PROOF, label="g")
    forwarder = StoreForwarder(gate.local_address, PROOF, label="g")
    try:
        with socket.create_connection(("127.0.0.1", forwarder.port), timeout=10) as conn:
            conn.sendall(b"hello")
            conn.shutdown(socket.SHUT_WR)
            assert conn.recv(100) == b"olleh"
            assert conn.recv(100) == b""
        held = socket.create_connection(("127.0.0.1", forwarder.port), timeout=10)
        held.sendall(b"x")
        assert held.recv(1) == b"X"  # spliced all the way
    finally:
        forwarder.close()
        gate.close()
        echo.close()
    assert held.recv(10) == b""  # ended by close
    held.close()
    server.join(10)
    assert set(threading.enumerate()) <= before  # no thread of the generation left
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", forwarder.port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(gate.local_address, timeout=5).close()
