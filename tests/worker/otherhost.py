"""Test helper: "another host" on this machine, a network namespace joined to
the root namespace by a veth pair (needs root and `ip`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class OtherHost:
    namespace: str
    address: str        # the other host's address
    node_address: str   # this machine's address on the link between them

    def command(self, *argv: str) -> list[str]:
        """`argv` run on the other host."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


@contextmanager
def other_host() -> Iterator[OtherHost]:
    """A namespace `sb<pid>` with 10.<a>.<b>.2/30, this machine 10.<a>.<b>.1,
    both unique to this process; removed on exit."""
    pid = os.getpid()
    ns, veth = f"sb{pid}", f"sbv{pid}"
    a, b = 200 + pid % 50, (pid // 50) % 250
    here, there = f"10.{a}.{b}.1", f"10.{a}.{b}.2"

    def ip(*argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=10)

    ip("netns", "add", ns)
    try:
        ip("link", "add", veth, "type", "veth", "peer", "name", veth + "p")
        ip("link", "set", veth + "p", "netns", ns)
        ip("addr", "add", f"{here}/30", "dev", veth)
        ip("link", "set", veth, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{there}/30", "dev", veth + "p")
        ip("netns", "exec", ns, "ip", "link", "set", veth + "p", "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield OtherHost(namespace=ns, address=there, node_address=here)
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
