"""Job history: timestamps and one record per generation, kept in etcd.

The coordinator's one write path (`Coordinator.change`) calls `on_change`
for every job write: it stamps ``Job.started_at`` / ``finished_at`` the first
time the job runs / ends, and for a new generation returns the put of its
`GenerationEvent` (``/springback/v1/history/{job}/{generation}``), which joins
the same fenced transaction as the plan, so a record exists exactly for the
generations that were issued. A record's kind is the `ChangeKind` its change's
caller passed (`change_kind`), never read from its reason, whose text may quote
what a member said. Step reports (`on_progress`) touch memory only;
the first step of a generation fills in its recovery time, written once by
`flush` (from the leader's reconcile loop). So history costs one write per
generation plus one when it first steps, never one per step.

Failure semantics: `flush` is a fenced put guarded by the record existing;
after a lost compare (leadership moved, record deleted) nothing is written
and the pending update is dropped: the record then keeps no recovery time. A
new leader knows no earlier step times: the first generation it makes measures
recovery from the plan's creation instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import cast

from etcd3.utils import prefix_range_end

from springback.service.etcd import keys
from springback.service.policy import planner
from springback.client.errors import FailedPrecondition, NotFound
from springback.service.etcd.store import Store
from springback.service.etcd.writer import FencedWriter
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

KIND_PRECEDENCE: tuple[js.ChangeKind, ...] = (
    js.CHANGE_KIND_CONTROL,
    js.CHANGE_KIND_RANK_FAILURE,
    js.CHANGE_KIND_NODE_LOST,
    js.CHANGE_KIND_PREEMPTED,
    js.CHANGE_KIND_DRAIN,
    js.CHANGE_KIND_LEAVE,
    js.CHANGE_KIND_JOIN,
    js.CHANGE_KIND_FINISH,
    js.CHANGE_KIND_OPERATOR,
    js.CHANGE_KIND_START,
    js.CHANGE_KIND_OTHER,
)
"""Which kind a generation made for several changes at once records, first
wins: a change's own kind and the departures folded into it (a member lost
while a report was planned, a loss and a join in one reconcile pass). A
failure outranks a planned departure, which outranks a join, so the failure
counting and the checkpoint interval see the worst thing that happened; a
preemption outranks a plain drain or leave (it says why the node went)."""

FAILURE_KINDS = {
    js.CHANGE_KIND_NODE_LOST: "node_lost",
    js.CHANGE_KIND_RANK_FAILURE: "rank_failure",
    js.CHANGE_KIND_DRAIN: "drain",
    js.CHANGE_KIND_PREEMPTED: "preempted",
}
"""Change kinds counted as failures (`springback_job_failures_total{kind}`)."""


def change_kind(kinds: Collection[js.ChangeKind], state: int) -> js.ChangeKind:
    """The `ChangeKind` recorded for a generation made for the changes of
    `kinds` (given by their callers, never read from a reason's text) with
    the job in `state`: `CHANGE_KIND_FINISH` once the job ended, else the
    first of `KIND_PRECEDENCE` among `kinds`, `CHANGE_KIND_OTHER` for none."""
    if planner.is_terminal(state):
        return js.CHANGE_KIND_FINISH
    return next((kind for kind in KIND_PRECEDENCE if kind in kinds), js.CHANGE_KIND_OTHER)


class History:
    """The leader's side of job history (see the module docstring)."""

    def __init__(self, store: Store, fence: Callable[[], list]) -> None:
        self._store = store
        self._writer = FencedWriter(store, fence)
        self._lock = threading.Lock()
        self._last_step_at: dict[str, float] = {}  # job -> wall time of its newest step report
        self._awaiting: dict[str, js.GenerationEvent] = {}  # job -> its generation's first step
        self._running: dict[str, js.GenerationEvent] = {}  # job -> its stepping generation
        self._started: dict[str, int] = {}  # job -> newest generation whose start was recorded
        # (job, generation) -> record to write again, with its recovery time
        self._unflushed: dict[tuple[str, int], js.GenerationEvent] = {}

    def forget(self, job_id: str | None = None) -> None:
        """Drops what this replica remembers of job `job_id` (deleted), or of
        every job (None: on a leadership change): step times and records not
        yet flushed are lost (see the module docstring)."""
        with self._lock:
            if job_id is None:
                self._last_step_at.clear()
                self._awaiting.clear()
                self._running.clear()
                self._started.clear()
                self._unflushed.clear()
                return
            for per_job in (self._last_step_at, self._awaiting, self._running, self._started):
                per_job.pop(job_id, None)
            for key in [k for k in self._unflushed if k[0] == job_id]:
                del self._unflushed[key]

    def on_change(self, job: pb.Job, plan: pb.Plan | None, kind: js.ChangeKind,
                  interval: pb.CheckpointInterval | None = None) -> list:
        """Stamps `job`'s timestamps; for a new generation (`plan` not None),
        returns the transaction ops that record it as a change of `kind` (see
        `change_kind`), with `interval`, the auto checkpoint interval chosen
        for it and its figures. Where its state really
        came from, and the steps redone, arrive with its start (`on_start`)."""
        now = time.time()
        status = job.status
        if status.state == pb.JOB_STATE_RUNNING and not job.started_at.seconds:
            job.started_at.FromSeconds(int(now))
        if planner.is_terminal(status.state) and not job.finished_at.seconds:
            job.finished_at.FromSeconds(int(now))
        if plan is None:
            return []
        event = js.GenerationEvent(
            generation=plan.generation, reason=plan.reason or status.message,
            kind=kind, action=plan.action,
            world_size=plan.world_size, members=[m.member_id for m in plan.members],
            restore=plan.restore.kind, start_step=plan.step, spares=list(plan.spares),
        )
        event.created_at.CopyFrom(plan.created_at)
        if interval is not None:
            event.checkpoint_interval.CopyFrom(interval)
        with self._lock:
            self._running.pop(job.id, None)
            if plan.action == pb.PLAN_ACTION_RUN:
                self._awaiting[job.id] = event
            else:
                self._awaiting.pop(job.id, None)
        return [self._store.txn.put(keys.history_event(job.id, plan.generation), event.SerializeToString())]

    def on_start(self, job_id: str, generation: int, *, step: int, steps_redone: int,
                 restored_from: int, state_lost: str = "", steps_lost: int = 0,
                 spans: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> None:
        """The ranks of `generation` agreed on the state of `step`, taken from
        `restored_from`: what the plan only expected becomes what happened
        (memory only until the generation's first step is flushed). `spans`:
        rank 0's (startup, rendezvous, transfer) seconds."""
        now = time.time()
        with self._lock:
            event = self._awaiting.get(job_id)
            if event is not None and event.generation == generation:
                if not event.started_at.seconds:
                    event.started_at.FromNanoseconds(int(now * 1e9))
                event.startup_s, event.rendezvous_s, event.transfer_s = spans
                event.start_step = step
                event.steps_redone = steps_redone
                event.restore = cast(pb.RestoreKind, restored_from)
                event.state_lost, event.steps_lost = state_lost, steps_lost

    def note_start(self, job_id: str, generation: int) -> None:
        """Rank 0 reported that `generation` started (every report, a repeated
        one included: a generation made again at the same step with the same
        holders started all the same)."""
        with self._lock:
            self._started[job_id] = max(self._started.get(job_id, 0), generation)

    def newest_start(self, job_id: str) -> int | None:
        """The newest generation of the job whose start (its ranks agreed on
        a state) this replica recorded; None when it saw none (it became
        leader since)."""
        with self._lock:
            return self._started.get(job_id)

    def on_progress(self, job_id: str, generation: int, *, stall_total_s: float = 0.0,
                    step_s: float = 0.0,
                    step_quantiles: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> None:
        """A step of `generation` was accepted (memory only; cheap): the
        generation's newest step time, its checkpoint stalls so far
        (`stall_total_s`), the measured `step_s` and rank 0's step time
        percentiles (`step_quantiles`: p50, p90, p99; zeros keep the last
        reported) are written with the next flush."""
        now = time.time()
        with self._lock:
            event = self._awaiting.get(job_id)
            if event is not None and event.generation == generation:
                started = self._last_step_at.get(job_id, event.created_at.ToNanoseconds() / 1e9)
                event.recovery.FromNanoseconds(int(max(now - started, 0.0) * 1e9))
                event.first_step_at.FromNanoseconds(int(now * 1e9))
                if not event.started_at.seconds:  # no start report came (an older rank)
                    event.started_at.CopyFrom(event.first_step_at)
                self._running[job_id] = self._awaiting.pop(job_id)
            event = self._running.get(job_id)
            if event is not None and event.generation == generation:
                event.last_step_at.FromNanoseconds(int(now * 1e9))
                event.checkpoint_stall_s = max(event.checkpoint_stall_s, stall_total_s)
                event.step_s = step_s or event.step_s
                if any(step_quantiles):
                    event.step_p50_s, event.step_p90_s, event.step_p99_s = step_quantiles
                self._unflushed[(job_id, generation)] = event
            self._last_step_at[job_id] = now

    def flush(self) -> None:
        """Writes the recovery times measured since the last flush (leader only).

        One fenced put per record; a record that no longer exists (the job was
        deleted) or a lost fence drops the update. Raises `StoreUnavailable`
        when etcd is unreachable (the updates are kept for the next call).
        """
        with self._lock:  # serialized here: step reports keep updating the records
            pending = [(k, e, e.SerializeToString()) for k, e in self._unflushed.items()]
        for (job_id, generation), event, data in pending:
            key = keys.history_event(job_id, event.generation)
            txn = self._store.txn
            written = self._writer.write(
                self._writer.fence(), [txn.version(key) > 0], [txn.put(key, data)])
            if not written:
                log.info("history of %s generation %d not updated (record gone or not leader)",
                         job_id, event.generation)
            with self._lock:  # kept when updated since it was serialized
                if (self._unflushed.get((job_id, generation)) is event
                        and event.SerializeToString() == data):
                    del self._unflushed[(job_id, generation)]

    def events(self, job_id: str) -> list[js.GenerationEvent]:
        """Every generation of the job, oldest first, with recovery times
        measured but not yet flushed."""
        events = [e.value for e in self._store.get_prefix(keys.history(job_id), js.GenerationEvent)]
        with self._lock:
            pending = {g: _copy(e) for (j, g), e in self._unflushed.items() if j == job_id}
        return [pending.get(e.generation, e) for e in events]


def _copy(event: js.GenerationEvent) -> js.GenerationEvent:
    out = js.GenerationEvent()
    out.CopyFrom(event)
    return out


def delete_job(store: Store, fence: Callable[[], list], job_id: str) -> pb.Job:
    """Deletes a terminal job's record, plan, history, members and checkpoint
    index in one fenced transaction, and returns the record as it was.

    NOT_FOUND for an unknown job, FAILED_PRECONDITION for one still live
    (cancel it first); `Conflict`-free: a concurrent change makes the compare
    fail and nothing is deleted (FAILED_PRECONDITION, retry). Checkpoint files
    are not touched (the coordinator never reads storage).
    """
    entry = store.get(keys.job(job_id), pb.Job)
    if entry is None:
        raise NotFound(f"job {job_id!r} not found")
    job = entry.value
    if not planner.is_terminal(job.status.state):
        raise FailedPrecondition(
            f"cannot delete job {job_id}: it is {pb.JobState.Name(job.status.state)} "
            "(cancel it first)")
    txn = store.txn
    ops = [txn.delete(keys.job(job_id)), txn.delete(keys.plan(job_id))]
    for prefix in (keys.history(job_id), keys.members(job_id), keys.checkpoints(job_id)):
        ops.append(txn.delete(prefix, range_end=prefix_range_end(prefix.encode())))
    writer = FencedWriter(store, fence)
    if not writer.write(writer.fence(), [txn.mod(keys.job(job_id)) == entry.mod_revision], ops):
        raise FailedPrecondition(f"job {job_id} changed while being deleted; retry")
    log.info("job %s deleted", job_id)
    return job
