"""What a rank's in-memory training state holds, and the rules that move it.

A rank keeps its registered objects (model, optimizer, ``state=`` entries:
`RankContext.state`) across generations. `HeldState` is the one owner of
what those objects hold: the step whose update they contain, whether they
stand at a step boundary every rank of the last generation agreed on
(``clean``), and the RNG state at that step's boundary
(`worker/rank/rngstate.py`). Its fields are read-only; each change is one of
the transitions below, made by the code that performs it:

* a step's update is in the objects (`step_applied`: the end of a step in
  `Generation.batches`);
* a generation's steps begin, and end at a boundary every rank agreed on
  (`steps_began`, `ended_cleanly`: `Generation.batches`);
* a generation breaks (`broke`: `Generation.__exit__`): a step whose
  optimizer step already returned on this rank is held as applied; a step
  that broke inside its optimizer step's wait for the world (a layout holding
  pieces: `StepBoundary.reach`), its gradients complete, is kept *pending*
  until the next agreement applies it (`apply_pending`: some survivor holds
  that step, so every rank reached it) or drops it (`drop_pending`);
* a generation's agreement settles the state it starts from
  (`agreed`, `started_fresh`, `restored`, `rolled_back`:
  `worker/train/agreement.py`, `worker/state/peercopy.py`), and the
  generation starts from it (`started`) or fails to (`start_failed`:
  `Session._start`).

Failure semantics: a transition is called only once what it records is
true (a restore or a roll back that fails raises before its transition, so
what a rank held when a start began stays what it offers to the next start:
the agreement's transaction, `worker/train/agreement.py`). A transition that
breaks a rule (a step applied that is not newer than the one held) raises
`ValueError` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from springback.worker.rank import rngstate
from springback.worker.rank.rngstate import RngState


class HeldState:
    """The step, boundary flag and RNG state of one rank's in-memory state
    (see the module docstring)."""

    __slots__ = ("_step", "_clean", "_rng", "_pending")

    def __init__(self, *, state_step: int = -1, clean: bool = False,
                 rng: RngState | None = None) -> None:
        """A rank's state before its first generation holds nothing (step -1,
        not clean, no RNG state); the arguments set up what a test's rank holds."""
        self._step = state_step
        self._clean = clean
        self._rng = rng
        self._pending: tuple[Callable[[], None], RngState] | None = None
        """The update of the step after `_step`, with the RNG state at its
        break (`broke`)."""

    def __repr__(self) -> str:
        return (f"HeldState(state_step={self._step}, clean={self._clean}, "
                f"rng={'set' if self._rng is not None else None})")

    # -- what it holds (read-only) --------------------------------------------

    @property
    def state_step(self) -> int:
        """The step whose update the in-memory state holds; -1: none yet."""
        return self._step

    @property
    def step(self) -> int:
        """The last step whose update the in-memory state holds (0 before training)."""
        return max(self._step, 0)

    @property
    def clean(self) -> bool:
        """The last generation ended at a step boundary every rank agreed on
        (every rank stopped after the same step): such ranks hold the same
        state, and each serves it in a hand-over
        (`worker/train/agreement.py`, `_holders`)."""
        return self._clean

    @property
    def pending_step(self) -> int | None:
        """The step whose update this rank can still apply (`broke` with a
        pending update), or None."""
        return None if self._pending is None else self._step + 1

    @property
    def rng(self) -> RngState | None:
        """The RNG state at the boundary after `state_step`; None before the
        first step (a rank that holds the agreed step goes back to it)."""
        return self._rng

    # -- a generation's steps ---------------------------------------------------

    def steps_began(self) -> None:
        """A generation's step loop begins: from here the state moves past the
        agreed boundary, so it is not clean until the loop ends at one."""
        self._clean = False

    def step_applied(self, step: int, rng: RngState | None) -> None:
        """Step `step`'s update is in the state: it is held, with `rng`, the
        RNG state at its end (carried into a next generation; None: no RNG
        state is carried, the agreement then leaves the RNG as it is). The
        state is not at an agreed boundary (`ended_cleanly` says when it is).
        Raises ValueError, changing nothing, when `step` is not newer than
        the step held (going back is `restored` or `rolled_back`)."""
        if step <= self._step:
            raise ValueError(f"step {step} applied over held step {self._step}: "
                             "a step applied is newer than the one held")
        self._step, self._rng, self._clean, self._pending = step, rng, False, None

    def ended_cleanly(self) -> None:
        """The generation's step loop ended at a step boundary every rank
        agreed on (max_steps, or a newer plan seen by any rank at a step's
        end): the state is clean."""
        self._clean = True

    def broke(self, optimizer_stepped: int | None,
              capture: Callable[[], RngState] = rngstate.capture,
              pending: Callable[[], None] | None = None) -> bool:
        """The generation broke (a failed collective). The state is not clean.

        `optimizer_stepped` is the step whose registered optimizer's step
        last returned on this rank (the optimizers' post-hook), or None.
        When it is the step after the one held, the step broke after its
        update was applied: it is held as applied, as its end would hold it
        (the step after the one held, and the RNG state `capture` returns
        now), so the next generation starts with the step after it and
        never trains its batch again. Otherwise the rank holds the step
        before (the next agreement takes the newest state any rank holds);
        `pending`, when given, applies the update of the step after it,
        whose optimizer step broke in its wait for the world with every
        gradient of the step complete: it is kept, with the RNG state now,
        for the next agreement (`apply_pending`, `drop_pending`).
        Returns whether the step was held as applied."""
        self._clean = False
        self._pending = None
        applied = optimizer_stepped is not None and optimizer_stepped == self._step + 1
        if applied:
            self._step, self._rng = self.step + 1, capture()
        elif pending is not None:
            self._pending = (pending, capture())
        return applied

    def apply_pending(self) -> None:
        """The next agreement found a survivor holding the pending step (so
        every rank reached that step's optimizer step, with its gradients
        complete): its update is applied now and the step is held, with the
        RNG state of its break. Raises what the update raises; the objects
        may then hold part of an update, so the rank holds nothing (step -1:
        the agreement fills it like a joiner's) and the error propagates."""
        assert self._pending is not None, "apply_pending without a pending update"
        (update, rng), self._pending = self._pending, None
        try:
            update()
        except BaseException:
            self._step, self._rng = -1, None
            raise
        self._step, self._rng = self._step + 1, rng

    def drop_pending(self) -> None:
        """No survivor holds the pending step (some rank never reached it, or
        its holders are gone): its update is dropped, and the step before is
        held as it was."""
        self._pending = None

    # -- a generation's start ---------------------------------------------------

    def agreed(self, step: int) -> None:
        """The generation's agreement settled on `step` and the objects hold
        it (held already, received whole from a source, or filled from the
        holders' shards). `clean` is left as it was (the step loop clears
        it); the RNG state is the agreement's to apply, and `started`
        records it. A pending update is dropped (it belongs to the state
        held before)."""
        self._step, self._pending = step, None

    def started_fresh(self) -> None:
        """No rank holds trained state and nothing is restored: the ranks
        start from the initialised (or rebuilt) model, at step 0."""
        self.agreed(0)

    def restored(self, step: int) -> None:
        """A checkpoint of `step` was restored into the objects (only once
        the restore completed: a restore is all or nothing). The state is
        not clean (it is no agreed step boundary of a live generation)."""
        self._step, self._clean, self._pending = step, False, None

    def rolled_back(self, step: int) -> None:
        """The objects were rolled back to the peer copies of `step`
        (`worker/state/peercopy.py`; only once every rank wrote every row
        it needed). The state is not clean."""
        self._step, self._clean, self._pending = step, False, None

    def started(self, rng: RngState) -> None:
        """The generation started from the agreed state: `rng`, the RNG
        state the agreement left (this rank's own at the agreed boundary,
        the source's, or the restored one), is that boundary's."""
        self._rng = rng

    def start_failed(self) -> None:
        """The generation could not start (rendezvous, agreement or restore
        failed or was cut short): the step held stays what this rank offers
        to the next start, but the state is not clean (a receive or a
        restore cut short may have written part of it, so it is no holder
        of a clean boundary)."""
        self._clean = False
