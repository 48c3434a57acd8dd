"""The coordinator's transport-free logic: jobs, generations, fencing, commits.

Only the leader replica runs this logic (non-leaders forward RPCs, see
`server`); every write is an etcd transaction guarded by the leader's fencing
token and by compare-and-swap on the keys it read, so two replicas that both
believe they lead cannot both write, and a generation number is never issued
twice.

What is durable (etcd): jobs (spec + status), members (lease-bound), the
current plan per job, committed checkpoints. What is in memory only: per-step
progress (flushed to etcd at most every ``progress_flush_s`` and with every
other write, so steps cost no etcd writes) and the waiters of watch streams.
A leader that dies loses at most ``progress_flush_s`` of *reported progress*,
never a job, member, generation or commit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator
from typing import NamedTuple

from google.protobuf.timestamp_pb2 import Timestamp

from springback.service import keys, planner
from springback.service.election import Election
from springback.service.history import History
from springback.client.errors import (
    Conflict, FailedPrecondition, NotFound, NotLeader, SpringbackError, StaleGeneration,
)
from springback.service.store import Store
from springback.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

JobMutation = Callable[[pb.Job], None]


class _PlanView(NamedTuple):
    """What the leader keeps of a job's current plan (it writes every plan)."""

    generation: int
    signature: tuple  # planner.signature: action and rank assignment
    members: frozenset[str]  # active member ids


def timestamp_now() -> Timestamp:
    ts = Timestamp()
    ts.GetCurrentTime()
    return ts


class Coordinator:
    """Jobs and generations of one coordinator replica (acts only as leader)."""

    def __init__(
        self,
        store: Store,
        election: Election,
        *,
        liveness_timeout_s: float = 5.0,
        progress_flush_s: float = 5.0,
        reconcile_interval_s: float = 0.2,
    ) -> None:
        self.store = store
        self.election = election
        self.liveness_timeout_s = liveness_timeout_s
        self.progress_flush_s = progress_flush_s
        self.reconcile_interval_s = reconcile_interval_s
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._version = 0  # bumped on every change; watchers wait on it
        self._events: dict[str, str] = {}  # job id -> last change, in words
        self._progress: dict[str, planner.Progress] = {}
        self._dirty: set[str] = set()  # jobs whose progress is not yet in etcd
        self._plans: dict[str, _PlanView] = {}  # job id -> what matters of its current plan
        self._lease_of: dict[str, int] = {}  # member id -> lease id
        self._live: dict[str, frozenset[str]] = {}  # job id -> registered member ids, last read
        # job id -> members' (count, newest revision) when last found in line with the plan
        self._fingerprints: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reconcile", daemon=True)
        self.num_loop_errors = 0
        self.num_generations = 0
        self.last_replan_s = 0.0
        self.history = History(store, election.fence)

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.leadership_changed()
        self._thread.join(timeout=5)

    def leadership_changed(self) -> None:
        """Drops leader-only caches and wakes every watcher (they re-check leadership)."""
        with self._changed:
            self._progress.clear()
            self._dirty.clear()
            self._plans.clear()
            self._lease_of.clear()
            self._live.clear()
            self._fingerprints.clear()
            self.history.forget()
            self._version += 1
            self._changed.notify_all()

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
        progress = self._progress.get(job.id)
        if progress is not None and progress.step >= job.status.step:
            job.status.step = progress.step
            job.status.samples_consumed = progress.samples_consumed
            job.status.loss = progress.loss
            job.status.cursor.CopyFrom(progress.cursor)
        return job

    def get_job(self, job_id: str) -> pb.Job:
        return self._with_progress(self._job_entry(job_id).value)

    def list_jobs(self) -> list[pb.Job]:
        return [
            self._with_progress(e.value)
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
        view = self._plans.get(job_id)
        if view is None:
            view = self._remember(job_id, self.current_plan(job_id))
        return view.generation

    def _remember(self, job_id: str, plan: pb.Plan | None) -> _PlanView:
        signature = planner.signature(plan)
        view = _PlanView(
            generation=plan.generation if plan else 0,
            signature=signature,
            members=frozenset(member[0] for member in signature[1]) if plan else frozenset(),
        )
        self._plans[job_id] = view
        return view

    def members(self, job_id: str) -> list[pb.Member]:
        """Live members (join_order filled from etcd), caching their lease ids."""
        entries = self.store.get_prefix(keys.members(job_id), pb.Member)
        for e in entries:
            e.value.join_order = e.create_revision
        self._lease_of.update((e.value.id, e.lease_id) for e in entries)
        self._live[job_id] = frozenset(e.value.id for e in entries)
        return [e.value for e in entries]

    # -- the one write path -----------------------------------------------------

    def change(
        self,
        job_id: str,
        reason: str,
        mutate: JobMutation | None = None,
        *,
        stateless: Collection[str] = (),
        draining: Collection[str] = (),
        force_generation: bool = False,
        extra_ops: Callable[[], list] | None = None,
        extra_compare: Collection = (),
    ) -> pb.Job:
        """Applies `mutate` to the job, replans, and writes both atomically.

        A new generation is written when the plan's signature changes (or when
        forced: a rank crashed, an operator restore). `stateless` members lost
        their in-memory state (a rank crashed) and stop being state holders.
        `draining` members are planned as if their draining flag (written by
        `extra_ops`) were set. `extra_compare` joins the transaction's
        comparisons (a caller's own reads that must still hold when the write
        lands, see `fencing`).
        Raises `Conflict` if a concurrent writer won (nothing is written),
        `NotLeader` if this replica does not lead, and whatever `mutate` raises
        (nothing is written). The fencing token is taken *before* anything is
        read: a decision made while this replica led is written only if it
        still leads when the transaction lands.
        """
        fence = self.election.fence()  # NotLeader unless leading now
        with self._changed:
            job_entry = self._job_entry(job_id)
            job = self._with_progress(job_entry.value)
            if mutate is not None:
                mutate(job)
            plan_entry = self.store.get(keys.plan(job_id), pb.Plan)
            previous = plan_entry.value if plan_entry else None
            members = self.members(job_id)
            for m in members:
                m.draining = m.draining or m.id in draining
            live = {m.id for m in members}
            holders = [h for h in job.status.state_holders if h in live and h not in stateless]
            del job.status.state_holders[:]
            job.status.state_holders.extend(holders)
            checkpoints = self.list_checkpoints(job_id)
            requested = None
            if job.status.restore_step:
                requested = next((c for c in checkpoints if c.step == job.status.restore_step), None)
            started = time.perf_counter()
            plan = planner.make_plan(
                job, members, previous,
                progress=self._progress.get(job_id) or planner.Progress(
                    step=job.status.step, samples_consumed=job.status.samples_consumed,
                    loss=job.status.loss, cursor=job.status.cursor,
                ),
                newest_checkpoint=checkpoints[0] if checkpoints else None,
                requested_checkpoint=requested,
                holders=holders,
                reason=reason,
            )
            self.last_replan_s = time.perf_counter() - started
            signature = planner.signature(plan)
            new_generation = force_generation or previous is None or (
                signature != self._signature_of(job_id, previous)
            )
            status = job.status
            if new_generation:
                plan.generation = (previous.generation if previous else 0) + 1
                plan.created_at.CopyFrom(timestamp_now())
                if requested is not None and plan.restore.kind == pb.RESTORE_KIND_CHECKPOINT:
                    status.restore_step = 0  # the operator's restore is planned
                # Progress rewinds when the ranks report the state they
                # actually started from (record_generation_start), not here:
                # this plan may never start.
                status.generation = plan.generation
                status.world_size = plan.world_size
                del status.members[:]
                status.members.extend(m.member_id for m in plan.members if plan.world_size)
            if not planner.is_terminal(status.state):
                if plan.action == pb.PLAN_ACTION_RUN:
                    status.state = pb.JOB_STATE_RUNNING
                elif status.state == pb.JOB_STATE_RUNNING:
                    status.state = pb.JOB_STATE_PENDING
            del status.spares[:]
            status.spares.extend(plan.spares)
            status.message = reason
            status.updated_at.CopyFrom(timestamp_now())
            history_ops = self.history.on_change(job, plan if new_generation else None)

            txn = self.store.txn
            compare = fence + [
                txn.mod(keys.job(job_id)) == job_entry.mod_revision,
                (txn.mod(keys.plan(job_id)) == plan_entry.mod_revision) if plan_entry
                else (txn.version(keys.plan(job_id)) == 0),
                *extra_compare,
            ]
            ops = [txn.put(keys.job(job_id), job.SerializeToString())]
            if new_generation:
                ops.append(txn.put(keys.plan(job_id), plan.SerializeToString()))
            elif previous is not None and list(plan.spares) != list(previous.spares):
                # Same generation, new hot spares: training is not interrupted.
                del previous.spares[:]
                previous.spares.extend(plan.spares)
                ops.append(txn.put(keys.plan(job_id), previous.SerializeToString()))
            if extra_ops is not None:
                ops.extend(extra_ops())
            ops.extend(history_ops)
            if not self.store.transaction(compare, ops):
                raise Conflict(f"job {job_id}: concurrent update, retry")
            self._dirty.discard(job_id)
            if new_generation:
                self.num_generations += 1
                self._plans[job_id] = _PlanView(
                    plan.generation, signature, frozenset(member[0] for member in signature[1]))
                log.info("job %s generation %d (%s): world %d, %s", job_id, plan.generation,
                         pb.PlanAction.Name(plan.action), plan.world_size, reason)
            self._notify(job_id, reason)
            return job

    def _signature_of(self, job_id: str, plan: pb.Plan) -> tuple:
        view = self._plans.get(job_id)
        if view is None or view.generation != plan.generation:
            view = self._remember(job_id, plan)
        return view.signature

    def _notify(self, job_id: str, event: str) -> None:
        with self._changed:
            self._version += 1
            self._events[job_id] = event
            self._changed.notify_all()

    def change_with_retry(self, job_id: str, reason: str, mutate: JobMutation | None = None,
                          **kwargs) -> pb.Job:  # noqa: ANN003
        """`change`, retried on `Conflict` (three attempts)."""
        for attempt in range(3):
            try:
                return self.change(job_id, reason, mutate, **kwargs)
            except Conflict:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    # -- progress and fencing ---------------------------------------------------

    def check_generation(self, job_id: str, generation: int) -> None:
        """Raises `StaleGeneration` unless `generation` is the job's current one."""
        current = self.current_generation(job_id)
        if generation != current:
            raise StaleGeneration(job_id, generation, current)

    def record_progress(self, job_id: str, member_id: str, generation: int,
                        progress: planner.Progress) -> int:
        """Accepts a step report from a member of the current generation.

        In memory only (one etcd read: a member whose lease expired is NOT_FOUND
        at once, before the leader's next reconcile pass replans without it);
        the job succeeds (one write) when max_steps is reached.
        """
        self.require_leader()
        if self.store.get(keys.member(job_id, member_id)) is None:
            raise NotFound(f"member {member_id!r} of job {job_id!r} is not registered "
                           "(expired or left): its reports no longer count")
        with self._changed:
            self.check_generation(job_id, generation)
            if member_id not in self._plans[job_id].members:
                raise StaleGeneration(job_id, generation, self.current_generation(job_id))
            previous = self._progress.get(job_id)
            if previous is None or progress.step >= previous.step:
                self._progress[job_id] = progress
                self._dirty.add(job_id)
                self.history.on_progress(job_id, generation)
                self._notify(job_id, f"step {progress.step}")
        job = self.get_job(job_id)
        if progress.step >= job.spec.max_steps and job.status.state == pb.JOB_STATE_RUNNING:
            def succeed(job: pb.Job) -> None:
                job.status.state = pb.JOB_STATE_SUCCEEDED
            self.change_with_retry(job_id, f"reached max_steps {job.spec.max_steps}", succeed)
        return self.current_generation(job_id)

    def record_generation_start(self, job_id: str, member_id: str, generation: int,
                                progress: planner.Progress, restored_from: int) -> None:
        """Rank 0's word that generation `generation` agreed on the state of
        `progress.step`, taken from `restored_from` (memory, a checkpoint, or
        nothing).

        This is what proves state holders: every member of the generation
        holds that state now. A start behind the reported progress rewinds it
        and counts the steps redone; a restore from a checkpoint is counted.
        One etcd write per generation. Raises `StaleGeneration` for an old
        generation (nothing changes); idempotent for a repeated report.
        """
        self.require_leader()
        with self._changed:
            self.check_generation(job_id, generation)
            if member_id not in self._plans[job_id].members:
                raise StaleGeneration(job_id, generation, self.current_generation(job_id))
            holders = sorted(self._plans[job_id].members)

        def started(job: pb.Job) -> None:
            status = job.status
            if status.holders_step == progress.step and list(status.state_holders) == holders:
                return  # a repeated report
            redone = max(status.step - progress.step, 0)
            status.steps_redone += redone
            self.history.on_start(job_id, generation, step=progress.step, steps_redone=redone,
                                  restored_from=restored_from)
            if restored_from == pb.RESTORE_KIND_CHECKPOINT:
                status.num_restores += 1
            status.step = progress.step
            status.samples_consumed = progress.samples_consumed
            status.cursor.CopyFrom(progress.cursor)
            del status.state_holders[:]
            status.state_holders.extend(holders)
            status.holders_step = progress.step
            with self._changed:  # reports of the new generation count from here
                self._progress[job_id] = progress

        source = pb.RestoreKind.Name(restored_from).removeprefix("RESTORE_KIND_").lower()
        self.change_with_retry(job_id, f"generation {generation} started at step "
                                       f"{progress.step} (state from {source})", started)

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
            with self._changed:
                if seen == self._version:
                    self._changed.wait(poll_s)
                    continue
                seen = self._version
                event = self._events.get(job_id, "")
            job = self.get_job(job_id)
            yield job, event
            if planner.is_terminal(job.status.state):
                return

    def watch_plans(self, job_id: str, alive: Callable[[], bool], poll_s: float = 1.0,
                    member_id: str = "") -> Iterator[pb.Plan]:
        """The current plan, then each newer one; ends after a STOP plan.

        With `member_id`, raises `NotFound` when that member is not registered
        (expired, left: it is fenced), checked before the first plan and after
        every change, so a fenced member learns it on its stream as soon as
        the leader notices the expiry (the same pass that replans without it).
        """
        self._job_entry(job_id)
        if member_id and self.store.get(keys.member(job_id, member_id)) is None:
            # read, not the cache: a member whose lease just expired is told at once
            raise NotFound(f"member {member_id!r} of job {job_id!r} is not registered "
                           "(expired or left): stop local ranks and join again")
        sent = -1
        while alive():
            self.require_leader()
            if member_id:
                self._require_registered(job_id, member_id)
            with self._changed:
                generation = self.current_generation(job_id)
                if generation == sent:
                    self._changed.wait(poll_s)
                    continue
            plan = self.current_plan(job_id)
            if plan is None:
                with self._changed:
                    self._changed.wait(poll_s)
                continue
            sent = plan.generation
            yield plan
            if plan.action == pb.PLAN_ACTION_STOP:
                return

    def _require_registered(self, job_id: str, member_id: str) -> None:
        live = self._live.get(job_id)
        if live is None:
            self.members(job_id)
            live = self._live.get(job_id, frozenset())
        if member_id not in live:
            raise NotFound(
                f"member {member_id!r} of job {job_id!r} is not registered (expired or left): "
                "stop local ranks and join again"
            )

    # -- background loop ------------------------------------------------------------

    def _loop(self) -> None:
        last_flush = time.monotonic()
        while not self._stop.wait(self.reconcile_interval_s):
            if not self.election.is_leader():
                continue
            try:
                self.reconcile()
                self.history.flush()
                if time.monotonic() - last_flush >= self.progress_flush_s:
                    self.flush_progress()
                    last_flush = time.monotonic()
            except SpringbackError as e:
                self.num_loop_errors += 1
                log.warning("reconcile: %s", e)
            except Exception:  # a bug: log it, count it, keep serving
                self.num_loop_errors += 1
                log.exception("reconcile failed")

    def reconcile(self) -> None:
        """Replans every live job whose members no longer match its plan.

        This is how expired members (lease gone), and changes a previous
        leader did not finish, turn into new generations. Reads only, unless
        something changed.
        """
        for job in self.list_jobs():
            if planner.is_terminal(job.status.state):
                continue
            fingerprint = self.store.fingerprint(keys.members(job.id))
            if self._fingerprints.get(job.id) == fingerprint:
                continue  # no member joined, left, expired or drained
            plan = self.current_plan(job.id)
            planned = {m.member_id for m in plan.members} | set(plan.spares) if plan else set()
            alive = {m.id for m in self.members(job.id) if not m.draining}
            if plan is not None and planned == alive:
                self._fingerprints[job.id] = fingerprint
                continue
            lost = sorted(planned - alive)
            joined = sorted(alive - planned)
            reason = "; ".join(
                part for part in (
                    f"lost {', '.join(lost)} (liveness timeout)" if lost else "",
                    f"admitted {', '.join(joined)}" if joined else "",
                ) if part
            ) or "initial plan"
            try:
                self.change(job.id, reason)
            except (Conflict, NotFound) as e:
                log.info("reconcile %s: %s", job.id, e)

    def flush_progress(self) -> None:
        """Writes reported progress of jobs that changed since their last write."""
        for job_id in list(self._dirty):
            try:
                self.change(job_id, self._events.get(job_id, "progress"))
            except (Conflict, NotFound) as e:
                log.info("flush %s: %s", job_id, e)

    # -- used by the membership and job-control layers ---------------------------------

    def remember_lease(self, member_id: str, lease_id: int) -> None:
        self._lease_of[member_id] = lease_id

    def forget_member(self, member_id: str) -> None:
        self._lease_of.pop(member_id, None)

    def lease_of(self, job_id: str, member_id: str, store: Store | None = None) -> int:
        """The member's lease id (cached), read with `store` (default: ours) on a miss."""
        lease = self._lease_of.get(member_id)
        if lease is None:
            entry = (store or self.store).get(keys.member(job_id, member_id))
            if entry is None:
                raise NotFound(
                    f"member {member_id!r} of job {job_id!r} is not registered (expired or "
                    "left): stop local ranks and join again"
                )
            lease = self._lease_of[member_id] = entry.lease_id
        return lease

    def require_state(self, job: pb.Job, allowed: Collection[int], action: str) -> None:
        if job.status.state not in allowed:
            raise FailedPrecondition(
                f"cannot {action} job {job.id}: it is {pb.JobState.Name(job.status.state)}"
            )
