"""The step-boundary agreement: one small MAX all-reduce per step, overlapped
with the next step's compute.

At the end of every step each rank contributes a `Vote`: the newest
generation it has seen, whether its node is draining, whether its agent was
told that no survivor will hold the state, and its share of the step's loss.
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

Failure semantics: a peer that died makes `wait` raise what the collective
raises (a connection reset at once, a timeout after the group's collective
timeout), at the boundary of the step after the one the vote belongs to;
``with gen:`` takes it for a membership change. `abandon` drops a vote in
flight without waiting (the group is being torn down).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from springback.worker.rendezvous import handed_to_gloo

_FIXED = 3  # generation seen, draining, last holder; then one loss slot per rank


@dataclasses.dataclass(frozen=True)
class Vote:
    """One rank's contribution at the end of one step."""

    step: int
    generation_seen: int
    loss_share: float  # this rank's loss x its batch / the global batch
    draining: bool
    last_holder: bool
    ended_t: float  # wall-clock time the step ended on this rank


@dataclasses.dataclass(frozen=True)
class Agreed:
    """The combined votes of one step: the same on every rank."""

    step: int
    newest_generation: int
    loss: float  # the step's loss over the global batch
    draining: bool
    last_holder: bool
    ended_t: float  # this rank's own end of that step


class StepBoundary:
    """The agreement of one generation's ranks; one per Generation."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._in_flight: tuple[Vote, torch.Tensor, dist.Work] | None = None

    def vote(self, vote: Vote) -> Agreed | None:
        """Starts this step's all-reduce and returns the previous step's
        agreement (None at the generation's first step). Blocks only if the
        previous all-reduce has not finished yet; raises what it raised."""
        t = torch.full((_FIXED + self.world_size,), -math.inf, dtype=torch.float64)
        t[0] = float(vote.generation_seen)
        t[1] = 1.0 if vote.draining else 0.0
        t[2] = 1.0 if vote.last_holder else 0.0
        t[_FIXED + self.rank] = vote.loss_share
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        handed_to_gloo(t)
        previous, self._in_flight = self._in_flight, (vote, t, work)
        return None if previous is None else _wait(*previous)

    def settle(self) -> Agreed | None:
        """Waits for the vote in flight (up to the collective timeout) and
        returns its agreement; None when none is in flight."""
        previous, self._in_flight = self._in_flight, None
        return None if previous is None else _wait(*previous)

    def abandon(self) -> None:
        """Forgets the vote in flight without waiting (before the group is torn
        down; `leave_group` waits for gloo to release its tensor)."""
        self._in_flight = None


def _wait(vote: Vote, t: torch.Tensor, work: dist.Work) -> Agreed:
    work.wait()
    return Agreed(step=vote.step, newest_generation=int(t[0].item()),
                  loss=float(t[_FIXED:].sum().item()), draining=t[1].item() > 0,
                  last_holder=t[2].item() > 0, ended_t=vote.ended_t)
