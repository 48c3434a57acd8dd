"""Resets live TCP connections between processes on this machine (`ss -K`).

Ranks connect to each other directly (gloo pairs over loopback), so a proxy
cannot sit between them without changing how they rendezvous. The kernel can
instead destroy an established socket (SOCK_DESTROY through `ss -K`): the
owner's next call fails with "connection aborted" and its peer receives a TCP
RST ("connection reset by peer"), exactly what a broken link between two
hosts gives them. `reset_between(pids)` does that for every connection whose
two ends both belong to processes in `pids` and returns how many it reset.

`available()` says whether this kernel allows it (CONFIG_INET_DIAG_DESTROY,
root); tests that need it skip with that reason otherwise.
"""

from __future__ import annotations

import re
import socket
import subprocess

_ROW = re.compile(r"(\S+):(\d+)\s+(\S+):(\d+)\s+users:\(\(.*?pid=(\d+)")


def _connections() -> list[tuple[tuple[str, int], tuple[str, int], int]]:
    """(local, peer, owner pid) of every established TCP socket."""
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True,
                         text=True, check=True, timeout=10).stdout
    rows = []
    for line in out.splitlines():
        m = _ROW.search(line)
        if m:
            rows.append(((m[1], int(m[2])), (m[3], int(m[4])), int(m[5])))
    return rows


def _destroy(local: tuple[str, int], peer: tuple[str, int]) -> bool:
    result = subprocess.run(
        ["ss", "-K", "src", local[0], "sport", "=", str(local[1]),
         "dst", peer[0], "dport", "=", str(peer[1])],
        capture_output=True, text=True, timeout=10)
    return result.returncode == 0 and str(local[1]) in result.stdout


def reset_between(pids: set[int]) -> int:
    """Destroys each established connection whose two ends are owned by
    processes in `pids` (one side per connection: the other gets the RST).
    Returns the number of connections reset."""
    rows = _connections()
    owner = {local: pid for local, _, pid in rows}
    done: set[frozenset] = set()
    count = 0
    for local, peer, pid in rows:
        link = frozenset((local, peer))
        if pid in pids and owner.get(peer) in pids and link not in done:
            done.add(link)
            count += _destroy(local, peer)
    return count


def available() -> bool:
    """True when this kernel lets `ss -K` destroy a loopback connection."""
    server = socket.create_server(("127.0.0.1", 0))
    try:
        client = socket.create_connection(server.getsockname(), timeout=5)
        accepted, _ = server.accept()
        try:
            return _destroy(client.getsockname(), accepted.getsockname())
        except (OSError, subprocess.SubprocessError):
            return False
        finally:
            client.close()
            accepted.close()
    finally:
        server.close()
