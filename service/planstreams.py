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
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from springback.service import keys
from springback.client.errors import NotFound, StoreUnavailable
from springback.service.liveness import EtcdReachability
from springback.service.planboard import PlanBoard, Posted
from springback.service.store import Store
from springback.v1 import types_pb2 as pb

WAIT_S = 30.0
"""Longest wait between checks of one stream (changes and `wake_all` end it sooner)."""


def _not_registered(job_id: str, member_id: str) -> NotFound:
    return NotFound(f"member {member_id!r} of job {job_id!r} is not registered "
                    "(expired or left): stop local ranks and join again")


class PlanStreams:
    def __init__(self, store: Store, board: PlanBoard,
                 liveness: EtcdReachability | None = None) -> None:
        self._store = store
        self._board = board
        self._liveness = liveness
        self.num_open = 0

    def _require_registered(self, job_id: str, member_id: str) -> None:
        if self._store.get(keys.member(job_id, member_id)) is None:
            raise _not_registered(job_id, member_id)

    def _open_checks(self, job_id: str, member_id: str) -> None:
        if self._store.get(keys.job(job_id)) is None:
            raise NotFound(f"job {job_id!r} not found")
        if member_id:
            self._require_registered(job_id, member_id)

    def _require_reachable(self) -> None:
        if self._liveness is not None and not self._liveness.reachable:
            raise StoreUnavailable("this replica cannot reach etcd: its plans may be stale; "
                                   "watch plans on another replica")

    async def stream(self, job_id: str, member_id: str) -> AsyncIterator[bytes]:
        """The serialized `WatchPlansResponse`s of one stream (module docstring)."""
        self._require_reachable()
        await asyncio.to_thread(self._open_checks, job_id, member_id)
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
            await asyncio.to_thread(self._require_registered, job_id, member_id)

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
