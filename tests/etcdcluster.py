"""A real etcd cluster of several members on loopback, for fault tests.

Each member is a `springback.cli.local.EtcdServer` process with its own
data directory and ports; `kill` and `start` one to lose it and bring it back
(its data stays), `raft_leader` says which member leads raft now. With
`tls` every member serves https:// with client certificates and, given a
password, etcd's auth is enabled once the cluster serves (see `EtcdServer`).
"""

from __future__ import annotations

import os

import etcd3

from springback.cli.local import EtcdServer, EtcdServerTls
from springback.service.etcd.store import EtcdSecurity


class EtcdCluster:
    def __init__(self, directory: str, size: int = 3, *, tls: EtcdServerTls | None = None) -> None:
        self.members = [
            EtcdServer(os.path.join(directory, f"etcd-{i}"), name=f"etcd-{i}", tls=tls)
            for i in range(size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for member in self.members:
            member.initial_cluster = initial

    @property
    def endpoints(self) -> str:
        """Every member's client URL, comma-separated (a Store's `endpoints`)."""
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout_s: float = 30.0) -> None:
        for member in self.members:  # none serves before a quorum has started
            member.start(wait=False)
        for member in self.members:
            member.wait_serving(timeout_s)
        first = self.members[0]
        if first.tls is not None and first.tls.password is not None and not first.auth_enabled:
            first.enable_auth()  # cluster-wide
            for member in self.members:
                member.auth_enabled = True

    @property
    def client_security(self) -> EtcdSecurity | None:
        """What a Store or coordinator needs to reach the cluster (None: plain http)."""
        return self.members[0].client_security

    def coordinator_flags(self) -> list[str]:
        """``springback coordinator`` flags for `client_security`."""
        return self.members[0].coordinator_flags()

    def raft_leader(self) -> EtcdServer:
        """The member that leads raft now (asked of a live member)."""
        for member in self.members:
            if member.process is None or member.process.poll() is not None:
                continue
            security = member.client_security or EtcdSecurity()
            client = etcd3.client(member.host, member.client_port, timeout=2,
                                  ca_cert=security.ca_file, cert_key=security.key_file,
                                  cert_cert=security.cert_file, user=security.user,
                                  password=security.password)
            try:
                leader = client.status().leader
            finally:
                client.close()
            return next(m for m in self.members if m.name == leader.name)
        raise RuntimeError("no etcd member is running")

    def stop(self) -> None:
        for member in self.members:
            member.stop(kill=True)
