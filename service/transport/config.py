"""What one coordinator replica is started with (`CoordinatorConfig`): its
etcd, listen addresses, tokens, TLS files and timeouts, checked when made. A
config that would expose job control or metrics to other hosts without a
token is refused (ValueError naming the field) unless ``insecure`` says so.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from springback.client import env as E
from springback.service.etcd.store import EtcdSecurity, parse_endpoints
from springback.service.policy.pacing import DEFAULT_BUDGET_PER_S
from springback.service.transport import credentials


@dataclass(kw_only=True)
class CoordinatorConfig:
    etcd: str
    """etcd endpoints, comma-separated (http://HOST:PORT,… or https://…)."""
    etcd_security: EtcdSecurity | None = None
    """TLS files and user/password for etcd (https:// endpoints need its CA)."""
    listen: str = "127.0.0.1:7070"
    """gRPC listen address; port 0 picks a free port."""
    advertise: str | None = None
    """Address other replicas reach this one at (default: the bound listen address)."""
    token: str | None = None
    """Bearer token required on every call (health checks excepted): the operator's."""
    viewer_token: str | None = None
    """A second token that may only read jobs (GetJob, ListJobs, WatchJob,
    ListCheckpoints, ListJobEvents) and the dashboard; needs `token`."""
    tls_cert: str | None = None
    """PEM server certificate; with tls_key enables TLS."""
    tls_key: str | None = None
    tls_client_ca: str | None = None
    """PEM CA for client certificates: enables mTLS (clients must present one)."""
    tls_roles: str | None = None
    """File mapping client-certificate subjects to roles (``CN=<name>:<role>``
    or ``SAN=<name>:<role>`` lines, roles operator / viewer / replica): a call
    without a bearer token has its certificate's role, none if unmapped
    (PERMISSION_DENIED). Needs `tls_client_ca`."""
    liveness_timeout_s: float = 5.0
    """A member that has not heartbeaten for this long is failed (>= 2, etcd lease granularity)."""
    heartbeat_budget_per_s: float = DEFAULT_BUDGET_PER_S
    """Heartbeats per second this replica aims to serve: members are told a
    longer interval as their number grows, up to half the liveness timeout
    (`pacing`)."""
    leader_ttl_s: int = 3
    """Leader lease TTL: a dead leader is replaced within about this long."""
    progress_flush_s: float = 5.0
    """Reported progress is written to etcd at most this often."""
    metrics_listen: str | None = None
    """HOST:PORT for the Prometheus endpoint (/metrics) and the dashboard (/),
    both behind `token` (or `viewer_token`) when there is one; None: off. An
    address other hosts can reach needs `token` (or `insecure`)."""
    metrics_tls_cert: str | None = None
    """PEM certificate: with metrics_tls_key, the metrics listener serves
    HTTPS (and the dashboard's session cookie is Secure)."""
    metrics_tls_key: str | None = None
    max_workers: int = 256
    """gRPC server threads for unary calls and WatchJob streams (plan and
    health streams run on the server's asyncio loop and hold none)."""
    drain_s: float = 0.0
    """On stop: seconds of NOT_SERVING (as a follower) before the server stops,
    so health checks and load balancers see the replica leave. The CLI's
    ``--drain-s`` defaults to 5."""
    client_keepalive_s: float = 30.0
    """The server pings each client connection every this long and closes it
    when a ping is not answered within as long again. A client that vanished
    without closing its TCP connection (a node powered off, a link cut) thus
    frees its connection and its WatchPlans stream within about twice this,
    not gRPC's default of 2 h 20 s (10,000 connections cost ~330 pings/s,
    answered in gRPC's core)."""
    insecure: bool = False
    """Accept a `listen` or `metrics_listen` address other hosts can reach
    without a `token` (refused otherwise: anyone reaching the port could
    control every job, or read every job's metrics)."""

    def __post_init__(self) -> None:
        if not self.etcd:
            raise ValueError("etcd: at least one endpoint is required")
        parse_endpoints(self.etcd, self.etcd_security)  # InvalidArgument("etcd", …)
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"listen: {self.listen!r} is not HOST:PORT")
        credentials.check_token(self.token, "--token")
        credentials.check_token(self.viewer_token, "--viewer-token")
        if self.viewer_token and (not self.token or self.viewer_token == self.token):
            raise ValueError("viewer_token: needs a token (the operator's) that differs from it")
        if self.tls_roles and not self.tls_client_ca:
            raise ValueError("tls_roles: maps client certificates, so it needs tls_client_ca")
        if not self.token and not self.tls_roles and not self.insecure and not _loopback(host):
            raise ValueError(
                f"listen: {self.listen!r} is reachable from other hosts and the coordinator has "
                "no token, so anyone who reaches it could control every job: give --token (or "
                f"{E.TOKEN}), listen on 127.0.0.1, or pass --insecure to accept that")
        if self.metrics_listen is not None:
            metrics_host, _, metrics_port = self.metrics_listen.rpartition(":")
            if not metrics_host or not metrics_port.isdigit():
                raise ValueError(f"metrics_listen: {self.metrics_listen!r} is not HOST:PORT")
            # client certificates (tls_roles) guard the gRPC port only: the
            # HTTP listener knows bearer tokens alone
            if not self.token and not self.insecure and not _loopback(metrics_host):
                raise ValueError(
                    f"metrics_listen: {self.metrics_listen!r} is reachable from other hosts and "
                    "the coordinator has no token, so anyone who reaches it could read every "
                    "job's metrics and dashboard: give --token (or SPRINGBACK_TOKEN), use "
                    "--metrics-listen 127.0.0.1:PORT, or pass --insecure to accept that")
        if self.liveness_timeout_s < 2:
            raise ValueError(f"liveness_timeout_s: {self.liveness_timeout_s} is below 2 s "
                             "(etcd lease granularity)")
        if self.heartbeat_budget_per_s <= 0:
            raise ValueError(f"heartbeat_budget_per_s: {self.heartbeat_budget_per_s} must be "
                             "positive")
        if self.client_keepalive_s <= 0:
            raise ValueError(f"client_keepalive_s: {self.client_keepalive_s} must be positive")
        if self.drain_s < 0:
            raise ValueError(f"drain_s: {self.drain_s} is negative")
        if self.leader_ttl_s < 2:
            raise ValueError(f"leader_ttl_s: {self.leader_ttl_s} is below 2 s")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key: give both or neither")
        if bool(self.metrics_tls_cert) != bool(self.metrics_tls_key):
            raise ValueError("metrics_tls_cert and metrics_tls_key: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca: mTLS needs tls_cert and tls_key too")


def _loopback(host: str) -> bool:
    """Whether `host` (of a listen address) is reachable from this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere
