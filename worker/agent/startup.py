"""The node agent's start-up: the job check, the rendezvous store, the clock.

`check_job` runs before any rank starts, so a typo in ``--job``, a wrong
token or a coordinator that is not running is reported in seconds, not after
the script's own start-up (imports, data, model), and never as a silent wait.

Where a node's start-up goes (`StartupClock`, logged by the agent as one
``start-up:`` line): the agent's interpreter and imports, the job check, the
ranks' set-up (their interpreter, torch and the script up to ``Session()``),
the rendezvous store, the join. torch's import is the largest single part.
In library mode the agent does not import torch at all: it holds a listening
socket for the node's store (`StoreSocket`) and the process of local rank 0,
which has torch loaded anyway, serves the TCPStore on it
(`rendezvous.host_node_store`). In restart mode the agent itself uses its
store between generations, so `RendezvousStore` creates a TCPStore server in a
background thread while the ranks start.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from springback.client.channel import LOCAL_READ, Backoff
from springback.v1 import job_service_pb2 as js
from springback.v1 import job_service_pb2_grpc as js_grpc
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as wpb
from springback.v1 import worker_service_pb2_grpc as wgrpc

log = logging.getLogger("springback.agent")

ATTEMPT_TIMEOUT_S = 2.0
"""The start-up check's first GetJob deadline; each retry's doubles, up to
`MAX_ATTEMPT_TIMEOUT_S` (an answer that takes 3 s in a storm is waited for,
not abandoned and asked again)."""
MAX_ATTEMPT_TIMEOUT_S = 16.0
CHECK_BACKOFF_BASE_S = 0.25
CHECK_BACKOFF_CAP_S = 4.0
"""The start-up check's waits between attempts: full jitter, uniform in
[0, min(cap, base x 2**n)] (`Backoff`)."""
CHECK_LOG_EVERY = 4
"""The start-up check logs its first failure and then one line per this many."""
_TERMINAL = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)


RETRIED_JOIN_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})
"""JoinJob failures retried: no replica reachable, a join storm that outlasts
the call's deadline or fills a replica, and CANCELLED, which every call in
flight on a connection gets when the connection drops (e.g. a keepalive ping
not answered in time under load: 2,618 of 10,000 simulated joins at once in
bench/agent_scale.py). Safe because a retry carries the same join token."""


def join_job(stub: wgrpc.WorkerServiceStub, request: wpb.JoinJobRequest, *,
             deadline: float, attempt_timeout_s: float,
             drain_reason: Callable[[], str | None]) -> wpb.JoinJobResponse:
    """JoinJob, retried with jittered backoff on `RETRIED_JOIN_CODES` until
    the monotonic `deadline`. `request` carries one join token for all the
    attempts, so a retry after a lost reply gets the member the first attempt
    registered, not a second one. Raises the RpcError of a permanent failure
    (an unknown job, a bad token) or of the last attempt past the deadline,
    and `DrainedBeforeJoin` when `drain_reason()` names a drain between
    attempts."""
    backoff = Backoff(base_s=0.25, cap_s=4.0)
    while True:
        try:
            return stub.JoinJob(request, timeout=attempt_timeout_s)
        except grpc.RpcError as e:
            if e.code() not in RETRIED_JOIN_CODES or time.monotonic() > deadline:
                raise
            reason = drain_reason()
            if reason is not None:
                raise DrainedBeforeJoin(reason) from None
            log.warning("JoinJob: %s %s; retrying", e.code().name, e.details())
            time.sleep(backoff.next_s())  # jittered: replicas coming back are no herd


class DrainedBeforeJoin(Exception):
    """SIGTERM or a preemption notice arrived before the node joined."""


class JobFinished(Exception):
    """The job already ended: nothing to join (the agent exits 0)."""


class StartupRefused(Exception):
    """The start-up check failed: unknown job, bad token, unreachable
    coordinator, or --nnodes not matching the job. The message says why."""


def check_job(channel: grpc.Channel, *, job_id: str, target: str, connect_timeout_s: float,
              nnodes: tuple[int, int] | None,
              drain_reason: Callable[[], str | None]) -> pb.Job:
    """GetJob within `connect_timeout_s` overall; returns the job.

    The read carries `LOCAL_READ`: whichever replica it reaches answers from
    its own etcd read, without a forward to the leader, so the job may be a
    little stale (its step); its state and spec, all this check reads, are
    etcd's. `RETRIED_JOIN_CODES` (no replica reachable, an answer later
    than the attempt's deadline, a dropped connection, a full replica) are
    retried after a jittered wait (`CHECK_BACKOFF_BASE_S` doubling up to
    `CHECK_BACKOFF_CAP_S`), each attempt's deadline doubling from
    `ATTEMPT_TIMEOUT_S` up to `MAX_ATTEMPT_TIMEOUT_S`, neither past the
    connect timeout; one log line per `CHECK_LOG_EVERY` failures. Past the
    connect timeout: StartupRefused naming `target` and the last status.
    NOT_FOUND, UNAUTHENTICATED, PERMISSION_DENIED and any other refusal
    raise StartupRefused at once (the message carries the status). A
    terminal job raises JobFinished, a drain requested before an attempt
    DrainedBeforeJoin. Read-only: safe to repeat."""
    stub = js_grpc.JobServiceStub(channel)
    deadline = time.monotonic() + connect_timeout_s
    backoff = Backoff(base_s=CHECK_BACKOFF_BASE_S, cap_s=CHECK_BACKOFF_CAP_S)
    attempt_timeout_s = ATTEMPT_TIMEOUT_S
    num_failures = 0
    while True:
        reason = drain_reason()
        if reason is not None:
            raise DrainedBeforeJoin(reason)
        left = deadline - time.monotonic()
        try:
            job = stub.GetJob(js.GetJobRequest(job_id=job_id),
                              timeout=max(min(left, attempt_timeout_s), 0.1),
                              metadata=(LOCAL_READ,), wait_for_ready=True).job
            break
        except grpc.RpcError as e:
            if e.code() not in RETRIED_JOIN_CODES:
                raise StartupRefused(f"job {job_id!r} at {target}: {e.code().name}: "
                                     f"{e.details()}") from None
            num_failures += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise StartupRefused(
                    f"no coordinator answered at {target} within {connect_timeout_s:.0f}s "
                    f"({num_failures} attempts, the last {e.code().name}: {e.details()}); "
                    "is it running? (--coordinator / SPRINGBACK_COORDINATOR; a join storm "
                    "may need a longer --connect-timeout-s)") from None
            if num_failures % CHECK_LOG_EVERY == 1:
                log.warning("coordinator %s not answering (%s, %d attempts); retrying for "
                            "%.0fs more", target, e.code().name, num_failures, left)
            attempt_timeout_s = min(2 * attempt_timeout_s, MAX_ATTEMPT_TIMEOUT_S)
            time.sleep(min(backoff.next_s(), left))  # jittered: a storm's agents spread out
    if job.status.state in _TERMINAL:
        raise JobFinished(f"job {job.id} is {pb.JobState.Name(job.status.state)}: "
                          "nothing to join")
    check_nnodes(job, nnodes)
    return job


def check_nnodes(job: pb.Job, nnodes: tuple[int, int] | None) -> None:
    """torchrun's --nnodes MIN:MAX must be the job's (min_workers, max_workers)."""
    if nnodes is None:
        return
    want = (job.spec.min_workers, job.spec.max_workers)
    if tuple(nnodes) != want:
        lo, hi = nnodes
        raise StartupRefused(
            f"--nnodes {lo}:{hi} does not match job {job.id} (min_workers {want[0]}, "
            f"max_workers {want[1]}): change the job with "
            f"`springback job scale {job.id} --min {lo} --max {hi}` or drop --nnodes")


def listen_on(host: str) -> socket.socket:
    """A listening TCP socket on port 0 of the node's advertised address
    `host` (the address its peers reach it at), so the rendezvous store it
    serves is not reachable through the node's other interfaces. torch's
    TCPStore has no listen-address option (torch 2.13: its server binds every
    interface), but takes a socket that is already listening
    (``master_listen_fd``), which is how both modes serve it.

    Falls back to every interface (dual-stack where the host has IPv6), with
    a warning, when `host` is not an IP address literal (a name may resolve
    to several addresses, not all of them this node's) or not one of this
    node's addresses (behind NAT, or a service address): the ranks reach the
    store at `host` either way. Raises OSError only when no socket at all can
    be created."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None:
        family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
        try:
            return socket.create_server((str(address), 0), family=family,
                                        backlog=socket.SOMAXCONN)
        except OSError as e:
            why = f"{host} is not an address of this node ({e.strerror})"
    else:
        why = f"{host!r} is not an IP address"
    log.warning("the rendezvous store listens on every interface: %s (docs/security.md)", why)
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True,
                                    backlog=socket.SOMAXCONN)
    return socket.create_server(("0.0.0.0", 0), backlog=socket.SOMAXCONN)


def serve_store(host: str) -> Any:
    """A TCPStore server on port 0 of `host` (`listen_on`). The store owns
    the listening socket from then on (torch closes it when the store is
    destroyed, so Python must not: a second close could hit a reused fd).
    Raises what TCPStore raises."""
    import torch.distributed as dist

    listening = listen_on(host)
    address, port = self_address(listening), listening.getsockname()[1]
    fd = listening.detach()
    try:
        return dist.TCPStore(address, port, is_master=True, wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def self_address(listening: socket.socket) -> str:
    """Where a process on this node reaches the store listening on
    `listening`: its own address, or loopback for a wildcard socket."""
    host = listening.getsockname()[0]
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        v6_only = listening.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
        return "::1" if v6_only else "127.0.0.1"
    return host


class RendezvousStore:
    """Restart mode: the node's rendezvous store, a TCPStore server on port 0
    of `host` (`listen_on`) in the agent, created in a background thread from
    construction on.
    `get` blocks until it exists; raises RuntimeError (with the cause) when it
    could not be created. `close` drops it (its server stops with it)."""

    def __init__(self, host: str) -> None:
        self._host = host
        self._ready = threading.Event()
        self._store: Any = None
        self._error: BaseException | None = None
        threading.Thread(target=self._create, name="rendezvous-store", daemon=True).start()

    def _create(self) -> None:
        try:
            self._store = serve_store(self._host)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of get()
            self._error = e
        finally:
            self._ready.set()

    def get(self) -> Any:
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"the node's rendezvous store: {self._error}") from self._error
        return self._store

    def close(self) -> None:
        self._store = None


class StoreSocket:
    """The node's rendezvous address in library mode: a listening TCP socket
    on port 0 of the node's advertised address `host` (`listen_on`), held for
    the agent's life and inherited by every rank process (`fd`, as
    ``SPRINGBACK_STORE_FD``). The process of local rank 0 serves the TCPStore
    on it. Connections made while no process serves (the first rank still
    starting, or local rank 0 just crashed and its replacement not yet
    activated) wait in the socket's backlog instead of being refused, and are
    served once the next process of local rank 0 takes over. No torch here."""

    def __init__(self, host: str) -> None:
        self._socket = listen_on(host)
        self.port: int = self._socket.getsockname()[1]
        self.fd: int = self._socket.fileno()

    def close(self) -> None:
        self._socket.close()


def process_age_s() -> float:
    """Seconds since this process was started (Linux /proc; 0.0 elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


class StartupClock:
    """The durations of a node's start-up phases, from the process start."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self.phases: list[tuple[str, float]] = [("interpreter and agent imports",
                                                 process_age_s())]

    def done(self, phase: str) -> None:
        now = time.monotonic()
        self.phases.append((phase, now - self._last))
        self._last = now

    def summary(self) -> str:
        total = sum(s for _, s in self.phases)
        return ", ".join(f"{name} {s:.2f} s" for name, s in self.phases) + f"; total {total:.2f} s"
