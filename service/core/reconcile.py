"""The leader's reconcile loop: joins, expired members and stop rules turn
into changes of the job (`Coordinator.change`).

A background thread of every replica (`Reconciler`) that acts only while
its replica leads. Each pass reads every job, takes its members' fingerprint
from the leader's watch on them (`memberwatch`: no read; from etcd, as a
count and a sorted read per job, while that watch may have missed an event)
and replans a job whose members no longer match its plan, once its
membership has settled (`SETTLE_S`, `MAX_SETTLE_S`,
`STORM_SETTLE_S_PER_MEMBER`: a join storm or a failure burst is one
generation); then applies the job's stop rules (`stoprules`), flushes
history and, every ``progress_flush_s``, reported progress. What it
remembers of a job (the membership being settled, the fingerprint last
found in line with the plan, the error last logged) is in the job's
`jobstate.JobState`, dropped with it on a leadership change: a new leader
waits for an unsettled membership afresh.
"""

from __future__ import annotations

import logging
import threading
import time

from springback.client.errors import (
    Conflict, FailedPrecondition, NotFound, NotLeader, SpringbackError, StoreUnavailable,
)
from springback.service.policy import planner
from springback.service.core.coordinator import Coordinator
from springback.service.core.jobstate import Unsettled
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

SETTLE_S = 0.3
"""Membership unchanged this long: the reconcile loop replans (see `Reconciler.settled`)."""
MAX_SETTLE_S = 2.0
"""Longest a membership change waits for the burst around it to end, at
small scale; see `STORM_SETTLE_S_PER_MEMBER`."""
STORM_SETTLE_S_PER_MEMBER = 0.001
"""Under a burst that does not end (a join storm), the longest wait grows by
this much per member: a generation costs every replica O(members) (the plan
read, planned, written, and a slice sent to each member's stream), so
generations at most every ``members x 1 ms`` keep a storm of N joins to a few
generations (10 s apart at 10,000 members) instead of one every
`MAX_SETTLE_S`, each of which re-sent N slices while the joins queued. A
burst that pauses for `SETTLE_S` is planned at once, whatever its size."""
RECONCILE_MIN_GAP_S = 0.05
"""Kicks (one per join) closer than this are one reconcile pass: a storm of
joins does not re-read every job per join."""
NAMED_IN_REASON = 20
"""Members a reconcile's reason names per kind (admitted, lost); more are
counted ("and 9,980 more"): a reason is stored in the plan, the job's
status and the history event, all in one etcd transaction."""


def _named(member_ids: list[str]) -> str:
    """The first `NAMED_IN_REASON` of `member_ids`, and how many more."""
    named = ", ".join(member_ids[:NAMED_IN_REASON])
    more = len(member_ids) - NAMED_IN_REASON
    return f"{named} and {more:,} more" if more > 0 else named


class Reconciler:
    """The reconcile loop of one replica over its `Coordinator` (see the module docstring)."""

    def __init__(self, coordinator: Coordinator, *, interval_s: float = 0.2,
                 settle_s: float = SETTLE_S, max_settle_s: float = MAX_SETTLE_S) -> None:
        self.coordinator = coordinator
        self.interval_s = interval_s
        self.settle_s = settle_s
        self.max_settle_s = max_settle_s
        self.num_loop_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reconcile", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the loop after its current pass (waits for it 5 s at most)."""
        self._stop.set()
        self.coordinator.kicked.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        c = self.coordinator
        last_flush = time.monotonic()
        while not self._stop.is_set():
            c.kicked.wait(min(self.interval_s, self.settle_s) if c.settling()
                          else self.interval_s)
            self._stop.wait(RECONCILE_MIN_GAP_S)  # the kicks of a burst: one pass
            c.kicked.clear()
            if self._stop.is_set() or not c.election.is_leader():
                continue
            try:
                c.member_watch.refresh()  # (re)started or checked; never raises
                self.reconcile()
                c.history.flush()
                if time.monotonic() - last_flush >= c.progress_flush_s:
                    c.flush_progress()
                    last_flush = time.monotonic()
            except SpringbackError as e:
                self.num_loop_errors += 1
                log.warning("reconcile: %s", e)
            except Exception:  # a bug: log it, count it, keep serving
                self.num_loop_errors += 1
                log.exception("reconcile failed")

    def settled(self, job_id: str, fingerprint: tuple[int, int]) -> bool:
        """Whether a job's changed membership has settled: unchanged for
        ``settle_s``, or ``max_settle_s`` since the first change not yet planned
        (a join storm or a failure burst becomes one generation, not one per
        event), a wait that grows with the members under a burst that does
        not pause (`STORM_SETTLE_S_PER_MEMBER`; `fingerprint[0]` counts them).
        `reconcile` skips the wait for a job that is full."""
        now = time.monotonic()
        state = self.coordinator.job_state(job_id)
        unsettled = state.unsettled
        if unsettled is None or unsettled.fingerprint != fingerprint:
            first = unsettled.first_seen if unsettled else now
            unsettled = state.unsettled = Unsettled(first, fingerprint, now)
        longest = max(self.max_settle_s, fingerprint[0] * STORM_SETTLE_S_PER_MEMBER)
        if (now - unsettled.last_change < self.settle_s
                and now - unsettled.first_seen < longest):
            return False
        state.unsettled = None
        return True

    def reconcile(self) -> None:
        """Replans every live job whose members no longer match its plan, once
        its membership has settled (`settled`).

        This is how joins, expired members (lease gone), and changes a previous
        leader did not finish, turn into new generations. Reads only, unless
        something changed. Then each job's stop rules (`_apply_stop_rules`).

        One job's error never stops the others' replans: anything but an
        unreachable store or a lost leadership (which stop the pass) is logged
        with the job's id, counted in ``num_loop_errors``, and the pass goes
        on; the job is tried again next pass.
        """
        for job in self.coordinator.list_jobs():
            try:
                self._reconcile_job(job)
                self._apply_stop_rules(job)
            except (StoreUnavailable, NotLeader):
                raise
            except (Conflict, NotFound) as e:
                log.info("reconcile %s: %s", job.id, e)
            except Exception as e:  # one job's bug: log it, count it, replan the others
                self.num_loop_errors += 1
                said = f"{type(e).__name__}: {e}"
                state = self.coordinator.job_state(job.id)
                if state.reconcile_error != said:  # once, not every pass
                    state.reconcile_error = said
                    log.exception("reconcile %s failed", job.id)

    def _reconcile_job(self, job: pb.Job) -> None:
        """`reconcile` for one job."""
        c = self.coordinator
        if planner.is_terminal(job.status.state):
            return
        fingerprint = c.member_watch.fingerprint(job.id)
        state = c.job_state(job.id)
        if state.fingerprint == fingerprint:
            return  # no member joined, left, expired or drained
        # More may come: one generation for the whole burst. Unless the job
        # is full: more joins could only be spares, so waiting gains nothing.
        # The members are read only then: fewer keys than max_workers
        # (fingerprint[0]) cannot be full, and a storm re-read them per pass.
        settled = self.settled(job.id, fingerprint)
        if not settled and fingerprint[0] < job.spec.max_workers:
            return
        members = c.members(job.id)
        alive = {m.id for m in members if not m.draining}
        full = len(alive) >= job.spec.max_workers
        if not settled and not full:
            return
        state.unsettled = None
        plan = c.current_plan(job.id)
        planned = {m.member_id for m in plan.members} | set(plan.spares) if plan else set()
        for gone in planned - {m.id for m in members}:
            c.leases.forget(gone)  # fenced: its credential is refused now (`revocation`)
        if plan is not None and planned == alive:
            state.fingerprint = fingerprint
            return
        lost = sorted(planned - alive)
        joined = sorted(alive - planned)
        reason = "; ".join(
            part for part in (
                f"lost {_named(lost)} (liveness timeout)" if lost else "",
                f"admitted {_named(joined)}" if joined else "",
            ) if part
        ) or "initial plan"
        # a loss and a join in one pass: the loss wins (`history.KIND_PRECEDENCE`)
        kind = (js.CHANGE_KIND_NODE_LOST if lost else js.CHANGE_KIND_JOIN if joined
                else js.CHANGE_KIND_START)
        c.change(job.id, reason, kind=kind,
                 named={*lost[:NAMED_IN_REASON], *joined[:NAMED_IN_REASON]})

    def _apply_stop_rules(self, job: pb.Job) -> None:
        """Pauses or fails `job` (its spec's ``controls.stop.action``) when one
        of its stop rules is crossed (`stoprules`), in one change whose reason
        names the rule and its figures. The change lands only if the job
        still runs when it is written: a job paused, failed or waiting
        meanwhile is left as it is (nothing written). A `Conflict` after
        `CHANGE_ATTEMPTS` is the caller's; the rule is evaluated again a
        check later."""
        c = self.coordinator
        now = time.time()
        if not c.stop_rules.due(job, now):
            return
        said = c.stop_rules.verdict(job, c.history.events(job.id), now)
        if said is None:
            return
        fail = job.spec.controls.stop.action == pb.STOP_ACTION_FAIL
        reason = f"controls.stop: {said}: {'failed' if fail else 'paused'}"

        def stop(current: pb.Job) -> None:
            c.require_state(current, (pb.JOB_STATE_RUNNING,), "stop")
            current.status.state = pb.JOB_STATE_FAILED if fail else pb.JOB_STATE_PAUSED

        try:
            c.change_with_retry(job.id, reason, stop, kind=js.CHANGE_KIND_CONTROL)
        except FailedPrecondition as e:
            log.info("job %s: stop rule not applied: %s", job.id, e)
            return
        log.warning("job %s: %s", job.id, reason)
