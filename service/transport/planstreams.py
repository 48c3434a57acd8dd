"""WatchPlans streams, served by every replica on its asyncio loop (no thread each).

A stream sends the job's current plan, then each newer generation, from this
replica's `PlanBoard`, and ends after a STOP plan. Each plan is sent once per
generation, as the member's own slice (`planboard.Posted`: its entry and the
shape of the rest, O(1) bytes whatever the number of members).

Fencing: a member that is not registered (expired, left) gets NOT_FOUND
before its first plan and whenever the job's plan changes without it (the
leader's replan without an expired member is what tells its stream, one etcd
read per such change). Failure semantics: while this replica cannot reach
etcd the stream ends with UNAVAILABLE (its plans could be stale: the agent
reconnects, through its channel, to another replica); a deleted job ends it
with NOT_FOUND. The blocking checks (etcd reads) run on a worker thread.

The registration checks of all the streams of one job are shared
(`Registrations`): one keys-only read of the job's members, begun after
every check waiting on it was asked, answers them all. A join storm, in
which thousands of streams of members not yet planned are checked at every
new plan and thousands open, thus costs a few etcd reads per plan, not one
per stream (which queued on the worker threads ahead of the joins).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from springback.service.etcd import keys
from springback.client.errors import NotFound, StoreUnavailable
from springback.service.etcd.liveness import EtcdReachability
from springback.service.transport.planboard import PlanBoard, Posted
from springback.service.etcd.store import Store
from springback.v1 import types_pb2 as pb

WAIT_S = 30.0
"""Longest wait between checks of one stream (changes and `wake_all` end it sooner)."""
REGISTRATION_READ_GAP_S = 0.05
"""Shortest pause between two registration reads of one job (`Registrations`)."""


def _not_registered(job_id: str, member_id: str) -> NotFound:
    return NotFound(f"member {member_id!r} of job {job_id!r} is not registered "
                    "(expired or left): stop local ranks and join again")


class Registrations:
    """Who is registered in a job, read for many callers at once; loop-only.

    `members` answers with the job's member ids as read from etcd by a read
    that *began after the call*: a call made while no read of that job is in
    flight starts one; calls made while one is in flight share the next one,
    started `gap_s` after it ends. So an answer is never older than its
    question, and however many streams ask at once, one job costs at most one
    read in flight and one queued, at most one per `gap_s` (each a keys-only
    prefix read and a count of the job key, on a worker thread). A failed
    read (`StoreUnavailable`) fails every call that shared it."""

    def __init__(self, store: Store, gap_s: float = REGISTRATION_READ_GAP_S) -> None:
        self._store = store
        self._gap_s = gap_s
        self._queued: dict[str, asyncio.Future[frozenset[str] | None]] = {}
        self._in_flight: set[str] = set()  # a read under way, or the gap after it
        self.num_reads = 0

    async def members(self, job_id: str) -> frozenset[str] | None:
        """Member ids registered in `job_id` (None: the job does not exist)."""
        future = self._queued.get(job_id)
        if future is None:
            future = self._queued[job_id] = asyncio.get_running_loop().create_future()
            future.add_done_callback(_retrieved)
            if job_id not in self._in_flight:
                self._start(job_id)
        return await asyncio.shield(future)

    def _start(self, job_id: str) -> None:
        future = self._queued.pop(job_id)
        self._in_flight.add(job_id)
        self.num_reads += 1
        read = asyncio.ensure_future(asyncio.to_thread(self._read, job_id))

        def done(task: asyncio.Future) -> None:
            error = None if task.cancelled() else task.exception()
            if task.cancelled():
                future.cancel()
            elif error is not None:
                future.set_exception(error)
            else:
                future.set_result(task.result())
            asyncio.get_running_loop().call_later(self._gap_s, self._next, job_id)

        read.add_done_callback(done)

    def _next(self, job_id: str) -> None:
        self._in_flight.discard(job_id)
        if job_id in self._queued:
            self._start(job_id)

    def _read(self, job_id: str) -> frozenset[str] | None:
        if not self._store.exists(keys.job(job_id)):
            return None
        prefix = keys.members(job_id)
        return frozenset(key[len(prefix):] for key in self._store.leases(prefix))


def _retrieved(future: asyncio.Future) -> None:
    """Marks a shared read's failure as seen (its callers may all be gone)."""
    if not future.cancelled():
        future.exception()


class PlanStreams:
    def __init__(self, store: Store, board: PlanBoard,
                 liveness: EtcdReachability | None = None) -> None:
        self._store = store
        self._board = board
        self._liveness = liveness
        self.registrations = Registrations(store)
        self.num_open = 0

    async def _require_registered(self, job_id: str, member_id: str) -> None:
        members = await self.registrations.members(job_id)
        if members is None or member_id not in members:
            raise _not_registered(job_id, member_id)

    async def _open_checks(self, job_id: str, member_id: str) -> None:
        members = await self.registrations.members(job_id)
        if members is None:
            raise NotFound(f"job {job_id!r} not found")
        if member_id and member_id not in members:
            raise _not_registered(job_id, member_id)

    def _require_reachable(self) -> None:
        if self._liveness is not None and not self._liveness.reachable:
            raise StoreUnavailable("this replica cannot reach etcd: its plans may be stale; "
                                   "watch plans on another replica")

    async def stream(self, job_id: str, member_id: str) -> AsyncIterator[bytes]:
        """The serialized `WatchPlansResponse`s of one stream (module docstring)."""
        self._require_reachable()
        await self._open_checks(job_id, member_id)
        self.num_open += 1
        try:
            async for response in self._plans(job_id, member_id):
                yield response
        finally:
            self.num_open -= 1

    async def _plans(self, job_id: str, member_id: str) -> AsyncIterator[bytes]:
        sent = 0
        seen: tuple[int, int] | None = None
        while True:
            self._require_reachable()
            posted = self._board.get(job_id)
            if posted is None and seen is not None:
                raise NotFound(f"job {job_id!r} was deleted")
            if posted is None or posted.order == seen:
                await self._board.changed(job_id, WAIT_S)
                continue
            seen = posted.order
            await self._check_planned(job_id, member_id, posted)
            if posted.plan.generation != sent:
                sent = posted.plan.generation
                yield posted.response(member_id)
                if posted.plan.action == pb.PLAN_ACTION_STOP:
                    return

    async def _check_planned(self, job_id: str, member_id: str, posted: Posted) -> None:
        if member_id and member_id not in posted.planned:
            await self._require_registered(job_id, member_id)

    async def until_planned(self, job_id: str, member_id: str, timeout_s: float) -> bool:
        """Waits until a plan made after now places `member_id` (True), a plan
        made after now leaves it out (the planner's choice: False), or
        `timeout_s` passes (False). The leader's JoinJob answers after it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        before = self._board.get(job_id)
        while True:
            posted = self._board.get(job_id)
            if posted is not None and member_id in posted.planned:
                return True
            if posted is not None and before is not None and posted.order > before.order:
                return False
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            await self._board.changed(job_id, remaining)
