"""Cross-cutting concerns of the coordinator's gRPC server, as interceptors.

* `BearerAuth`: every call must carry ``authorization: Bearer <token>``
  (compared in constant time); others get UNAUTHENTICATED before any handler
  runs, so they change nothing. Health checks are exempt so that load
  balancers and Kubernetes probes, which cannot send a token, work. Roles:
  the operator's token opens every call but the replicas' own; the viewer
  token (optional) only `VIEWER_METHODS`, the reads of the job API; the
  replica credential (`credentials`, derived from the operator token) only
  `credentials.REPLICA_METHODS`; a member credential (issued by `JoinJob`)
  opens only `MEMBER_METHODS`, and only for the job and member it names (the
  request is read to check, also a raw one about to be forwarded to the
  leader, which checks it again), and only while that member has not been
  fenced (`revocation`: UNAUTHENTICATED, "join again", before the handler);
  a job's join credential only `credentials.JOIN_METHODS` of that job. With ``tls_roles`` (``--tls-roles``), a
  call without a bearer token takes the role its client certificate's CN or
  SAN maps to; an unmapped certificate has none. Anything else is
  PERMISSION_DENIED naming the role that would be needed, before the handler
  runs. A follower forwarding a certificate caller's call tells the leader
  the role it found (`ROLE_HEADER`): the leader sees only the follower's
  certificate, and believes the header only when that maps to replica.
* `LeaderForwarding`: on a replica that is not the leader, Springback calls
  are relayed, as raw bytes, to the leader with the caller's metadata and
  remaining deadline; the leader's status comes back unchanged. A call that
  was already forwarded once is not forwarded again (it fails UNAVAILABLE),
  so two replicas with stale views cannot bounce a call between them.
  A call that arrives while no replica leads (an election under way) waits
  for one, up to `LEADER_WAIT_S` and within the call's own deadline, and
  only then fails UNAVAILABLE: a call made just after a failover, or while
  the first leader is being elected, is served instead of refused (clients
  do not retry `CreateJob`).
  A join (`JoinJob`) is checked before it is forwarded (`membership.validate_join`):
  a bad field is INVALID_ARGUMENT from the replica it reached, without a
  round trip to the leader or a wait for one (the leader checks again, and
  cuts members' free text, see `servicers.member_text`).
  Heartbeats are not forwarded: any replica renews a member's lease in etcd
  itself, so members stay alive while leadership changes hands (a replica
  that cannot reach etcd refuses them at once, see `liveness`). Plan streams
  are not forwarded either: every replica serves them from its own etcd
  watch (`planstreams`), so agents spread over the replicas and a failover
  drops only the streams of the replica that went away. A ``GetJob`` that
  carries `channel.LOCAL_READ` (the agents' start-up check) is not forwarded
  either: the replica answers it from its own etcd read, which may lag the
  leader's in-memory step (never the job's spec or state, which only etcd
  holds), so a join storm's start-up reads cost the leader nothing and are
  answered while it is being elected; authorization is the same
  (`BearerAuth` runs first). These are asyncio
  interceptors (the server is `grpc.aio`); forwarding handlers are plain
  functions, run on the server's worker threads.
* `CallCounter`: counts calls per method for the metrics endpoint; only
  methods the server registers are counted (a caller sending random method
  names cannot grow the metrics' label set), and it runs after `BearerAuth`,
  so unauthenticated calls are not counted either.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import inspect
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent import futures
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from springback.client.channel import DEFAULT_TIMEOUT_S, LOCAL_READ, connect
from springback.client.errors import SpringbackError, grpc_code
from springback.client.polling import wait_until
from springback.service.transport import credentials
from springback.service.etcd.election import Election
from springback.service.core.membership import validate_join
from springback.service.transport.revocation import Revocation
from springback.v1 import job_service_pb2 as js
from springback.v1 import worker_service_pb2 as ws

log = logging.getLogger(__name__)

FORWARDED = "x-springback-forwarded"
_API_PREFIX = "/springback.v1."
_STREAMS = frozenset({"/springback.v1.JobService/WatchJob"})
_PASSED_METADATA = ("authorization",)
_SERVED_BY_ANY_REPLICA = frozenset({
    "/springback.v1.WorkerService/Heartbeat",
    "/springback.v1.WorkerService/WatchPlans",
})
_LOCAL_READS = frozenset({"/springback.v1.JobService/GetJob"})
"""Reads a replica answers itself when the call carries `LOCAL_READ`."""


def _check_join(request: ws.JoinJobRequest) -> None:
    validate_join(request.host, request.rendezvous_port, request.num_local_ranks,
                  request.join_token)


_CHECKED_BEFORE_FORWARDING: dict[str, tuple[Any, Callable[[Any], None]]] = {
    "/springback.v1.WorkerService/JoinJob": (ws.JoinJobRequest, _check_join),
}
"""Per method: its request type and a check (raising `InvalidArgument`, no
I/O) that a follower runs on the raw request before forwarding it."""


def _deny(code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, details)

    return grpc.unary_unary_rpc_method_handler(handler)


_END = object()

LEADER_WAIT_S = 5.0
"""How long a call waits for a leader to be elected before it fails
UNAVAILABLE (less when its deadline is nearer): above the default leader TTL
(3 s) plus a campaign interval, the longest a failover takes."""


async def in_thread(pool: futures.ThreadPoolExecutor, items: Iterable[Any]) -> AsyncIterator[Any]:
    """`items` (a blocking iterator) read on `pool`, one item at a time, on the loop."""
    iterator: Iterator[Any] = iter(items)
    loop = asyncio.get_running_loop()
    while (item := await loop.run_in_executor(pool, next, iterator, _END)) is not _END:
        yield item


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """`context.abort` of a synchronous handler, which always raises; typed so
    the checker knows."""
    context.abort(code, details)
    raise AssertionError("grpc's ServicerContext.abort returned")


VIEWER_METHODS = frozenset(f"/springback.v1.JobService/{name}" for name in (
    "GetJob", "ListJobs", "WatchJob", "ListCheckpoints", "ListJobEvents"))
"""The calls the viewer token may make: reading jobs, never changing them."""


ROLE_HEADER = "x-springback-role"
"""On a forwarded call: the role the forwarding replica found for a caller
that authenticated by certificate (no bearer token travels then). The leader
believes it only from a peer whose own certificate maps to the replica role."""

_CALLER_ROLE: contextvars.ContextVar[str] = contextvars.ContextVar("caller_role", default="")
"""The certificate role `BearerAuth` found for the call being handled, read by
`LeaderForwarding` to pass it on (`ROLE_HEADER`)."""


def _needed(method: str) -> str:
    if method in credentials.REPLICA_METHODS:
        return ("the replica role (the replicas' own credential, or a client certificate "
                "mapped to replica)")
    operator = "the operator role (the coordinator's token, or a client certificate mapped to operator)"
    if method in credentials.JOIN_METHODS:
        return f"{operator}, or the job's join credential"
    return operator


def _allowed(role: str, method: str) -> bool:
    if role == "operator":
        return method not in credentials.REPLICA_METHODS
    if role == "viewer":
        return method in VIEWER_METHODS
    return role == "replica" and method in credentials.REPLICA_METHODS


_WHAT = {"operator": "the operator token",
         "viewer": "the viewer token, which only reads jobs",
         "replica": "the replica credential, which only relays what replicas tell the leader"}


class BearerAuth(grpc.aio.ServerInterceptor):
    """Roles from the bearer token or, with `tls_roles`, the client
    certificate (see the module docstring). Failure semantics: a refused call
    never reaches its handler, so it changes nothing; UNAUTHENTICATED for no
    or a wrong token (and no certificate roles) or the member credential of a
    fenced member, UNAVAILABLE when checking that needed etcd and etcd did not
    answer, PERMISSION_DENIED naming the role needed (and the certificate
    subject, for an unmapped one)."""

    def __init__(self, token: str | None, viewer_token: str | None = None,
                 tls_roles: dict[tuple[str, str], str] | None = None) -> None:
        if not token and not tls_roles:
            raise ValueError("token: must not be empty (unless tls_roles maps certificates)")
        self._token = token or ""
        self._expected = f"Bearer {token}".encode() if token else None
        self._viewer = f"Bearer {viewer_token}".encode() if viewer_token else None
        self._replica = (f"Bearer {credentials.replica_credential(token)}".encode()
                         if token else None)
        self._tls_roles = tls_roles or {}
        self.revocation: Revocation | None = None
        """Set by the server once its coordinator exists: member credentials
        of fenced members are then refused (`revocation`)."""

    def _bearer_role(self, sent: bytes) -> str:
        # every token compared, in constant time each: no early exit on a match
        matches = [role for role, expected in (("operator", self._expected),
                                               ("viewer", self._viewer),
                                               ("replica", self._replica))
                   if expected is not None and hmac.compare_digest(sent, expected)]
        return matches[0] if matches else ""

    async def intercept_service(self, continuation: Callable,
                                details: grpc.HandlerCallDetails) -> Any:
        method = details.method
        if method.startswith("/grpc.health.v1."):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        sent = metadata.get("authorization", "")
        if not isinstance(sent, str):
            sent = ""
        role = self._bearer_role(sent.encode())
        if role:
            if _allowed(role, method):
                return await continuation(details)
            return _deny(grpc.StatusCode.PERMISSION_DENIED,
                         f"{method} needs {_needed(method)}; this is {_WHAT[role]}")
        member = (credentials.member_of(self._token, sent.removeprefix("Bearer "))
                  if self._token else None)
        if member is not None:
            if method not in credentials.MEMBER_METHODS:
                return _deny(grpc.StatusCode.PERMISSION_DENIED,
                             f"{method} needs {_needed(method)}; this is the member credential "
                             f"of member {member.member_id!r} of job {member.job_id!r}, which "
                             "makes only that member's own calls")
            if self.revocation is not None:
                try:
                    why = await self.revocation.refusal(member)
                except SpringbackError as e:  # StoreUnavailable: retry another replica
                    return _deny(grpc_code(e), str(e))
                if why is not None:
                    return _deny(grpc.StatusCode.UNAUTHENTICATED, why)
            handler = await continuation(details)
            return None if handler is None else _bound(handler, method, member.job_id,
                                                       member.member_id)
        joining = (credentials.job_joined_by(self._token, sent.removeprefix("Bearer "))
                   if self._token else None)
        if joining is not None:
            if method not in credentials.JOIN_METHODS:
                return _deny(grpc.StatusCode.PERMISSION_DENIED,
                             f"{method} needs {_needed(method)}; this is the join credential "
                             f"of job {joining!r}, which only joins and reads that job")
            handler = await continuation(details)
            return None if handler is None else _joining(handler, method, joining)
        if sent or not self._tls_roles:
            return _deny(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        # No token: the role is the client certificate's, known only to the
        # handler's context (the interceptor sees the method and metadata only).
        handler = await continuation(details)
        forwarded_role = metadata.get(ROLE_HEADER, "") if FORWARDED in metadata else ""

        def refusal(request: Any, context: grpc.ServicerContext) -> str | None:
            role, subject = self.certificate_role(context)
            if role == "replica" and forwarded_role in credentials.TLS_ROLES:
                role = str(forwarded_role)  # a replica relaying a certificate caller's call
            if not role:
                return (f"{method} needs {_needed(method)}; the client certificate "
                        f"({subject or 'none'}) maps to no role in --tls-roles")
            if not _allowed(role, method):
                return (f"{method} needs {_needed(method)}; the client certificate "
                        f"({subject}) maps to the {role} role")
            _CALLER_ROLE.set(role)
            return None

        return None if handler is None else _checked(handler, refusal)

    def certificate_role(self, context: grpc.ServicerContext) -> tuple[str, str]:
        """(role, subject) of the call's client certificate: the role of its
        subject CN if mapped, else of its first mapped SAN; ``""`` for none."""
        peer = context.auth_context() or {}
        names = [("CN", n.decode(errors="replace")) for n in peer.get("x509_common_name", ())]
        names += [("SAN", n.decode(errors="replace"))
                  for n in peer.get("x509_subject_alternative_name", ())]
        subject = ", ".join(f"{kind}={name}" for kind, name in names)
        for name in names:
            if name in self._tls_roles:
                return self._tls_roles[name], subject
        return "", subject


def _request_type(method: str) -> Any:
    """The request message of a Springback `method` (``/springback.v1.<Service>/<Name>``)."""
    service, name = method.removeprefix(_API_PREFIX).split("/")
    module = ws if service == "WorkerService" else js
    return getattr(module, name + "Request")


def _joining(handler: grpc.RpcMethodHandler, method: str,
             job_id: str) -> grpc.RpcMethodHandler:
    """`handler`, refusing (PERMISSION_DENIED) a request for another job than
    the join credential's (a raw request, about to be forwarded, is parsed)."""
    request_type = _request_type(method)

    def refusal(request: Any, context: grpc.ServicerContext) -> str | None:
        if isinstance(request, bytes):
            request = request_type.FromString(request)
        if request.job_id == job_id:
            return None
        return (f"the join credential of job {job_id!r} cannot act on job "
                f"{request.job_id!r}: that needs that job's own join credential or "
                "the operator role")

    return _checked(handler, refusal)


def _bound(handler: grpc.RpcMethodHandler, method: str, job_id: str,
           member_id: str) -> grpc.RpcMethodHandler:
    """`handler`, refusing (PERMISSION_DENIED) a request that names another
    job or member than the credential's (a raw request, about to be
    forwarded, is parsed to check)."""
    request_type = _request_type(method)

    def refusal(request: Any, context: grpc.ServicerContext) -> str | None:
        if isinstance(request, bytes):
            request = request_type.FromString(request)
        if request.job_id == job_id and request.member_id == member_id:
            return None
        return (f"the member credential of member {member_id!r} of job {job_id!r} cannot act "
                f"for member {request.member_id!r} of job {request.job_id!r}: that needs "
                "that member's own credential or the operator role")

    return _checked(handler, refusal)


def _checked(handler: grpc.RpcMethodHandler,
             refusal: Callable[[Any, Any], str | None]) -> grpc.RpcMethodHandler:
    """`handler`, first asking ``refusal(request, context)``: a reason
    aborts the call PERMISSION_DENIED before the handler runs."""
    if handler.unary_unary is not None:
        inner = handler.unary_unary
        if inspect.iscoroutinefunction(inner):
            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if (why := refusal(request, context)) is not None:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
                return await inner(request, context)

            return handler._replace(unary_unary=unary)

        def unary_sync(request: Any, context: grpc.ServicerContext) -> Any:
            if (why := refusal(request, context)) is not None:
                _abort(context, grpc.StatusCode.PERMISSION_DENIED, why)
            return inner(request, context)

        return handler._replace(unary_unary=unary_sync)
    inner_stream = handler.unary_stream
    if inspect.isasyncgenfunction(inner_stream):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if (why := refusal(request, context)) is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            async for item in inner_stream(request, context):
                yield item

        return handler._replace(unary_stream=stream)

    def stream_sync(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        if (why := refusal(request, context)) is not None:
            _abort(context, grpc.StatusCode.PERMISSION_DENIED, why)
        yield from inner_stream(request, context)

    return handler._replace(unary_stream=stream_sync)


def _with_role(metadata: list) -> list:
    """`metadata`, with the certificate role `BearerAuth` found for this call."""
    role = _CALLER_ROLE.get()
    return [*metadata, (ROLE_HEADER, role)] if role else metadata


class LeaderForwarding(grpc.aio.ServerInterceptor):
    def __init__(self, election: Election, stream_pool: futures.ThreadPoolExecutor) -> None:
        self._election = election
        self._stream_pool = stream_pool
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self.num_forwarded = 0

    async def intercept_service(self, continuation: Callable,
                                details: grpc.HandlerCallDetails) -> Any:
        method = details.method
        if (not method.startswith(_API_PREFIX) or method in _SERVED_BY_ANY_REPLICA
                or self._election.is_leader()):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if method in _LOCAL_READS and metadata.get(LOCAL_READ[0]) == LOCAL_READ[1]:
            return await continuation(details)
        if FORWARDED in metadata:
            return await continuation(details)  # the servicer answers NotLeader (UNAVAILABLE)
        outgoing = [(k, v) for k, v in metadata.items() if k in _PASSED_METADATA]
        outgoing.append((FORWARDED, self._election.address))
        if method in _STREAMS:
            return grpc.unary_stream_rpc_method_handler(self._stream(method, outgoing))
        return grpc.unary_unary_rpc_method_handler(self._unary(method, outgoing))

    def _find_leader(self, wait_s: float) -> tuple[grpc.Channel | None, str]:
        """A channel to the leader, or None and why not. Blocking: etcd reads,
        and while no replica leads (none elected yet, or this one just won and
        is taking office) a wait of up to `wait_s` for one to."""
        found: list[str] = []

        def leader_elsewhere() -> bool:
            if self._election.is_leader():
                found[:] = [self._election.address]
                return True
            # fresher after the first look (a cached "none" may predate the election),
            # yet shared by every waiting call: at most ten etcd reads a second
            leader = self._election.leader_address(max_age_s=0.5 if not found else 0.1)
            found[:] = [leader or ""]
            return bool(leader) and leader != self._election.address

        try:
            wait_until(leader_elsewhere, timeout_s=wait_s, interval_s=0.05)
        except SpringbackError as e:
            return None, f"cannot find the leader: {e}"
        leader = found[0] if found else ""
        # this replica may have taken office meanwhile: the call then goes to
        # its own address, where it is served (a leader serves forwarded calls)
        if not leader or (leader == self._election.address and not self._election.is_leader()):
            return None, "no coordinator leader elected yet; retry"
        with self._lock:
            channel = self._channels.get(leader)
            if channel is None:
                # TLS to the leader comes from SPRINGBACK_TLS_* like any client's;
                # the caller's own token travels in the forwarded metadata.
                channel = self._channels[leader] = connect([leader], token="")
        return channel, ""

    @staticmethod
    def _leader_wait_s(context: grpc.ServicerContext) -> float:
        """How long a call may wait for a leader: LEADER_WAIT_S, less the
        half second its reply needs before the caller's deadline."""
        remaining = context.time_remaining()
        return LEADER_WAIT_S if remaining is None else max(0.0, min(LEADER_WAIT_S,
                                                                     remaining - 0.5))

    def _leader_channel(self, context: grpc.ServicerContext) -> grpc.Channel:
        channel, why = self._find_leader(self._leader_wait_s(context))
        if channel is None:
            _abort(context, grpc.StatusCode.UNAVAILABLE, why)
        return channel

    def _unary(self, method: str, metadata: list) -> Callable:
        checked = _CHECKED_BEFORE_FORWARDING.get(method)

        def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
            if checked is not None:
                try:
                    checked[1](checked[0].FromString(request))
                except SpringbackError as e:  # InvalidArgument: a bad field, named
                    _abort(context, grpc_code(e), str(e))
                except DecodeError:
                    _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                           f"request: not a {checked[0].__name__}")
            call = self._leader_channel(context).unary_unary(method)
            self.num_forwarded += 1
            try:
                return call(request, metadata=_with_role(metadata),
                            timeout=context.time_remaining() or DEFAULT_TIMEOUT_S)
            except grpc.RpcError as e:
                _abort(context, e.code(), e.details() or "")

        return forward

    def _stream(self, method: str, metadata: list) -> Callable:
        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            # The leader's stream is read on a thread of the stream pool, one
            # message at a time, and sent from the loop (operators' streams: few).
            channel, why = await asyncio.to_thread(self._find_leader,
                                                   self._leader_wait_s(context))
            if channel is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, why)
                return  # abort raised already
            call = channel.unary_stream(method)(
                request, metadata=_with_role(metadata), timeout=context.time_remaining())
            self.num_forwarded += 1
            try:
                async for response in in_thread(self._stream_pool, call):
                    yield response
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    await context.abort(e.code(), e.details() or "")
            finally:
                call.cancel()

        return forward

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


class CallCounter(grpc.aio.ServerInterceptor):
    def __init__(self, methods: Iterable[str]) -> None:
        self.calls: Counter[str] = Counter()
        self._methods = frozenset(methods)

    async def intercept_service(self, continuation: Callable,
                                details: grpc.HandlerCallDetails) -> Any:
        if details.method in self._methods:
            self.calls[details.method] += 1
        return await continuation(details)
