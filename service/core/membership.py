"""Members of a job: join, liveness, drain, leave, rank failures, reports.

A member is alive exactly while its etcd key exists; the key is bound to a
lease of ``liveness_timeout_s`` that each Heartbeat renews (a lease renewal,
not a key write; served on every replica's loop, see `heartbeats`). When the lease expires etcd deletes the key and the
leader's reconcile loop makes a new generation. A member whose key is gone is
*fenced*: its heartbeats get NOT_FOUND and its reports FAILED_PRECONDITION,
so a node that was paused (SIGSTOP) and wakes up changes nothing and must
join again as a new member.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import math
import re
import time
import uuid

import grpc

from springback.service.core import departures, fencing
from springback.service.etcd import keys
from springback.service.policy import planner
from springback.service.core.coordinator import Coordinator, timestamp_now
from springback.client.errors import (
    FailedPrecondition, InvalidArgument, NotFound, SpringbackError,
)
from springback.service.policy.failures import (
    DEFAULT_MAX_PER_STEP,
    DEFAULT_STORAGE_OUTAGE_S,
    DEFAULT_WINDOW_S,
    UNSTARTED_FACTOR,
    FailureStreaks,
)
from springback.service.etcd.liveness import EtcdReachability
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

log = logging.getLogger(__name__)


_MAX_TOKEN = 128
_HOST = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?|\[?[0-9A-Fa-f:.]+\]?")
"""A DNS name, an IPv4 address or an IPv6 address (bracketed or not)."""
_MAX_HOST = 253


MIN_SPARE_SLOTS = 8
"""See `members_cap`."""


def members_cap(spec: pb.JobSpec) -> int:
    """Most members a job may have registered at once: ``max_workers`` plus as
    many spares (at least `MIN_SPARE_SLOTS`), room for every node to rejoin
    before its old member expires. A join beyond it is RESOURCE_EXHAUSTED."""
    return spec.max_workers + max(spec.max_workers, MIN_SPARE_SLOTS)


class TooManyMembers(SpringbackError):
    """A join beyond `members_cap`; nothing is written."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


def validate_join(host: str, rendezvous_port: int, num_local_ranks: int, join_token: str) -> None:
    """INVALID_ARGUMENT naming the first bad field of a join; no I/O (every
    replica checks before forwarding, the leader again)."""
    if not host:
        raise InvalidArgument("host", "is required")
    if len(host) > _MAX_HOST or not _HOST.fullmatch(host):
        raise InvalidArgument("host", f"{host[:64]!r} is not a host name or IP address "
                                      f"(at most {_MAX_HOST} characters)")
    if not 0 < rendezvous_port < 65536:
        raise InvalidArgument("rendezvous_port", f"{rendezvous_port} is not a TCP port")
    if not 0 < num_local_ranks <= planner.MAX_LOCAL_RANKS:
        raise InvalidArgument("num_local_ranks", f"{num_local_ranks} is outside "
                                                 f"1..{planner.MAX_LOCAL_RANKS}")
    if len(join_token) > _MAX_TOKEN or not (join_token.isascii() and join_token.isprintable()):
        raise InvalidArgument("join_token", f"must be at most {_MAX_TOKEN} printable ASCII characters")


def _member_id(job_id: str, join_token: str) -> str:
    """A fresh random id, or with a token one derived from (job, token)."""
    if not join_token:
        return f"m-{uuid.uuid4().hex[:8]}"
    return "m-" + hashlib.sha256(f"{job_id}\0{join_token}".encode()).hexdigest()[:12]


class Membership:
    def __init__(self, coordinator: Coordinator,
                 liveness: EtcdReachability | None = None) -> None:
        self.coordinator = coordinator
        self._streaks = FailureStreaks()
        self.liveness = liveness

    @property
    def liveness_timeout_s(self) -> float:
        return self.coordinator.liveness_timeout_s

    def join(self, job_id: str, host: str, rendezvous_port: int, num_local_ranks: int,
             join_token: str = "") -> tuple[pb.Member, int]:
        """Registers a member (one fenced etcd transaction) and returns it with
        the id of the etcd lease its key is bound to (its incarnation, which
        its credential names: `revocation`); the leader's
        reconcile loop plans it (admitted, or a spare) once the joins around it
        have settled (`Reconciler.settled`): a join storm is one generation.
        The servicer waits for that plan before it answers (`PlanStreams.until_planned`).

        With a `join_token` the call is idempotent: the member id is derived
        from (job, token), so a retry whose first attempt registered the
        member (its reply was lost) returns that member instead of
        registering a phantom that would be planned ranks until its lease
        expired. A token reused with another host, port or rank count is
        INVALID_ARGUMENT. A retry arriving after the member already expired
        registers it afresh under the same id. Without a token every call
        registers a new member. A bad field is INVALID_ARGUMENT naming it
        (`validate_join`); a join when the job has `members_cap` members is
        RESOURCE_EXHAUSTED (`TooManyMembers`), unless it is the retry of one
        that landed; joins racing at the cap may pass it together. Both
        write nothing.
        """
        validate_join(host, rendezvous_port, num_local_ranks, join_token)
        coordinator = self.coordinator
        fence = coordinator.election.fence()  # taken first: see Coordinator.change
        job = coordinator.get_job(job_id)
        if planner.is_terminal(job.status.state):
            raise FailedPrecondition(
                f"job {job_id} is {pb.JobState.Name(job.status.state)}: nothing to join"
            )
        member = pb.Member(
            id=_member_id(job_id, join_token), job_id=job_id, host=host,
            rendezvous_port=rendezvous_port, num_local_ranks=num_local_ranks,
            join_token=join_token,
        )
        key = keys.member(job_id, member.id)
        store = coordinator.store
        cap = members_cap(job.spec)
        if store.count(keys.members(job_id)) >= cap and not (
                join_token and self._registered(key, member)):  # a retry of a join that landed
            raise TooManyMembers(f"members: job {job_id} has its {cap} members "
                                 "(members_cap: max_workers plus as many spares, at least "
                                 f"{MIN_SPARE_SLOTS}); join when one leaves")
        # Create first, read the member only when that fails: a first attempt
        # (nearly every join) costs the cap's count (one count-only read: the
        # newest-revision half of a fingerprint made etcd sort every member
        # key at each join, O(N^2) in a storm), a lease grant and one transaction.
        member.joined_at.CopyFrom(timestamp_now())
        lease = store.grant_lease(max(2, math.ceil(self.liveness_timeout_s)))
        if coordinator.writer.create(key, member.SerializeToString(), lease=lease, fence=fence):
            coordinator.leases.remember(member.id, lease.id)
            lease_id = lease.id
        else:
            store.revoke_lease(lease.id)
            coordinator.election.fence()  # NotLeader if that is why the create failed
            # An earlier attempt of this join (a retry), or a concurrent one, registered it.
            found = self._registered(key, member) if join_token else None
            if found is None:
                raise FailedPrecondition(f"member id {member.id} collided; join again")
            member, lease_id = found
        coordinator.kick()  # the reconcile loop plans it, with the joins around it
        return member, lease_id

    def _registered(self, key: str, wanted: pb.Member) -> tuple[pb.Member, int] | None:
        """The member already registered under `key` by the same join, and its
        lease, if any."""
        entry = self.coordinator.store.get(key, pb.Member)
        if entry is None:
            return None
        found = entry.value
        if (found.join_token, found.host, found.rendezvous_port, found.num_local_ranks) != (
                wanted.join_token, wanted.host, wanted.rendezvous_port, wanted.num_local_ranks):
            raise InvalidArgument(
                "join_token", f"already used by member {found.id} ({found.host}:"
                f"{found.rendezvous_port}, {found.num_local_ranks} ranks); use a new token per join")
        self.coordinator.leases.remember(found.id, entry.lease_id)
        return found, entry.lease_id

    def leave(self, job_id: str, member_id: str, reason: str, preempted: bool = False) -> None:
        """Removes the member and replans, recorded as a leave, or as a
        preemption when `preempted` (the end of a preempted member's drain).
        Idempotent: leaving twice is fine."""
        coordinator = self.coordinator
        coordinator.require_leader()
        entry = coordinator.store.get(keys.member(job_id, member_id))
        coordinator.leases.forget(member_id, entry.lease_id if entry else None)
        if entry is None:
            return
        left = f"{member_id} left: {reason or 'no reason given'}"
        kind = js.CHANGE_KIND_PREEMPTED if preempted else js.CHANGE_KIND_LEAVE
        departures.note(coordinator, job_id, member_id, left, kind)
        coordinator.store.revoke_lease(entry.lease_id)  # deletes the key with it
        coordinator.change_with_retry(job_id, left, kind=kind, named={member_id})

    def drain(self, job_id: str, member_id: str, reason: str, preempted: bool = False) -> bool:
        """Announces that a member is leaving soon (preemption, SIGTERM).

        When other members will still hold the state, or this one holds none
        (its ranks never proved any), the member is marked draining and a
        generation without it is made at once: returns False (no checkpoint
        needed). When it is the last proven holder, nothing changes and True
        is returned: the member must checkpoint, then leave. The generation
        is recorded as a drain, or as a preemption when `preempted` (the
        scheduler takes the node back; the member says so, its reason's text
        never decides it).
        """
        coordinator = self.coordinator
        coordinator.require_leader()
        key = keys.member(job_id, member_id)
        entry = coordinator.store.get(key, pb.Member)
        if entry is None:
            raise NotFound(f"member {member_id!r} of job {job_id!r} is not registered")
        holders = set(coordinator.get_job(job_id).status.state_holders)
        others = [
            m for m in coordinator.members(job_id)
            if m.id != member_id and m.id in holders and not m.draining
        ]
        if member_id in holders and not others:
            return True
        member = entry.value
        member.draining = True
        txn = coordinator.store.txn

        def mark_draining() -> list:
            return [txn.put(key, member.SerializeToString(), lease=entry.lease_id)]

        coordinator.change_with_retry(
            job_id, f"{member_id} draining: {reason or 'no reason given'}",
            kind=js.CHANGE_KIND_PREEMPTED if preempted else js.CHANGE_KIND_DRAIN,
            extra_ops=mark_draining, draining={member_id},
        )
        return False

    def report_failure(self, job_id: str, member_id: str, generation: int, reason: str,
                       state_kept: bool = False, job_fatal: bool = False,
                       storage_unavailable: bool = False) -> int:
        """A local rank died: that member's ranks no longer hold the state, and
        a new generation is made at once. With `state_kept` a live rank says
        its generation broke (a collective failed: a reset link, a peer's
        error) while no process of this member died: the member stays a state
        holder and the generation is made again with the members that live.

        A report of an older generation is accepted too (every rank crashing
        together: the second agent reports after the first one's replan); it
        makes no new generation unless the member is in the current plan.
        Fenced in the transaction (`fencing.change_as_member`): a generation
        newer than the current one is FAILED_PRECONDITION, an expired member
        NOT_FOUND.

        What counts toward the crash-loop rule (`failures.FailureStreaks`):
        one event per generation (several reports of one generation count
        once), and a `state_kept` break only in a generation that started (a
        rendezvous that a crashed peer never joined is that crash's
        consequence, not a second event; `failures.UNSTARTED_FACTOR` x
        ``max_per_step`` such breaks in a row still end the job). When
        failures repeat without
        progress, or at once with `job_fatal` (the ranks agreed that no
        membership can go on, e.g. a placement nothing can restore), the job
        ends FAILED with the reason instead.

        With `storage_unavailable` (and `state_kept`) the generation could not
        start because the store refused its restore past the retry budget:
        nothing is counted, the job's message says it waits for storage
        since the first such report (``status.storage_unavailable_since``,
        cleared by the next start), the generation is made again, and the job
        ends FAILED naming storage only once the outage passed
        ``failures.storage_outage_s``. Returns the job's generation.
        """
        coordinator = self.coordinator
        coordinator.require_leader()
        fencing.report_fence(coordinator, job_id, member_id, generation, older=True)
        if storage_unavailable:
            return self._storage_unavailable(job_id, member_id, generation, reason)
        job = coordinator.get_job(job_id)
        policy = job.spec.failures
        limit = policy.max_per_step or DEFAULT_MAX_PER_STEP
        newest_start = coordinator.history.newest_start(job_id)
        counted = not state_kept or newest_start is None or newest_start >= generation
        streak = self._streaks.record(
            job_id, step=job.status.step, generation=generation, now=time.monotonic(),
            max_per_step=limit, window_s=policy.window_s or DEFAULT_WINDOW_S, counted=counted)
        unstarted = 0 if counted else self._streaks.record_unstarted(
            job_id, generation=generation, newest_start=newest_start or 0)
        what = reason or ("a collective failed" if state_kept else "rank exited")

        def count(job: pb.Job) -> None:
            job.status.num_failures += 1
            if ((job_fatal or streak >= limit or unstarted >= UNSTARTED_FACTOR * limit)
                    and not planner.is_terminal(job.status.state)):
                job.status.state = pb.JOB_STATE_FAILED

        if job_fatal:
            message = f"failed: {member_id}: {what}"
        elif streak >= limit:
            message = (f"failed: {streak} generations broke by rank failures at step "
                       f"{job.status.step} without progress; last: {member_id}: {what}")
        elif unstarted >= UNSTARTED_FACTOR * limit:
            message = (f"failed: {unstarted} generations in a row could not start (their "
                       f"rendezvous broke); last: {member_id}: {what}")
        elif state_kept:
            message = f"generation {generation} broke on {member_id} (state kept): {what}"
        else:
            message = f"{member_id} reported a failure: {what}"
        # A break that kept the state is no rank's failure (a peer's, counted
        # on its own report, or a link's); an ended job records FINISH.
        kind = js.CHANGE_KIND_OTHER if state_kept else js.CHANGE_KIND_RANK_FAILURE
        job = fencing.change_as_member(
            coordinator, job_id, member_id, generation, message, count, kind=kind, older=True,
            stateless=() if state_kept else {member_id}, replan_if_current=True)
        return job.status.generation

    def _storage_unavailable(self, job_id: str, member_id: str, generation: int,
                             reason: str) -> int:
        """`report_failure` with `storage_unavailable`: wait, or fail past the limit."""
        now = time.time()
        limit = self.coordinator.get_job(job_id).spec.failures.storage_outage_s \
            or DEFAULT_STORAGE_OUTAGE_S
        said = [""]

        def wait_for_storage(job: pb.Job) -> str:
            status = job.status
            if not status.HasField("storage_unavailable_since"):
                status.storage_unavailable_since.FromNanoseconds(int(now * 1e9))
            since = status.storage_unavailable_since.ToDatetime(tzinfo=datetime.timezone.utc)
            lasted = now - status.storage_unavailable_since.ToNanoseconds() / 1e9
            if lasted > limit and not planner.is_terminal(status.state):
                status.state = pb.JOB_STATE_FAILED
                said[0] = (f"failed: storage unavailable for {lasted:.0f}s (past "
                           f"failures.storage_outage_s {limit}); last: {member_id}: {reason}")
            else:
                said[0] = (f"waiting: storage unavailable since {since:%Y-%m-%dT%H:%M:%SZ} "
                           f"({lasted:.0f}s, failing after {limit}s): {reason}")
            return said[0]

        job = fencing.change_as_member(
            self.coordinator, job_id, member_id, generation, "storage unavailable",
            wait_for_storage, kind=js.CHANGE_KIND_OTHER, older=True, stateless=(),
            replan_if_current=True)
        log.warning("job %s: %s", job_id, said[0])
        return job.status.generation
