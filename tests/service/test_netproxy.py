"""The loopback fault proxy itself, against a real TCP echo server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from netproxy import DOWN, UP, NetProxy
from sbtest import wait_for

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def echo():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # a reset peer ends the echo
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield "127.0.0.1:%d" % listener.getsockname()[1]
    listener.close()


def dial(proxy: NetProxy) -> socket.socket:
    host, port = proxy.address.split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


class TestNetProxy:
    def test_bytes_pass_in_order_through_a_delayed_link(self, echo):
        with NetProxy(echo) as proxy, dial(proxy) as sock:
            proxy.delay(0.1, jitter=0.05)
            started = time.monotonic()
            for i in range(20):
                sock.sendall(b"%03d" % i)
            assert recv_exactly(sock, 60) == b"".join(b"%03d" % i for i in range(20))
            assert time.monotonic() - started >= 0.1  # at least one delay each way

    def test_a_held_direction_queues_until_released(self, echo):
        with NetProxy(echo) as proxy, dial(proxy) as sock:
            proxy.hold(UP)
            sock.sendall(b"held")
            wait_for(lambda: proxy.queued(UP) == 4, 5, "the bytes to queue on the held link")
            sock.settimeout(0.2)
            with pytest.raises(socket.timeout):
                sock.recv(4)
            sock.settimeout(5)
            proxy.release(UP)
            assert recv_exactly(sock, 4) == b"held"
            assert proxy.queued(UP) == 0

    def test_dropped_replies_never_arrive_and_reset_tells_both_peers(self, echo):
        with NetProxy(echo) as proxy, dial(proxy) as sock:
            proxy.drop(DOWN)
            sock.sendall(b"lost")
            sock.settimeout(0.3)
            with pytest.raises(socket.timeout):
                sock.recv(4)
            sock.settimeout(5)
            proxy.reset()
            with pytest.raises(ConnectionResetError):
                sock.recv(4)

    def test_refused_connections_are_reset_until_healed(self, echo):
        with NetProxy(echo) as proxy:
            proxy.refuse()
            with pytest.raises(ConnectionResetError):  # at connect or at the first read
                with dial(proxy) as sock:
                    sock.recv(1)
            assert proxy.num_refused == 1
            proxy.heal()
            with dial(proxy) as sock:
                sock.sendall(b"ok")
                assert recv_exactly(sock, 2) == b"ok"
