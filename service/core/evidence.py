"""Fencing a lost node on its peers' evidence, before its lease expires.

A member is normally lost when its lease expires: the liveness timeout (5 s
by default) after its last heartbeat. A node whose processes died is visible
much sooner, from two independent sides:

1. **Its peers' sockets.** A rank that shares a collective with the dead
   node's ranks gets gloo's "connection closed/reset by peer [ip]:port" at
   once: the kernel of the dead process's host closed its sockets. The rank
   maps the address to the peer's rank (worker/rank/rendezvous.py) and
   says so in a ReportFailure with ``lost_peer`` and its ``lost_rank``.
2. **Its agent's plan stream.** Every agent holds a WatchPlans stream to one
   replica. When the agent's process dies, its host's kernel closes the
   connection and the stream ends *by the client's side* (not by the
   server: not a STOP plan, not a fence, not a leader change). Streams on
   followers reach the leader as notes (`streamnotes`), each stream named by
   its id, so a stream opened on one replica and one ended on another are
   told apart whatever order their notes arrive in.

`PeerLossEvidence` fences the member (its lease revoked, a generation made
without it) the moment both are true: a live member planned in the current
generation reported a connection reset from a rank of the suspect, and the
suspect's plan stream was ended by the client and no other stream of it is
open on any replica (as far as the notes tell). The two halves may arrive in either order; each is
kept for ``window_s`` (the liveness timeout: later, the lease has expired
anyway).

Why this cannot fence a healthy node:

* A stopped (SIGSTOP) or hung node keeps every socket open: its kernel still
  answers, so peers see a *timeout*, not a reset, and its plan stream stays
  open. Neither half happens; it goes by the liveness timeout.
* A partitioned node's packets are lost, not refused: timeouts again, and no
  end of stream reaches the leader before gRPC's own keepalive gives up.
* A node whose *rank* crashed (its agent alive) makes peers see a reset, but
  its agent's stream stays open: no fence; the agent reports the crash
  itself and keeps its membership.
* A live rank that leaves a broken generation shuts its connections to its
  peers (worker/rank/rendezvous.py), so they see "closed by peer" naming it: the
  first half only; its agent's stream is open.
* An agent that merely reconnects its stream (another replica, a network
  blip) opens a new one at once, which clears the first half; its ranks'
  sockets are unaffected, so the second half does not come.

Only the leader fences. Both halves live in the leader's memory: a leader
change forgets them (back to the liveness timeout until new notes come). A
stream opened on a follower before the leader learned of it is not known;
that can only keep a "vanished" half from forming when an *older* stream of
the same member ends, so it is slower, not looser — except for one narrow
case, documented in docs/liveness.md: a follower that cannot reach the
leader for longer than the window drops its notes, and an "opened" note so
dropped lets an older stream's end, relayed by another replica, look like a
vanished agent; a fence then still needs a peer's reset in the current
generation, which a live agent's ranks do not give without a crash that its
agent reports (a new generation, which discards the reset).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from springback.client import plans
from springback.service.core import departures, fencing
from springback.service.etcd import keys
from springback.service.core.coordinator import Coordinator
from springback.client.errors import FailedPrecondition, SpringbackError
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

_Key = tuple[str, str]  # (job id, member id)


@dataclass
class _Suspect:
    open_streams: set[str] = field(default_factory=set)  # ids of its streams known open
    vanished_at: float | None = None  # a stream ended by the client, none open since
    resets: dict[str, tuple[int, float]] = field(default_factory=dict)  # reporter -> (gen, t)


class PeerLossEvidence:
    """Leader memory of plan streams and peers' reset reports; see the module
    docstring. Thread-safe; the fence runs outside the lock."""

    def __init__(self, coordinator: Coordinator, window_s: Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.coordinator = coordinator
        self._window_s = window_s or (lambda: coordinator.liveness_timeout_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._suspects: dict[_Key, _Suspect] = {}
        self.num_fenced = 0

    # -- half 2: the agent's plan stream ----------------------------------------

    def stream_opened(self, job_id: str, member_id: str, stream_id: str) -> None:
        """A WatchPlans stream `stream_id` of `member_id` opened (on any
        replica): known open (an agent that reconnects clears the "vanished"
        half). Without a member id, nothing is recorded. Memory only; never
        blocks."""
        if not member_id:
            return
        with self._lock:
            suspect = self._suspects.setdefault((job_id, member_id), _Suspect())
            suspect.open_streams.add(stream_id)
            suspect.vanished_at = None

    def stream_ended(self, job_id: str, member_id: str, stream_id: str, *,
                     by_client: bool) -> None:
        """That stream ended; `by_client` when the RPC was cancelled from the
        agent's side (its process gone, or it hung up) rather than finished by
        the server (STOP, a fence, an error). Blocking (the generation may be
        read from etcd): called off the event loop (`streamnotes`' relay
        thread, the ReportPlanStreams handler); a fence it decides runs on a
        thread of its own. Without a member id, nothing is recorded."""
        if not member_id:
            return
        key = (job_id, member_id)
        try:
            generation = self.coordinator.current_generation(job_id)
        except SpringbackError:
            generation = -1  # etcd unreachable: no verdict, only the count
        with self._lock:
            suspect = self._suspects.setdefault(key, _Suspect())
            suspect.open_streams.discard(stream_id)
            if not by_client or suspect.open_streams:
                return
            suspect.vanished_at = self._clock()
            ready = self._convicted(suspect, generation)
        if ready is not None:
            self._fence_in_background(key, ready)

    # -- half 1: a peer's connection reset ---------------------------------------

    def reset_reported(self, job_id: str, reporter: str, generation: int,
                       lost_rank: int) -> int:
        """A rank of `reporter` saw a connection reset from `lost_rank` in
        `generation`; the suspect is the member that runs that rank in the
        plan. Fenced like any report (`fencing.report_fence`: NOT_FOUND for
        an expired reporter, FAILED_PRECONDITION for a stale generation); a
        rank that no other member runs in the current plan (the reporter's
        own, or none) is FAILED_PRECONDITION (nothing recorded). Fences the
        suspect at once (synchronously) when its agent has vanished too; else
        keeps the report as evidence. Idempotent. Returns the job's generation."""
        coordinator = self.coordinator
        coordinator.require_leader()
        fencing.report_fence(coordinator, job_id, reporter, generation)
        plan = coordinator.current_plan(job_id)
        lost_member_id = plans.member_of_rank(plan, lost_rank) if plan is not None else None
        if lost_member_id is None or lost_member_id == reporter:
            raise FailedPrecondition(
                f"job {job_id}: lost_rank {lost_rank} is not a peer of "
                f"{reporter}'s ranks in generation {generation}")
        key = (job_id, lost_member_id)
        with self._lock:
            suspect = self._suspects.setdefault(key, _Suspect())
            suspect.resets[reporter] = (generation, self._clock())
            ready = self._convicted(suspect, generation)
        log.info("job %s: %s saw rank %d (%s) reset its connection in generation %d%s",
                 job_id, reporter, lost_rank, lost_member_id, generation,
                 "; its agent is gone too: fencing" if ready else "")
        if ready is not None:
            self._fence(key, ready)
        return coordinator.current_generation(job_id)

    # -- the verdict -----------------------------------------------------------------

    def _convicted(self, suspect: _Suspect, generation: int) -> str | None:
        """Under the lock: the reason to fence when both halves hold within the
        window (and no stream is open), else None. Only resets seen in the
        current `generation` count: a reset from a rank that crashed on a
        live node was followed by its agent's own report, which made a new
        generation, so a later stream reconnect of that agent fences nothing."""
        now = self._clock()
        window = self._window_s()
        suspect.resets = {r: (g, t) for r, (g, t) in suspect.resets.items()
                          if now - t <= window and g == generation}
        if suspect.open_streams or suspect.vanished_at is None or not suspect.resets:
            return None
        if now - suspect.vanished_at > window:
            return None
        witnesses = ", ".join(sorted(suspect.resets))
        return f"its agent's plan stream closed and {witnesses} saw its ranks' connections reset"

    def _fence_in_background(self, key: _Key, why: str) -> None:
        threading.Thread(target=self._fence, args=(key, why), daemon=True,
                         name="peer-loss-fence").start()

    def _fence(self, key: _Key, why: str) -> None:
        """Revokes the suspect's lease (etcd deletes its member key with it) and
        makes a generation without it. A member already gone is left alone
        (the reconcile loop or an earlier fence replanned)."""
        job_id, member_id = key
        coordinator = self.coordinator
        with self._lock:
            self._suspects.pop(key, None)
        try:
            entry = coordinator.store.get(keys.member(job_id, member_id), pb.Member)
            if entry is None:
                return
            coordinator.leases.forget(member_id, entry.lease_id)
            reason = f"lost {member_id} (peers: {why})"
            departures.note(coordinator, job_id, member_id, reason, js.CHANGE_KIND_NODE_LOST)
            coordinator.store.revoke_lease(entry.lease_id)
            self.num_fenced += 1
            coordinator.change_with_retry(job_id, reason, kind=js.CHANGE_KIND_NODE_LOST,
                                          named={member_id})
        except SpringbackError as e:  # etcd down, leadership lost: the lease decides
            log.warning("fencing %s of job %s on peer evidence: %s", member_id, job_id, e)
