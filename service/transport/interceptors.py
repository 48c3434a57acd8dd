"""Cross-cutting concerns of the coordinator's gRPC server, as interceptors
(authentication, the first of them, is `auth.BearerAuth`).

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
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from springback.client.channel import DEFAULT_TIMEOUT_S, LOCAL_READ, connect
from springback.client.errors import SpringbackError, grpc_code
from springback.client.polling import wait_until
from springback.service.etcd.election import Election
from springback.service.core.membership import validate_join
from springback.service.transport.auth import (
    API_PREFIX, FORWARDED, abort, with_caller_role,
)
from springback.v1 import worker_service_pb2 as ws

log = logging.getLogger(__name__)

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
        if (not method.startswith(API_PREFIX) or method in _SERVED_BY_ANY_REPLICA
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
            abort(context, grpc.StatusCode.UNAVAILABLE, why)
        return channel

    def _unary(self, method: str, metadata: list) -> Callable:
        checked = _CHECKED_BEFORE_FORWARDING.get(method)

        def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
            if checked is not None:
                try:
                    checked[1](checked[0].FromString(request))
                except SpringbackError as e:  # InvalidArgument: a bad field, named
                    abort(context, grpc_code(e), str(e))
                except DecodeError:
                    abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                           f"request: not a {checked[0].__name__}")
            call = self._leader_channel(context).unary_unary(method)
            self.num_forwarded += 1
            try:
                return call(request, metadata=with_caller_role(metadata),
                            timeout=context.time_remaining() or DEFAULT_TIMEOUT_S)
            except grpc.RpcError as e:
                abort(context, e.code(), e.details() or "")

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
                request, metadata=with_caller_role(metadata), timeout=context.time_remaining())
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
