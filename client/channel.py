"""Client-side gRPC channels to a set of coordinator replicas.

Every replica serves every call (non-leaders forward to the leader), so a
client only needs *a* live replica. `connect` returns a channel that
round-robins over the given addresses, skips a replica while its gRPC health
says NOT_SERVING (it is draining, or cannot reach etcd and refuses
heartbeats), and retries UNAVAILABLE (on the next replica) for the
calls listed as idempotent in the service config; non-idempotent calls are
never retried by the channel (a caller that wants to retry one must know it is
safe). Deadlines are the caller's: every stub call must pass ``timeout=``.

Retries spread out: the channel's own retries back off exponentially with
gRPC's built-in jitter (each delay uniform in [0, the current backoff]), and
callers that retry a call or re-open a stream themselves use `Backoff` (the
same "full jitter"), so thousands of agents whose replica restarted or is
overloaded do not come back in step.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence

import grpc

from springback.client import env as E


MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Send/receive limit on both sides; a plan for 10,000 members fits well within it."""

DEFAULT_TIMEOUT_S = 10.0
"""Deadline for a unary call when the caller has no better bound."""

LOCAL_READ = ("x-springback-local-read", "1")
"""Call metadata asking that a read be answered by whichever replica it
reaches, from that replica's own etcd read, instead of being forwarded to
the leader (only ``GetJob`` honours it, see `service.interceptors`). The
answer may be slightly stale: a job's step lags the leader's by up to its
progress flush interval; spec and state are etcd's. Agents' start-up check
sends it, so a join storm's reads spread over the replicas and are answered
while the leader is busy or being elected."""

# Calls that are safe to repeat: reads, and writes whose repetition converges to
# the same state (heartbeats, leaving twice, setting the same scale).
_IDEMPOTENT = {
    "springback.v1.JobService": [
        "GetJob", "ListJobs", "ScaleJob", "PauseJob", "ResumeJob", "CancelJob",
        "ListCheckpoints",
    ],
    "springback.v1.WorkerService": [
        "Heartbeat", "LeaveJob", "ReportStep", "CommitCheckpoint", "ReportCheckpointError",
    ],
}


def _service_config() -> str:
    names = [
        {"service": service, "method": method}
        for service, methods in _IDEMPOTENT.items()
        for method in methods
    ]
    return json.dumps({
        "loadBalancingConfig": [{"round_robin": {}}],
        # Client-side health checking: a replica whose health is NOT_SERVING
        # (draining, or cut off from etcd) is skipped until it serves again.
        "healthCheckConfig": {"serviceName": ""},
        "methodConfig": [{
            "name": names,
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.1s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }],
    })


def _addresses_target(addresses: Sequence[str]) -> str:
    if len(addresses) == 1:
        return addresses[0]
    # ipv4:/ipv6: targets accept a list; only literal IPs are allowed there.
    return "ipv4:" + ",".join(addresses)


def parse_addresses(value: str | Sequence[str] | None) -> list[str]:
    """Addresses from a comma-separated string, a list, or $SPRINGBACK_COORDINATOR.

    Raises ValueError naming the variable when nothing is configured.
    """
    if value is None:
        value = os.environ.get(E.COORDINATOR, "")
    if isinstance(value, str):
        value = value.split(",")
    addresses = [a.strip() for a in value if a.strip()]
    if not addresses:
        raise ValueError(
            f"no coordinator address: pass --coordinator HOST:PORT or set {E.COORDINATOR}"
        )
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"coordinator address {address!r} is not HOST:PORT")
    return addresses


def read_file(path: str | None) -> bytes | None:
    """A PEM (or any) file's bytes; None for no path."""
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


class _BearerAuth(grpc.AuthMetadataPlugin):
    def __init__(self, token: str) -> None:
        self._token = token

    def __call__(self, context, callback) -> None:  # noqa: ANN001 (grpc signature)
        callback((("authorization", f"Bearer {self._token}"),), None)


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the bearer token on plaintext channels (call credentials need TLS)."""

    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    def _details(self, details):  # noqa: ANN001, ANN202
        metadata = list(details.metadata or []) + [self._metadata]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)


def connect(
    addresses: str | Sequence[str] | None = None,
    *,
    token: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> grpc.Channel:
    """A channel to the coordinator replicas; see the module docstring.

    `token`, `tls_ca`, `tls_cert`, `tls_key` default to their SPRINGBACK_*
    environment variables. The channel connects lazily: this never blocks.
    """
    target = _addresses_target(parse_addresses(addresses))
    token = token if token is not None else os.environ.get(E.TOKEN) or None
    tls_ca = tls_ca or os.environ.get(E.TLS_CA)
    tls_cert = tls_cert or os.environ.get(E.TLS_CERT)
    tls_key = tls_key or os.environ.get(E.TLS_KEY)
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", _service_config()),
        ("grpc.keepalive_time_ms", 10_000),
        # gRPC's reconnect backoff grows 1 s x 1.6^n: after a 2 s outage the
        # next try came ~5 s in, past a 5 s liveness timeout. Tries at most
        # 1 s (+-20 % jitter) apart: a blip costs an agent about itself.
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 1_000),
    ]
    if tls_ca:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=read_file(tls_ca),
            private_key=read_file(tls_key),
            certificate_chain=read_file(tls_cert),
        )
        if token:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.metadata_call_credentials(_BearerAuth(token))
            )
        return grpc.secure_channel(target, credentials, options=options)
    channel = grpc.insecure_channel(target, options=options)
    if token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(token))
    return channel


class Backoff:
    """Exponential backoff with full jitter for a caller's own retries.

    The n-th delay (from 0) is uniform in [0, min(``cap_s``, ``base_s`` * 2**n)];
    `reset` after a success. Not thread-safe (one per retry loop)."""

    def __init__(self, base_s: float = 0.1, cap_s: float = 2.0,
                 uniform: Callable[[float, float], float] = random.uniform) -> None:
        if base_s <= 0 or cap_s < base_s:
            raise ValueError(f"Backoff: need 0 < base_s <= cap_s, got {base_s}, {cap_s}")
        self.base_s, self.cap_s = base_s, cap_s
        self._uniform = uniform
        self._attempt = 0

    def next_s(self) -> float:
        """The next delay in seconds (and one more attempt counted)."""
        ceiling = min(self.cap_s, self.base_s * 2 ** min(self._attempt, 32))
        self._attempt += 1
        return self._uniform(0.0, ceiling)

    def reset(self) -> None:
        self._attempt = 0
