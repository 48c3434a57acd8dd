"""The coordinator's transport-free logic: jobs, generations, fencing, commits.

Only the leader replica runs this logic (non-leaders forward RPCs, see
`server`; plan streams and heartbeats are served by every replica; the
reconcile loop that drives it is `reconcile.Reconciler`); every write is an
etcd transaction guarded by the leader's fencing token and by
compare-and-swap on the keys it read, so two replicas that both believe they
lead cannot both write, and a generation number is never issued twice.

What is durable (etcd): jobs (spec + status), members (lease-bound), the
current plan per job, committed checkpoints. What is in memory only: per-step
progress (flushed to etcd at most every ``progress_flush_s`` and with every
other write, so steps cost no etcd writes), the rest of each job's
`jobstate.JobState`, and the waiters of watch streams. A leader that dies
loses at most ``progress_flush_s`` of *reported progress*, never a job,
member, generation or commit.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Collection, Iterator

from springback.service.policy import ckptinterval, planner, replan
from springback.service.etcd import keys
from springback.service.core.history import change_kind
from springback.service.policy.replan import timestamp_now  # noqa: F401 (used by membership, jobs, commits)
from springback.service.etcd.writer import FencedWriter
from springback.service.etcd.election import Election
from springback.service.core.history import History, delete_job
from springback.service.core.jobstate import JobState, Measures, PlanView
from springback.service.core.leases import MemberLeases
from springback.service.core.memberwatch import MemberWatch
from springback.service.policy.stoprules import StopRules
from springback.service.policy import stragglers
from springback.service.core import departures
from springback.client.errors import (
    Conflict, FailedPrecondition, NotFound, NotLeader,
)
from springback.service.etcd.store import Store
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

JobMutation = Callable[[pb.Job], "str | None"]
"""Changes a job record in place; may return the change's reason instead of
the caller's (what it found decides what is said)."""

CHANGE_ATTEMPTS = 5
"""Rounds of `change_with_retry`: changes of one job race in etcd, not on a lock."""

FAILURE_CHANGES = (js.CHANGE_KIND_NODE_LOST, js.CHANGE_KIND_RANK_FAILURE)
"""`ChangeKind`s that count as failures for
the auto checkpoint interval's MTBF (a drain is planned, not a failure)."""


class Coordinator:
    """Jobs and generations of one coordinator replica (acts only as leader)."""

    def __init__(
        self,
        store: Store,
        election: Election,
        *,
        liveness_timeout_s: float = 5.0,
        progress_flush_s: float = 5.0,
    ) -> None:
        self.store = store
        self.election = election
        self.liveness_timeout_s = liveness_timeout_s
        self.progress_flush_s = progress_flush_s
        # set by `kick`: the reconcile loop (`reconcile.Reconciler`) runs a pass now
        self.kicked = threading.Event()
        self._lock = threading.RLock()
        # held to read or change a JobState (`reports`, `departures` too); watchers wait on it
        self.changed = threading.Condition(self._lock)
        self._version = 0  # bumped on every change; watchers wait on it
        self._jobs: dict[str, JobState] = {}  # job id -> what this leader keeps of it
        self.leases = MemberLeases(store)  # member id -> lease id (a cache)
        # every job's members' fingerprint, watched (`memberwatch`): the reconcile loop's
        self.member_watch = MemberWatch(store)
        # the stop rules' samples of running jobs (leader memory, `stoprules`)
        self.stop_rules = StopRules()
        self.stragglers = stragglers.Stragglers()  # controls.straggler's evidence
        self.num_generations = 0
        self.last_replan_s = 0.0
        self.writer = FencedWriter(store, election.fence)
        self.history = History(store, election.fence)

    # -- what the leader keeps in memory ------------------------------------------

    def leadership_changed(self) -> None:
        """Drops what the leader keeps in memory (every job's `JobState`, the
        member leases, stop rules' samples, history not yet flushed; see
        `jobstate`; the members' watch, started again by the reconcile loop)
        and wakes every watcher (they re-check leadership)."""
        self.member_watch.stop()
        with self.changed:
            self._forget(None)
            self.leases.clear()
            self._version += 1
            self.changed.notify_all()

    def _forget(self, job_id: str | None) -> None:
        """Drops the in-memory state of job `job_id`, or of every job (None):
        its `JobState`, its stop rules' samples and its history not yet flushed."""
        with self._lock:
            if job_id is None:
                self._jobs.clear()
            else:
                self._jobs.pop(job_id, None)
            self.stop_rules.forget(job_id)
            self.stragglers.forget(job_id)
            self.history.forget(job_id)

    def job_state(self, job_id: str) -> JobState:
        """The job's `JobState` in this leader's memory, made empty on first use."""
        with self._lock:
            state = self._jobs.get(job_id)
            if state is None:
                state = self._jobs[job_id] = JobState()
            return state

    def settling(self) -> bool:
        """Whether a job's membership change waits to settle (`reconcile`)."""
        with self._lock:
            return any(state.unsettled for state in self._jobs.values())

    def delete_job(self, job_id: str) -> pb.Job:
        """Deletes a terminal job (`history.delete_job`: one fenced
        transaction; NOT_FOUND, FAILED_PRECONDITION for a live job or a
        concurrent change, nothing deleted) and then drops its in-memory
        state. Raises `NotLeader` unless this replica leads."""
        self.require_leader()
        job = delete_job(self.store, self.election.fence, job_id)
        self._forget(job_id)
        return job

    def require_leader(self) -> None:
        if not self.election.is_leader():
            raise NotLeader(f"replica {self.election.address} is not the leader")

    # -- reads ------------------------------------------------------------------

    def _job_entry(self, job_id: str):  # noqa: ANN202
        entry = self.store.get(keys.job(job_id), pb.Job)
        if entry is None:
            raise NotFound(f"job {job_id!r} not found")
        return entry

    def _with_progress(self, job: pb.Job) -> pb.Job:
        state = self._jobs.get(job.id)
        progress = state.progress if state else None
        if progress is not None and progress.step >= job.status.step:
            job.status.step = progress.step
            job.status.samples_consumed = progress.samples_consumed
            job.status.loss = progress.loss
            job.status.cursor.CopyFrom(progress.cursor)
        return job

    def _with_timing(self, job: pb.Job) -> pb.Job:
        """`job` with the newest per-member timing of its current generation
        (memory only: `_with_progress`'s result is written to etcd, this is
        added to reads alone)."""
        state = self._jobs.get(job.id)
        if state is not None and state.member_timing[0] == job.status.generation:
            job.status.member_timing.extend(state.member_timing[1])
        return job

    def get_job(self, job_id: str) -> pb.Job:
        return self._with_timing(self._with_progress(self._job_entry(job_id).value))

    def list_jobs(self) -> list[pb.Job]:
        return [
            self._with_timing(self._with_progress(e.value))
            for e in self.store.get_prefix(keys.JOBS, pb.Job)
            if "/" not in e.key[len(keys.JOBS):]
        ]

    def current_plan(self, job_id: str) -> pb.Plan | None:
        entry = self.store.get(keys.plan(job_id), pb.Plan)
        return entry.value if entry else None

    def list_checkpoints(self, job_id: str) -> list[pb.CheckpointRef]:
        """Committed checkpoints, newest first."""
        self._job_entry(job_id)
        refs = [e.value for e in self.store.get_prefix(keys.checkpoints(job_id), pb.CheckpointRef)]
        return sorted(refs, key=lambda r: r.step, reverse=True)

    def current_generation(self, job_id: str) -> int:
        """The job's generation: cached on the leader (it writes every plan),
        read from etcd on other replicas."""
        if not self.election.is_leader():
            plan = self.current_plan(job_id)
            return plan.generation if plan else 0
        view = self.job_state(job_id).plan
        if view is None:
            view = self.remember_plan(job_id, self.current_plan(job_id))
        return view.generation

    def remember_plan(self, job_id: str, plan: pb.Plan | None) -> PlanView:
        """Caches `plan` (its generation, signature, members) as the job's current one."""
        signature = planner.signature(plan)
        view = PlanView(
            generation=plan.generation if plan else 0,
            signature=signature,
            members=frozenset(member[0] for member in signature[1]) if plan else frozenset(),
        )
        self.job_state(job_id).plan = view
        return view

    def series(self, job_id: str) -> list[tuple[float, int, float]]:
        """(unix time, step, loss) of the job's steps as this leader accepted
        them, oldest first: each step once (the first report of it), at most
        the newest `SERIES_POINTS` (2,000); leader memory, so empty on other
        replicas and restarted by a new leader."""
        with self._lock:
            state = self._jobs.get(job_id)
            return list(state.series) if state else []

    def members(self, job_id: str) -> list[pb.Member]:
        """Live members (join_order filled from etcd), caching their lease ids."""
        entries = self.store.get_prefix(keys.members(job_id), pb.Member)
        for e in entries:
            e.value.join_order = e.create_revision
        for e in entries:
            self.leases.remember(e.value.id, e.lease_id)
        return [e.value for e in entries]

    # -- the one write path -----------------------------------------------------

    def change(
        self,
        job_id: str,
        reason: str,
        mutate: JobMutation | None = None,
        *,
        kind: js.ChangeKind,
        stateless: Collection[str] = (),
        draining: Collection[str] = (),
        named: Collection[str] = (),
        force_generation: bool = False,
        extra_ops: Callable[[], list] | None = None,
        extra_compare: Collection = (),
    ) -> pb.Job:
        """Applies `mutate` to the job, replans (`replan`), and writes both in
        one fenced transaction (`writer`).

        `kind` is what the change is (a failure, a join, an operator's act),
        given by the caller beside the human-readable `reason`: a generation
        made records it, folded with the kinds of the departures it plans
        (`history.change_kind`), and it alone decides whether the change
        counts as a failure. Text in `reason`, or said by `mutate`, never
        changes it.

        A new generation is written when the plan's signature changes (or when
        forced: a rank crashed, an operator restore). `stateless` members lost
        their in-memory state (a rank crashed) and stop being state holders.
        `draining` members are planned as if their draining flag (written by
        `extra_ops`) were set. `named`: the members `reason` names (a
        departure it names is not named again, `departures.naming`); a
        reason said by `mutate` names none. `extra_compare` joins the transaction's
        comparisons (a caller's own reads that must still hold when the write
        lands, see `fencing`).
        Raises `Conflict` if a concurrent writer won (nothing is written),
        `NotLeader` if this replica does not lead, and whatever `mutate` raises
        (nothing is written). The fencing token is taken *before* anything is
        read: a decision made while this replica led is written only if it
        still leads when the transaction lands. No lock is held across the
        reads and the write: etcd's compare-and-swap orders concurrent changes.
        """
        fence = self.writer.fence()  # NotLeader unless leading now
        job_entry = self._job_entry(job_id)
        plan_entry = self.store.get(keys.plan(job_id), pb.Plan)
        members = self.members(job_id)
        checkpoints = self.list_checkpoints(job_id)
        job = self._with_progress(job_entry.value)
        ended = planner.is_terminal(job.status.state)
        paused = job.status.state == pb.JOB_STATE_PAUSED
        if mutate is not None:
            said = mutate(job)
            if isinstance(said, str):  # what the mutation found decides what is said
                reason, named = said, ()
        progress = self.job_state(job_id).progress  # after mutate: a start sets it
        previous = plan_entry.value if plan_entry else None
        reason, departed = departures.naming(self, job_id, previous, members, reason, named)
        kind = change_kind({kind, *departed}, job.status.state)
        failure = kind in FAILURE_CHANGES
        decision = replan.replan(replan.Inputs(
            observed=self._observed(job, failure),
            job=job, previous=previous,
            previous_signature=self._signature_of(job_id, previous) if previous else None,
            members=members, checkpoints=checkpoints, progress=progress, reason=reason,
            stateless=stateless, draining=draining, force_generation=force_generation,
            ended=ended, paused=paused,
        ))
        self.last_replan_s = decision.planning_s
        history_ops = self.history.on_change(job, decision.plan if decision.new_generation else None,
                                             kind, interval=decision.interval)
        txn = self.writer.txn
        compare = [
            txn.mod(keys.job(job_id)) == job_entry.mod_revision,
            (txn.mod(keys.plan(job_id)) == plan_entry.mod_revision) if plan_entry
            else (txn.version(keys.plan(job_id)) == 0),
            *extra_compare,
        ]
        ops = [txn.put(keys.job(job_id), job.SerializeToString())]
        if decision.plan_write is not None:
            ops.append(txn.put(keys.plan(job_id), decision.plan_write.SerializeToString()))
        if extra_ops is not None:
            ops.extend(extra_ops())
        ops.extend(history_ops)
        self.writer.write_or_conflict(fence, compare, ops, f"job {job_id}")
        self._applied(job_id, decision, progress, reason)
        if failure and decision.new_generation:
            with self.changed:
                self.job_state(job_id).measures.failures += 1
        return job

    def _observed(self, job: pb.Job, failure: bool) -> ckptinterval.Observed:
        """What the auto checkpoint interval of `job`'s next plan is chosen
        from; `failure`: the change being planned is itself a failure."""
        with self.changed:
            state = self._jobs.get(job.id)
            m = state.measures if state else Measures()
            started = job.started_at.ToNanoseconds() / 1e9 if job.started_at.seconds else 0.0
            return ckptinterval.Observed(
                running_s=max(time.time() - started, 0.0) if started else 0.0,
                failures=m.failures + int(failure), rollbacks=m.rollbacks, cost_s=m.cost_s,
                step_s=m.step_s)

    def _applied(self, job_id: str, decision: replan.Decision,
                 progress: planner.Progress | None, reason: str) -> None:
        """Caches what a landed change wrote, then wakes the watchers."""
        plan = decision.plan
        with self.changed:
            state = self.job_state(job_id)
            if state.progress is progress:
                state.dirty = False  # a report that came meanwhile stays dirty
            if decision.new_generation:
                self.num_generations += 1
                view = state.plan
                if view is None or view.generation < plan.generation:
                    state.plan = PlanView(
                        plan.generation, decision.signature,
                        frozenset(member[0] for member in decision.signature[1]))
            if decision.plan_write is not None:  # departures it planned are told
                kept = {m.member_id for m in plan.members} | set(plan.spares)
                for member_id in [m for m in state.departures if m not in kept]:
                    del state.departures[member_id]
        if decision.new_generation:
            log.info("job %s generation %d (%s): world %d, %s", job_id, plan.generation,
                     pb.PlanAction.Name(plan.action), plan.world_size, reason)
        self.notify(job_id, reason)

    def _signature_of(self, job_id: str, plan: pb.Plan) -> tuple:
        view = self.job_state(job_id).plan
        if view is None or view.generation != plan.generation:
            view = self.remember_plan(job_id, plan)
        return view.signature

    def notify(self, job_id: str, event: str) -> None:
        """Wakes every watcher, `event` the job's last change in words."""
        with self.changed:
            self._version += 1
            self.job_state(job_id).event = event
            self.changed.notify_all()

    def change_with_retry(self, job_id: str, reason: str, mutate: JobMutation | None = None,
                          *, kind: js.ChangeKind, **kwargs) -> pb.Job:  # noqa: ANN003
        """`change`, retried on `Conflict` (`CHANGE_ATTEMPTS` attempts, a short
        jittered pause between them so that writers that collided spread out);
        then `Conflict` (nothing written)."""
        for attempt in range(CHANGE_ATTEMPTS):
            try:
                return self.change(job_id, reason, mutate, kind=kind, **kwargs)
            except Conflict:
                if attempt == CHANGE_ATTEMPTS - 1:
                    raise
                time.sleep(random.uniform(0, 0.01 * 2 ** attempt))  # backoff, not a synchronisation
        raise AssertionError("unreachable")

    # -- watching -----------------------------------------------------------------

    def watch(self, job_id: str, alive: Callable[[], bool],
              poll_s: float = 1.0) -> Iterator[tuple[pb.Job, str]]:
        """The job now, then after every change, until the job ends or `alive()` is false.

        Raises `NotLeader` when this replica stops leading (the stream should
        be retried against the new leader).
        """
        seen = -1
        while alive():
            self.require_leader()
            with self.changed:
                if seen == self._version:
                    self.changed.wait(poll_s)
                    continue
                seen = self._version
                state = self._jobs.get(job_id)
                event = state.event if state and state.event is not None else ""
            job = self.get_job(job_id)
            yield job, event
            if planner.is_terminal(job.status.state):
                return

    # -- asked by the reconcile loop -------------------------------------------------

    def kick(self) -> None:
        """Runs the reconcile loop now (a member registered); never blocks."""
        self.kicked.set()

    def flush_progress(self) -> None:
        """Writes reported progress of jobs that changed since their last write."""
        with self._lock:
            dirty = [(job_id, "progress" if state.event is None else state.event)
                     for job_id, state in self._jobs.items() if state.dirty]
        for job_id, event in dirty:
            try:
                self.change(job_id, event, kind=js.CHANGE_KIND_OTHER)
            except (Conflict, NotFound) as e:
                log.info("flush %s: %s", job_id, e)

    # -- used by the membership and job-control layers ---------------------------------

    def require_state(self, job: pb.Job, allowed: Collection[int], action: str) -> None:
        if job.status.state not in allowed:
            raise FailedPrecondition(
                f"cannot {action} job {job.id}: it is {pb.JobState.Name(job.status.state)}"
            )
