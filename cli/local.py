"""A local etcd server, for `springback up`, the demo and the tests.

`EtcdServer` starts the ``etcd`` binary found on PATH (or $SPRINGBACK_ETCD)
with its data in a directory of ours, waits until it answers, and stops it.
The client and peer ports must be given: etcd cannot bind port 0 and report
it back, so callers pick free ones with `free_port` just before starting.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

from springback.client.polling import wait_until
from springback.client.errors import StoreUnavailable
from springback.service.store import Store

ENV_ETCD = "SPRINGBACK_ETCD"
"""Path of the etcd binary (default: `etcd` on PATH)."""


class EtcdNotFound(RuntimeError):
    pass


def etcd_binary() -> str:
    path = os.environ.get(ENV_ETCD) or shutil.which("etcd")
    if not path or not os.access(path, os.X_OK):
        raise EtcdNotFound(
            "no etcd binary: install one (Debian: apt-get install etcd-server) or set "
            f"{ENV_ETCD} to its path"
        )
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


PORT_ATTEMPTS = 3
"""Starts of an `EtcdServer` whose picked ports were taken meanwhile."""


class EtcdServer:
    """One etcd member on loopback, for laptops and tests: alone by default, or
    one member of a loopback cluster when `initial_cluster` names its peers
    (``name=http://HOST:PEER_PORT,…``, this member included)."""

    def __init__(self, data_dir: str, *, client_port: int | None = None,
                 peer_port: int | None = None, host: str = "127.0.0.1", name: str = "springback",
                 initial_cluster: str | None = None) -> None:
        self.data_dir = data_dir
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        # ports picked here may be taken by another process before etcd binds
        # them (nothing can hold a port for a child): such a start is retried
        # on fresh ones; ports the caller chose, or a cluster's, are not changed
        self._ports_ours = not client_port and not peer_port and initial_cluster is None
        self.name = name
        self.initial_cluster = initial_cluster
        self.process: subprocess.Popen | None = None
        self.log_path = os.path.join(data_dir, "etcd.log")

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def start(self, timeout_s: float = 20.0, *, wait: bool = True) -> None:
        """Starts etcd and (with `wait`) waits until it serves; raises on timeout
        (with its log's tail). A cluster's members must all be started before
        any serves: start them with ``wait=False``, then `wait_serving` each.
        When the ports were picked here and one was taken meanwhile (etcd
        exits: "address already in use"), starts again on fresh ports, up to
        `PORT_ATTEMPTS` times."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            mark = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
            self._spawn()
            if not wait:
                return
            try:
                self.wait_serving(timeout_s)
                return
            except RuntimeError:
                taken = "address already in use" in self._tail(since=mark)
                if not (taken and self._ports_ours and attempt < PORT_ATTEMPTS):
                    raise
            self.client_port, self.peer_port = free_port(self.host), free_port(self.host)

    def _spawn(self) -> None:
        os.makedirs(self.data_dir, exist_ok=True)
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        log = open(self.log_path, "ab")  # noqa: SIM115 (owned by the child)
        self.process = subprocess.Popen(
            [
                etcd_binary(), "--name", self.name,
                "--data-dir", os.path.join(self.data_dir, "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
            ],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()

    def wait_serving(self, timeout_s: float = 20.0) -> None:
        """Blocks until this member answers a (quorum) read; raises on timeout."""
        assert self.process is not None, "start() first"
        process = self.process
        store = Store(self.endpoint, timeout_s=1.0)

        def serving() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"etcd exited with {process.returncode}: {self._tail()}")
            try:
                store.get("/springback/v1/ping")
                return True
            except StoreUnavailable:
                return False

        try:
            if not wait_until(serving, timeout_s=timeout_s, interval_s=0.1):
                self.stop()
                raise RuntimeError(f"etcd did not start within {timeout_s}s: {self._tail()}")
        finally:
            store.close()

    def _tail(self, since: int = 0) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self, kill: bool = False) -> None:
        """Stops etcd (SIGKILL when `kill`, else SIGTERM); data stays for a restart."""
        if self.process is None or self.process.poll() is not None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
