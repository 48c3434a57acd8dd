"""Who may make which call: the coordinator's authentication interceptor
(`BearerAuth`, the first of the server's interceptors, see `interceptors` for
the others) and its role table.

`BearerAuth`: every call must carry ``authorization: Bearer <token>``
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
"""

from __future__ import annotations

import contextvars
import hmac
import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, NoReturn

import grpc

from springback.client.errors import SpringbackError, grpc_code
from springback.service.transport import credentials
from springback.service.transport.revocation import Revocation
from springback.v1 import job_service_pb2 as js
from springback.v1 import worker_service_pb2 as ws


FORWARDED = "x-springback-forwarded"
"""Marks a call a replica forwarded to the leader (`interceptors.LeaderForwarding`;
its value: the forwarding replica's address): it is not forwarded again."""
API_PREFIX = "/springback.v1."
"""What the method of every Springback call starts with."""


def _deny(code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, details)

    return grpc.unary_unary_rpc_method_handler(handler)


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
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
    service, name = method.removeprefix(API_PREFIX).split("/")
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
                abort(context, grpc.StatusCode.PERMISSION_DENIED, why)
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
            abort(context, grpc.StatusCode.PERMISSION_DENIED, why)
        yield from inner_stream(request, context)

    return handler._replace(unary_stream=stream_sync)


def with_caller_role(metadata: list) -> list:
    """`metadata`, with the certificate role `BearerAuth` found for this call."""
    role = _CALLER_ROLE.get()
    return [*metadata, (ROLE_HEADER, role)] if role else metadata
