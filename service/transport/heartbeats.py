"""Heartbeats served on the replica's asyncio loop, renewing leases over one etcd stream.

A member is alive while its etcd key exists; the key is bound to the member's
own lease (``liveness_timeout_s``), and a heartbeat renews that lease. Every
replica serves heartbeats itself. Here a heartbeat costs no thread and no new
etcd call: `LeaseRenewer` keeps one LeaseKeepAlive stream to etcd per
replica and sends each renewal on it (renewals of one lease already in flight
are shared), and the generation in the answer comes from the replica's plan
board (memory). A lease renewal is not a key write: it adds no etcd revision,
so etcd's writes stay O(membership changes). Each answer names the interval
the member should keep (`pacing`: longer as this replica's members grow).

Failure semantics: a renewal not answered within ``PROBE_TIMEOUT_S`` fails
the heartbeat with UNAVAILABLE, in time for the agent's channel to retry on
another replica (the renewal already sent still reaches etcd). Whether the
replica is cut off from etcd is decided by its probe alone (`liveness`), never
by a slow renewal: on a saturated machine the loop's own lag makes renewals
and the stream look late, and a replica that refused liveness on that
evidence ended every plan stream and stopped renewing on a mere stall (in a
2,000-agent join storm on a loaded machine both replicas flapped 35 times in
a minute, the streams reconnected ~30,000 times, and hundreds of members
expired). A stream that has answered nothing for ``STREAM_STUCK_S`` while a
renewal waits is dropped and re-opened by the next heartbeat; a broken one
fails the renewals waiting on it. A lease found expired (TTL 0) is
NOT_FOUND: the member is fenced and must join again.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import AsyncIterator

import grpc
from etcd3 import etcdrpc

from springback.service.core.coordinator import Coordinator
from springback.client.errors import NotFound, StoreUnavailable
from springback.service.etcd.liveness import (
    PROBE_TIMEOUT_S,
    UNREACHABLE_AFTER_S,
    EtcdReachability,
)
from springback.service.policy.pacing import HeartbeatPacer
from springback.service.transport.planboard import PlanBoard
from springback.service.etcd.store import EtcdSecurity, parse_endpoints

log = logging.getLogger(__name__)

STREAM_STUCK_S = 2 * UNREACHABLE_AFTER_S
"""A lease stream silent this long while a renewal waits is re-opened."""


def _etcd_target(hosts: list[tuple[str, int]]) -> str:
    try:
        for host, _ in hosts:
            ipaddress.IPv4Address(host)
    except ValueError:
        return f"{hosts[0][0]}:{hosts[0][1]}"  # a name: its first endpoint
    return "ipv4:" + ",".join(f"{h}:{p}" for h, p in hosts)  # pick_first fails over


class LeaseRenewer:
    """One LeaseKeepAlive stream to etcd, opened on first use; loop-only."""

    def __init__(self, endpoints: str, *, timeout_s: float = PROBE_TIMEOUT_S,
                 security: EtcdSecurity | None = None) -> None:
        hosts, secure = parse_endpoints(endpoints, security)
        self._target = _etcd_target(hosts)
        # https: etcd's certificate is checked against the first host's name
        # (an "ipv4:" list target names no single host). etcd does not check
        # permissions on lease renewals: the stream needs TLS, not a token.
        self._credentials = security.channel_credentials() if secure and security else None
        self._options = [("grpc.ssl_target_name_override", hosts[0][0])] if secure else []
        self._timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._requests: asyncio.Queue[int] | None = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future[int]] = {}
        self.last_answer_at = 0.0  # loop time of the stream's newest answer
        self.num_renewals = 0

    async def _lines(self, queue: asyncio.Queue[int]) -> AsyncIterator[etcdrpc.LeaseKeepAliveRequest]:
        while True:
            yield etcdrpc.LeaseKeepAliveRequest(ID=await queue.get())

    def _open(self) -> None:
        if self._channel is None:
            self._channel = (grpc.aio.insecure_channel(self._target) if self._credentials is None
                             else grpc.aio.secure_channel(self._target, self._credentials,
                                                          options=self._options))
        queue: asyncio.Queue[int] = asyncio.Queue()
        call = etcdrpc.LeaseStub(self._channel).LeaseKeepAlive(self._lines(queue))
        self.last_answer_at = asyncio.get_running_loop().time()  # silent since it opened
        self._requests = queue
        self._reader = asyncio.ensure_future(self._read(call))

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        error: BaseException | None = None
        try:
            async for answer in call:
                self.last_answer_at = asyncio.get_running_loop().time()
                waiter = self._pending.pop(answer.ID, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(int(answer.TTL))
        except (grpc.RpcError, asyncio.CancelledError) as e:
            error = e
        log.info("lease stream to etcd ended: %s", error)
        self._requests = None
        failed, self._pending = self._pending, {}
        for waiter in failed.values():
            if not waiter.done():
                waiter.set_exception(StoreUnavailable(f"etcd lease stream ended: {error}"))
        call.cancel()

    async def refresh(self, lease_id: int) -> int:
        """The lease's TTL after renewing it (<= 0: expired). `StoreUnavailable`
        when etcd does not answer within the deadline or the stream breaks."""
        loop = asyncio.get_running_loop()
        waiter = self._pending.get(lease_id)
        if waiter is None:
            if self._requests is None:
                self._open()
            assert self._requests is not None
            waiter = self._pending[lease_id] = loop.create_future()
            self._requests.put_nowait(lease_id)
            self.num_renewals += 1
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), self._timeout_s)
        except asyncio.TimeoutError:
            if self._pending.get(lease_id) is waiter:
                del self._pending[lease_id]
            raise StoreUnavailable(f"etcd did not renew lease {lease_id:x} within "
                                   f"{self._timeout_s:g} s") from None

    def reset(self) -> None:
        """Drops a stream that went silent (the next renewal opens a new one)."""
        if self._reader is not None:
            self._reader.cancel()
        self._requests = None

    def silent_for(self) -> float:
        """Seconds since the stream last answered anything (or opened)."""
        return asyncio.get_running_loop().time() - self.last_answer_at

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._channel is not None:
            await self._channel.close()


class Heartbeats:
    """The Heartbeat call on one replica (module docstring); loop-only."""

    def __init__(self, coordinator: Coordinator, board: PlanBoard, renewer: LeaseRenewer,
                 liveness: EtcdReachability | None = None,
                 pacer: HeartbeatPacer | None = None) -> None:
        self._coordinator = coordinator
        self.pacer = pacer or HeartbeatPacer(coordinator.liveness_timeout_s)
        self._board = board
        self._renewer = renewer
        self._liveness = liveness

    async def beat(self, job_id: str, member_id: str) -> int:
        """Renews the member's lease; returns the job's current generation.

        NOT_FOUND when the member expired or left (fenced); UNAVAILABLE at once
        while this replica is cut off from etcd (its probe says so), or when
        the renewal misses its deadline (retry on another replica). Idempotent."""
        if self._liveness is not None:
            self._liveness.require_reachable()
        coordinator = self._coordinator
        lease = coordinator.leases.cached(member_id)
        if lease is None:
            store = self._liveness.store if self._liveness is not None else coordinator.store
            lease = await asyncio.to_thread(coordinator.leases.lease_of, job_id, member_id, store)
        try:
            ttl = await self._renewer.refresh(lease)
        except StoreUnavailable:
            if self._renewer.silent_for() > STREAM_STUCK_S:
                self._renewer.reset()
            raise
        if ttl <= 0:
            coordinator.leases.forget(member_id, lease)
            raise NotFound(
                f"member {member_id!r} of job {job_id!r} expired: stop local ranks and join again")
        self.pacer.seen(member_id, asyncio.get_running_loop().time())
        posted = self._board.get(job_id)
        if posted is not None:
            return posted.plan.generation
        return await asyncio.to_thread(coordinator.current_generation, job_id)
