"""Test helper: a fault timed by bytes in flight (issue 50, "faults with teeth").

`bytes_received` reads, from outside a process, how many bytes its TCP sockets
have received (``ss -tinp``: the kernel's per-socket ``bytes_received``), so a
test can kill a sender once a receiver is partway through a transfer.
`CpuCap` caps a set of processes to a share of one core (a cgroup v1 ``cpu``
group of their own), so a transfer that takes a fraction of a second on an
idle loopback lasts seconds: long enough to be cut where the test chooses.
Linux and root only (the suite's machine).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

from sbtest import node_processes
from sbtest import wait_for

CPU_ROOT = "/sys/fs/cgroup/cpu"
SLOW_COLLECTIVES = ("--collective-timeout-s", "10")
"""Agent flags for these tests: collectives may wait 10 s, not the liveness
timeout's 2 s: the capped holders' chunks are slow, and the generation must
break on the kill, not on a timeout before it."""
_RECEIVED = re.compile(r"bytes_received:(\d+)")


def bytes_received(pid: int) -> int:
    """Bytes received so far on the open TCP sockets of process `pid` (0 when
    it has none). A socket that was closed no longer counts."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=10,
                         check=True).stdout
    total, owned = 0, False
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):  # a socket's first line names its processes
            owned = f"pid={pid}," in line
        elif owned and (m := _RECEIVED.search(line)):
            total += int(m.group(1))
    return total


class CpuCap:
    """Processes capped to `percent` of one core while the cap is on
    (`add`); `remove` (or leaving the ``with``) lifts it and moves them back."""

    def __init__(self, name: str, percent: float) -> None:
        self.path = os.path.join(CPU_ROOT, f"springback-test-{name}-{os.getpid()}")
        os.makedirs(self.path)
        period = 100_000
        with open(os.path.join(self.path, "cpu.cfs_period_us"), "w") as f:
            f.write(str(period))
        with open(os.path.join(self.path, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(max(1000, int(period * percent / 100))))

    def add(self, pids: list[int]) -> None:
        for pid in pids:
            _move(self.path, pid)

    def remove(self) -> None:
        """Moves the live processes back and removes the group once it is
        empty: a killed member stays in it until its parent (or init) reaps it."""
        if not os.path.isdir(self.path):
            return
        procs = os.path.join(self.path, "cgroup.procs")

        def emptied() -> bool:
            with open(procs) as f:
                for pid in f.read().split():
                    _move(CPU_ROOT, int(pid))
            with open(procs) as f:
                return not f.read().split()

        wait_for(emptied, 30, f"{self.path} to empty")
        os.rmdir(self.path)

    def __enter__(self) -> CpuCap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _move(group: str, pid: int) -> None:
    try:
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(pid))
    except ProcessLookupError:
        pass  # it ended meanwhile


def kill_mid_transfer(victim, holders: list, receivers: list[int], total: int,  # noqa: ANN001
                      what: str, *, percent: float, timeout_s: float = 120) -> int:
    """Caps the `holders` (agents, with their ranks) to `percent` of a core,
    waits until the `receivers` (rank pids) have received a quarter of the
    `total` bytes in flight, SIGKILLs `victim`'s node (agent and ranks) and
    lifts the cap. Asserts the kill came before three quarters had landed;
    returns the bytes received at the kill."""
    with CpuCap("holders", percent=percent) as cap:
        cap.add([p for agent in holders for p in node_processes(agent.pid)])
        received = wait_for(
            lambda: (n := sum(bytes_received(r) for r in receivers)) > total // 4 and n,
            timeout_s, f"a quarter of the {what} at the joiner", interval_s=0.02)
        victim.signal_node(signal.SIGKILL)
    print(f"node {victim.name} killed with {received} of {total} bytes at the joiner")
    assert received < total * 3 // 4, f"the kill came late: {received} bytes received"
    return received
