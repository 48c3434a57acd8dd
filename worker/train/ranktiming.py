"""Per-rank step timing, the earliest precursor of a straggler (issue 46):
how long each rank computes before its step's collective, and how long it
then waits in it. Observational only: nothing acts on it yet.

Each rank times its own steps (`RankTiming`):

* *compute*: from its batch being handed out (`Generation.batches`) to its
  entering the step's first library collective: `Generation.ddp`'s gradient
  all-reduce (a CPU bucket's comm hook), a sharded layout's optimizer step
  pre-hook (`StepBoundary.reach`), `check_step`'s vote, or, when none of
  those ran, the step boundary's own wait for the previous vote.
* *collective*: from entering that collective to the step's last library
  collective completing (DDP: the last bucket's all-reduce future).

In synchronous training a slow rank computes longer and waits less: the
others enter the collective first and wait for it. Collectives the library
does not see (a script's own DDP wrapper, FSDP's all-gathers, NCCL work that
has not synchronised with the host) count as compute; on CUDA the figures
are host times.

A step's figures ride its *next* step's vote (one slot per rank, no
collective of its own: `boundary.Vote.timing`), so rank 0 learns every rank's
timing of each step and keeps, per member, a window of its last
`TIMING_WINDOW` steps (`MemberTimings`): per step the member's slowest local
rank's compute and its least-waiting local rank's collective time. The
medians go with rank 0's step reports (at most one every
`reporter.STEP_REPORT_INTERVAL_S`, computed by the reporter's thread), by
node rank: a rank's plan is its member's slice, which names no other member
(client/plans.py); the coordinator names each node's member from its whole
plan and shows the newest figures in ``JobStatus.member_timing``.

Cost per step: on every rank two clock reads and a few float writes; on rank
0 a pass over the world's slots (one append per node). No extra collective,
no I/O.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence

from springback.client.plans import node_starts
from springback.v1 import types_pb2 as pb

TIMING_WINDOW = 50
"""Steps the medians are over: long enough that one slow step (a
checkpoint, a garbage collection) does not move them, short enough to follow
a node that became slow."""

UNKNOWN = -1.0
"""A timing slot's value when the rank has no finished step yet."""


class RankTiming:
    """One rank's marks of its current step and the figures of its last
    finished one. `enter` and `complete` may be called from gloo's threads
    (DDP's bucket futures): each is one float write."""

    def __init__(self) -> None:
        self._began: float | None = None
        self._entered: float | None = None
        self._completed: float | None = None
        self.last: tuple[float, float] = (UNKNOWN, UNKNOWN)
        """(compute_s, collective_s) of the last finished step with a collective."""

    def step_began(self) -> None:
        """A batch is handed out: the previous step is finished."""
        now = time.monotonic()
        began, entered, completed = self._began, self._entered, self._completed
        if began is not None and entered is not None:
            done = completed if completed is not None and completed >= entered else entered
            self.last = (max(entered - began, 0.0), done - entered)
        self._began, self._entered, self._completed = now, None, None

    def enter(self) -> bool:
        """The step enters a library collective; True when it is its first
        (`complete` then closes it)."""
        if self._entered is not None or self._began is None:
            return False
        self._entered = time.monotonic()
        return True

    def complete(self) -> None:
        """A library collective of the step completed (the last one counts)."""
        if self._entered is not None:
            self._completed = time.monotonic()


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


class MemberTimings:
    """Rank 0's window of every node's step timing in one generation, by
    node rank (`plan.nodes`: a slice's shape of the whole plan)."""

    def __init__(self, plan: pb.Plan) -> None:
        self._nodes = [(node, first, first + n)
                       for node, (first, n) in enumerate(node_starts(plan))]
        self._lock = threading.Lock()  # `add` on the step loop, `report` on the reporter's thread
        self._compute: list[collections.deque[float]] = [
            collections.deque(maxlen=TIMING_WINDOW) for _ in self._nodes]
        self._collective: list[collections.deque[float]] = [
            collections.deque(maxlen=TIMING_WINDOW) for _ in self._nodes]

    def add(self, compute_s: Sequence[float], collective_s: Sequence[float]) -> None:
        """One step's per-rank figures, by global rank (`UNKNOWN`: none)."""
        with self._lock:
            for node, first, end in self._nodes:
                known = [r for r in range(first, min(end, len(compute_s)))
                         if compute_s[r] >= 0 and collective_s[r] >= 0]
                if known:
                    self._compute[node].append(max(compute_s[r] for r in known))
                    self._collective[node].append(min(collective_s[r] for r in known))

    def report(self) -> list[pb.MemberTiming]:
        """Each node's medians, by `node_rank` (member_id unset: the
        coordinator names it); nodes with no timed step left out."""
        with self._lock:
            windows = [(node, list(self._compute[node]), list(self._collective[node]))
                       for node, _, _ in self._nodes]
        return [pb.MemberTiming(node_rank=node, compute_p50_s=_median(compute),
                                collective_p50_s=_median(collective), num_steps=len(compute))
                for node, compute, collective in windows if compute]
