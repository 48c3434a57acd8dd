"""The step-boundary agreement: each step's vote travels in the next step's
DDP gradient all-reduce, or in a sharded layout's next optimizer step's
wait for the world, or in one small MAX all-reduce of its own, overlapped
with the next step's compute.

At the end of every step each rank contributes a `Vote`: the newest
generation it has seen, whether its node is draining, whether its agent was
told that no survivor will hold the state, whether its step was bad (a
non-finite loss or gradient: `Generation.check_step`), and its share of the
step's loss.
The contributions are combined with one MAX all-reduce (the loss shares sit in
one slot per rank, every other slot is -inf, so the MAX of the slots is each
rank's share and their sum the step's loss). MAX of the generation seen is the
agreement itself: every rank gets the same newest generation, with no
arithmetic on ``world_size x generation`` that a rank's stale or skipped
contribution could bend.

The all-reduce of step k is started at the end of step k and waited for at
the end of step k+1, by which time it has long finished behind that step's
forward and backward: the step loop never waits for it. Every rank therefore
acts on the agreed vote of step k at the end of step k+1 (a switch to a new
plan happens one step later than it was seen, at the same step on every
rank). When the ranks leave the generation (a switch, a stop, the final
step) the last vote is waited for (`StepBoundary.settle`), so nothing is left
in flight and the last step's loss is known.

Carried by DDP (`Generation.ddp`): a DDP wrapper built by the library gets a
comm hook that appends the pending vote to the last gradient bucket of the
next step's all-reduce, so the agreement costs no collective of its own (on
the 2-core bench machine the separate all-reduce slowed every step of a
3-rank DDP job by 1-2 ms). A sum is all DDP's all-reduce does, so there the
vote sits in per-rank slots (generation seen, draining, last holder, loss
share; zero in every other rank's slot): each slot's sum is the one rank's
value, exact, and every rank takes the MAX of the generation slots itself.
Votes are carried only in float32/float64 CPU buckets; on CUDA (NCCL) reading
the vote back would make the step loop wait for the device, so the vote keeps
its own all-reduce on the group's gloo side. A step checked by
`Generation.check_step` (the bad-step policy) sends its vote there, in an
all-reduce of its own waited for at once (`vote_now`): every rank must know
before its optimizer step whether any rank's step was bad. A step whose backward did not
all-reduce (``no_sync``, an evaluation step) leaves its vote pending, and the
next boundary all-reduces it by itself, on every rank alike (DDP runs the
same buckets on every rank, or hangs).

Carried by the optimizer step of a layout whose ranks hold different pieces
of the state (`Generation` with pp, shard, tp or ep > 1: `MeshLayout.holds_pieces`):
before a rank applies a step, every rank must have reached that step (its
backward and its gradient reductions done), or a piece whose ranks finished
stepped while another broke on a dead peer, and the survivors held pieces of
different steps. That takes an all-reduce over the world at every
optimizer step, waited for before the step is applied (`reach`, an
optimizer step pre-hook), and the step's vote rides it: the vote of step k,
sent after step k's optimizer step, stays pending until step k+1's pre-hook
all-reduces it (the agreement is read at the end of step k+1, as above), so
such a step makes one collective of the boundary's, not two. The
order keeps the guarantee: no rank returns from step k+1's pre-hook before
every rank has entered it, whatever vote rides along (the generation's first
step, and a step whose vote `vote_now` already agreed, all-reduce an empty
vote). A step whose optimizer did not step leaves its vote to the next
boundary, which all-reduces it by itself.

Failure semantics: a peer that died makes `wait` raise what the collective
raises (a connection reset at once, a timeout after the group's collective
timeout), at the boundary of the step after the one the vote belongs to (a
sharded layout: in the next optimizer step's pre-hook, which then applies
nothing); ``with gen:`` takes it for a membership change. `abandon` drops a vote in
flight without waiting (the group is being torn down).

Each vote also carries its rank's timing of the step before it (compute
before the step's first library collective, time in the collectives:
`worker/train/ranktiming.py`) in two more per-rank slots; `Agreed` gives every
rank's, which rank 0 aggregates per member. The library's collectives here
mark the timing (`StepBoundary.timing`): the DDP comm hook, `reach`,
`vote_now`, and `vote` when nothing before it entered a collective.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from springback.worker.rank.rendezvous import handed_to_gloo
from springback.worker.train.ranktiming import UNKNOWN, RankTiming

_FIXED = 5  # generation seen, draining, last holder, bad, steady; then per rank: loss, compute,
# collective ("steady": a rank whose node is not draining; its max is 0 when every node drains)
_PER_RANK = 3  # per-rank slot rows of an own all-reduce: loss, compute, collective
_CARRIED = 7  # rows of per-rank slots a carried vote adds: generation seen, draining, last holder,
# bad, loss, compute, collective (every rank draining is the min of its draining row: no "steady")


@dataclasses.dataclass(frozen=True)
class Vote:
    """One rank's contribution at the end of one step."""

    step: int
    generation_seen: int
    loss_share: float  # this rank's loss x its batch / the global batch
    draining: bool
    last_holder: bool
    ended_t: float  # wall-clock time the step ended on this rank
    bad: bool = False  # this rank's loss or gradient was not finite
    timing: tuple[float, float] = (UNKNOWN, UNKNOWN)
    """This rank's (compute_s, collective_s) of its last finished step
    (`RankTiming.last`)."""


@dataclasses.dataclass(frozen=True)
class Agreed:
    """The combined votes of one step: the same on every rank."""

    step: int
    newest_generation: int
    loss: float  # the step's loss over the global batch
    draining: bool  # some rank's node is draining
    last_holder: bool
    ended_t: float  # this rank's own end of that step
    every_draining: bool = False  # every rank's node is draining
    bad: bool = False  # some rank's loss or gradient was not finite: not applied
    compute_s: tuple[float, ...] = ()  # by global rank: each rank's `Vote.timing`
    collective_s: tuple[float, ...] = ()


class StepBoundary:
    """The agreement of one generation's ranks; one per Generation."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.ddp_group: dist.ProcessGroup | None = None
        """Set by `Generation.ddp`: votes wait for the next all-reduce of the DDP
        wrapper over this group to carry them (`carry`)."""
        self.carried_by_step = False
        """Set by `Generation` for a layout holding pieces: votes wait for the
        next optimizer step's pre-hook all-reduce to carry them (`reach`)."""
        self._in_flight: tuple[Vote, torch.Tensor, dist.Work] | None = None
        self._pending: Vote | None = None  # for the next DDP all-reduce or `reach` to carry
        self._carried: tuple[Vote, torch.Tensor, torch.futures.Future, int] | None = None
        self._ready: Agreed | None = None  # agreed by `vote_now`, not collected yet
        self.timing = RankTiming()  # this rank's step timing, marked by the collectives here

    def vote(self, vote: Vote) -> Agreed | None:
        """Sends this step's vote on its way (pending for the next step's DDP
        all-reduce or optimizer step, or in an all-reduce of its own) and
        returns the previous step's agreement (None at the generation's first
        step). Blocks only if the previous vote's all-reduce has not finished
        yet, or when nothing carried it (then it is all-reduced now); raises what
        the collective raised."""
        first = self.timing.enter()  # nothing before it this step: this wait is its collective
        previous = self._collect()
        if first:
            self.timing.complete()
        if self.ddp_group is not None or self.carried_by_step:
            self._pending = vote
        else:
            self._in_flight = self._start(vote)
        return previous

    def vote_now(self, vote: Vote) -> tuple[Agreed | None, Agreed]:
        """Sends this step's vote in an all-reduce of its own and waits for
        it (up to the collective timeout): returns the previous step's
        agreement (None at the generation's first step) and this one's. The
        next `vote`, `vote_now` or `settle` returns this one's again, as the
        previous step's; do not `vote` this step again. Raises what the
        collective raised."""
        self.timing.enter()
        previous = self._collect()
        self._ready = _wait(*self._start(vote))
        self.timing.complete()
        return previous, self._ready

    def reach(self) -> None:
        """The optimizer step pre-hook of a layout whose ranks hold different
        pieces of the state (pipeline stages, shards, TP slices, expert
        groups): an all-reduce over the generation's world, waited for before
        the step is applied (up to the collective timeout), carrying the
        pending vote (the previous step's; an empty one when there is none).
        Returns once every rank has reached its optimizer step; the next
        `vote`, `vote_now` or `settle` returns the carried vote's agreement. Raises what the collective raised (a
        peer lost before reaching the step: the optimizer applies nothing)."""
        vote, self._pending = self._pending, None
        self.timing.enter()
        if vote is not None:
            self._ready = _wait(*self._start(vote))
            self.timing.complete()
            return
        t = torch.full((_FIXED + _PER_RANK * self.world_size,), -math.inf, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        handed_to_gloo(t)
        self.timing.complete()

    def settle(self) -> Agreed | None:
        """Waits for the last vote (up to the collective timeout; all-reduced
        now if it is still pending) and returns its agreement; None when
        there is none."""
        return self._collect()

    def abandon(self) -> None:
        """Forgets the vote in flight or pending without waiting (before the
        group is torn down; `leave_group` waits for gloo to release its tensor)."""
        self._in_flight = self._pending = self._carried = self._ready = None

    def carry(self, grads: torch.Tensor) -> torch.futures.Future[torch.Tensor] | None:
        """The last gradient bucket's all-reduce, with the pending vote
        appended (`grads` already divided by the world size); None when no
        vote is pending or the bucket cannot carry it (the caller all-reduces
        the bucket as usual)."""
        if self._pending is None or grads.device.type != "cpu" or grads.dtype not in (
                torch.float32, torch.float64):
            return None
        vote, self._pending = self._pending, None
        n = grads.numel()
        packed = torch.zeros(n + _CARRIED * self.world_size, dtype=grads.dtype)
        packed[:n] = grads.reshape(-1)
        slots = packed[n:].view(_CARRIED, self.world_size)
        slots[0, self.rank] = vote.generation_seen
        slots[1, self.rank] = float(vote.draining)
        slots[2, self.rank] = float(vote.last_holder)
        slots[3, self.rank] = float(vote.bad)
        slots[4, self.rank] = vote.loss_share
        slots[5, self.rank], slots[6, self.rank] = vote.timing
        future = dist.all_reduce(packed, group=self.ddp_group, async_op=True).get_future()
        handed_to_gloo(packed)
        self._carried = (vote, packed, future, n)
        timing = self.timing

        def unpack(f: torch.futures.Future) -> torch.Tensor:
            # the sums go back into the bucket: a view of `packed` kept by DDP
            # until the next step would keep it from being released at teardown
            timing.complete()
            return grads.copy_(f.value()[0][:n].view_as(grads))
        return future.then(unpack)

    def _start(self, vote: Vote) -> tuple[Vote, torch.Tensor, dist.Work]:
        t = torch.full((_FIXED + _PER_RANK * self.world_size,), -math.inf, dtype=torch.float64)
        t[0] = float(vote.generation_seen)
        t[1] = 1.0 if vote.draining else 0.0
        t[2] = 1.0 if vote.last_holder else 0.0
        t[3] = 1.0 if vote.bad else 0.0
        t[4] = 0.0 if vote.draining else 1.0
        t[_FIXED + self.rank] = vote.loss_share
        t[_FIXED + self.world_size + self.rank] = vote.timing[0]
        t[_FIXED + 2 * self.world_size + self.rank] = vote.timing[1]
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        handed_to_gloo(t)
        return vote, t, work

    def _collect(self) -> Agreed | None:
        """The agreement of the vote sent last (carried, in flight, or still
        pending: all-reduced now), and nothing left behind."""
        carried, in_flight, pending = self._carried, self._in_flight, self._pending
        ready, self._ready = self._ready, None
        self._carried = self._in_flight = self._pending = None
        if ready is not None:
            return ready
        if carried is not None:
            vote, packed, future, n = carried
            future.wait()
            (generation, draining, last_holder, bad, loss, compute,
             collective) = packed[n:].view(_CARRIED, -1).tolist()
            return Agreed(step=vote.step, newest_generation=int(max(generation)),
                          loss=float(sum(loss)), draining=max(draining) > 0,
                          every_draining=min(draining) > 0,
                          last_holder=max(last_holder) > 0, ended_t=vote.ended_t,
                          bad=max(bad) > 0, compute_s=tuple(compute),
                          collective_s=tuple(collective))
        if in_flight is None and pending is not None:
            in_flight = self._start(pending)  # no DDP all-reduce carried it this step
        return None if in_flight is None else _wait(*in_flight)


def carry_votes_hook(boundary: StepBoundary, bucket: dist.GradBucket
                     ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook (`DistributedDataParallel.register_comm_hook`): DDP's
    own averaging all-reduce of each bucket, the last one carrying the
    boundary's pending vote (`StepBoundary.carry`)."""
    group = boundary.ddp_group
    assert group is not None, "registered by Generation.ddp, which sets the group"
    boundary.timing.enter()  # the step's first bucket: its compute ends here
    grads = bucket.buffer().div_(group.size())
    if bucket.is_last():
        carried = boundary.carry(grads)
        if carried is not None:
            return carried
    future = dist.all_reduce(grads, group=group, async_op=True).get_future()
    timing = boundary.timing

    def done(f: torch.futures.Future) -> torch.Tensor:
        timing.complete()
        return f.value()[0]
    return future.then(done)


# DDP checks a comm hook's annotations against the real types, and this
# module's annotations are strings (``from __future__ import annotations``)
carry_votes_hook.__annotations__ = {"boundary": StepBoundary, "bucket": dist.GradBucket,
                                    "return": torch.futures.Future[torch.Tensor]}


def _wait(vote: Vote, t: torch.Tensor, work: dist.Work) -> Agreed:
    work.wait()
    generation, draining, last_holder, bad, steady, *slots = t.tolist()
    n = len(slots) // _PER_RANK
    return Agreed(step=vote.step, newest_generation=int(generation),
                  loss=float(sum(slots[:n])), draining=draining > 0, every_draining=steady == 0,
                  last_holder=last_holder > 0, ended_t=vote.ended_t, bad=bad > 0,
                  compute_s=tuple(slots[n:2 * n]), collective_s=tuple(slots[2 * n:]))
