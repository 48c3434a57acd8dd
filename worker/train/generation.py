"""One generation as one rank sees it (`Generation`): its rank, world size,
process group and mesh, and the batches of the steps it runs; made by
`Session.generations`. See `springback.worker.train.session` for the failure
semantics: a collective failure inside ``with gen:`` ends the generation
quietly, anything the script raised itself propagates. A step is held as
applied from the moment a registered optimizer's step returned (an optimizer
step post-hook, `Generation._note_applied`): a collective that fails after it,
in the same loop body, ends the generation at that step, never at the one
before (which the next generation would train again, its samples twice)."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from springback.v1 import types_pb2 as pb
from springback.worker import eventlog
from springback.worker.rank import rngstate
from springback.worker.train.audit import AuditLog, state_digest
from springback.worker.train.badstep import BadStepLimit, BadSteps, locally_bad
from springback.worker.train.boundary import Agreed, StepBoundary, Vote, carry_votes_hook
from springback.worker.train.peerloss import lost_peer
from springback.worker.train.ranktiming import MemberTimings
from springback.worker.train.steptimes import StepTimes
from springback.worker.rank.rendezvous import (
    failure_line,
    is_collective_failure,
    leave_group,
    note_subgroup_endpoints,
)
from springback.worker.state.mesh import MeshLayout, build_mesh
from springback.worker.train.agreement import Outcome
from springback.worker.rank.context import RankContext
from springback.worker.train.sampler import Batch, SampleStream
from springback.worker.state.peercopy import GenerationCopies

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.hooks import RemovableHandle

log = logging.getLogger(__name__)

_LIBRARY_DIRS = tuple(os.path.dirname(str(importlib.util.find_spec(name).origin)) + os.sep  # type: ignore[union-attr]
                      for name in ("torch", "springback.worker", "springback.storage"))
"""Where library frames live: torch's, the worker side's (every room of it)
and storage's."""


def _raised_by_script(exc: BaseException) -> bool:
    """True when `exc` was raised by the script's own code (the innermost
    frame of its traceback is outside torch and springback): a user's
    RuntimeError that happens to read like a collective's is never taken for
    a membership change."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_LIBRARY_DIRS)


class Generation:
    """One membership epoch as seen by one rank: rank, world size, process group,
    and the batches of the steps it runs. Use as a context manager."""

    def __init__(self, ctx: RankContext, plan: pb.Plan, rank: int) -> None:
        self.ctx = ctx
        self.plan = plan
        self.generation = plan.generation
        self.rank = rank
        self.world_size = plan.world_size
        self.local_rank = ctx.env.local_rank
        self.max_steps = plan.spec.max_steps or 2**62
        data = plan.spec.data
        self.stream = SampleStream(num_samples=int(data.num_samples),
                                   global_batch_size=int(data.global_batch_size),
                                   seed=int(data.seed))
        self.group = dist.group.WORLD
        self.layout = MeshLayout.from_plan(plan)
        self.dp_rank = self.layout.dp_rank(rank)
        coordinates = self.layout.coordinates(rank)
        self._counts_loss = coordinates["tp"] == 0 and coordinates["pp"] == self.layout.pp - 1
        """Whether this rank's `report` counts in the step's loss: one rank per
        dp rank, its last pipeline stage's (which computes the loss) first TP
        rank; TP and PP peers share its batch, so theirs would count it again."""
        """This rank's data-parallel coordinate: ranks sharing it (TP and PP
        peers) get the same batches."""
        self.dp_size = self.layout.dp
        self._mesh: DeviceMesh | None = None
        self._store: dist.Store | None = None  # the generation's rendezvous store
        self._boundary = StepBoundary(rank, self.world_size)
        self._step_hook: RemovableHandle | None = None
        if self.layout.holds_pieces and "optimizer" in ctx.state:
            # no rank applies a step a rank holding another piece of the state
            # did not reach: each optimizer step waits for the world, and the
            # previous step's vote rides that all-reduce (`StepBoundary.reach`).
            # Without it, a node lost during a step's last gradient collective
            # could leave one survivor's piece a step ahead of its neighbour's
            # (one finished the collective, the other did not): no step would
            # then be held whole and the job would restore a checkpoint.
            self._boundary.carried_by_step = True
            self._step_hook = self.optimizer.register_step_pre_hook(self._reach)
        self._pending: Callable[[], None] | None = None
        """Set by `_reach` when the wait for the world broke: the step's update,
        which `__exit__` leaves pending in the held state."""
        self._applied: int | None = None
        """The step during which a registered optimizer's step last returned
        (`_note_applied`): `__exit__` holds that step as applied when a
        collective fails after it."""
        # every registered optimizer, in every layout (DDP's included, where
        # no pre-hook waits for the world): a collective after the optimizer
        # step (a loss all-reduce, a logging gather) breaks a step that the
        # state already holds whatever the layout
        self._applied_hooks: list[RemovableHandle] = [
            v.register_step_post_hook(self._note_applied)
            for v in ctx.state.values() if isinstance(v, torch.optim.Optimizer)]
        self._copies: GenerationCopies | None = None  # the sharded form's peer copies
        self._loss = float("nan")
        self._batch: Batch | None = None  # the step running now
        self._checked: tuple[Agreed | None] | None = None
        """Set by `check_step`: the previous step's agreement, which it
        collected (this step's vote is then already agreed)."""
        self._bad_steps = BadSteps()  # the session's, set by Session._start
        self._audit = (AuditLog(ctx.env.audit_dir, self.generation, rank, self.dp_rank)
                       if ctx.env.audit_dir else None)
        self._checkpoints = None
        self._step_times = StepTimes()  # rank 0 reports their percentiles
        self._member_timings = MemberTimings(plan) if rank == 0 else None
        """Rank 0: every member's step timing, from the votes (`ranktiming`)."""
        self._drain_saved_step: int | None = None  # step of this generation's drain save
        if plan.spec.checkpoint.uri and "model" in ctx.state:
            from springback.worker.train.checkpointing import GenerationCheckpoints
            self._checkpoints = GenerationCheckpoints(ctx=ctx, plan=plan, rank=rank)

    # -- the step loop ---------------------------------------------------------

    def batches(self) -> Iterator[Batch]:
        """This rank's batch of each step, from the step after the agreed state.

        Stops after max_steps, or at the end of a step when any rank has seen a
        newer plan (all ranks stop at the same step). Raises what a failed
        collective raises; ``with gen:`` turns that into a quiet end."""
        s = self.ctx
        s.held.steps_began()
        while s.state_step < self.max_steps:
            step = s.state_step + 1
            batch = self.stream.batch(step, self.dp_size, self.dp_rank)
            if self._audit is not None:
                self._audit.record(batch)
            self._loss = float("nan")
            self._batch, self._checked = batch, None
            self._boundary.timing.step_began()  # the previous step's timing is final
            yield batch
            s.held.step_applied(step, rngstate.capture())  # the boundary's RNG, carried on
            switch = self._end_step(batch)
            if s.stats is not None:
                s.stats.step_done(step, checkpoint_stall_s=None if self._checkpoints is None
                                   else self._checkpoints.stall_s)
            if switch:
                break
        s.held.ended_cleanly()
        if s.state_step >= self.max_steps and not s.finished:
            self._record_state("end")
            if s.channel is None or s.reporter is None:
                s.finished = True  # no coordinator to confirm the end
            else:  # wait for the coordinator's word (see _next_plan)
                s.final = self._report_final if self.rank == 0 else (lambda: None)

    @property
    def model(self) -> torch.nn.Module:
        """The registered model (the sharded form: as built on this generation's mesh)."""
        return self.ctx.state["model"]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The registered optimizer (the sharded form: built with the model)."""
        return self.ctx.state["optimizer"]

    def ddp(self, module: torch.nn.Module, **kwargs: Any
            ) -> torch.nn.parallel.DistributedDataParallel:
        """`module` in DistributedDataParallel over this generation's group
        (``DDP(module, process_group=gen.group, **kwargs)``), with the step
        boundary's vote carried in its gradient all-reduce: the agreement then
        costs no collective of its own (`worker/train/boundary.py`). Build it once
        per generation, as ``DDP(...)``; a DDP built by the script itself
        works too, with the vote in a small all-reduce of its own. The comm
        hook is the library's, so ``register_comm_hook`` is not available on
        the result. On CUDA (NCCL) the vote keeps its own all-reduce on the
        group's gloo side and only the plain wrapper is returned."""
        if "process_group" in kwargs:
            raise ValueError("Generation.ddp: process_group is the generation's group")
        from torch.nn.parallel import DistributedDataParallel

        if self.ctx.device.type == "cuda":
            kwargs.setdefault("device_ids", [self.ctx.device.index])
        wrapped = DistributedDataParallel(module, process_group=self.group, **kwargs)
        if self.ctx.device.type == "cpu":
            wrapped.register_comm_hook(self._boundary, carry_votes_hook)
            self._boundary.ddp_group = self.group
        return wrapped

    @property
    def mesh(self) -> DeviceMesh:
        """The generation's named DeviceMesh (dims `MESH_DIMS`: pp, replicate,
        shard, tp) over its process group, built on first use (a collective:
        every rank of the generation must ask for it, in the same order).
        The ranks then exchange the addresses of the subgroups' sockets, so a
        peer's death seen first on one of them is reported as that peer's."""
        if self._mesh is None:
            self._mesh = build_mesh(self.layout, self.ctx.device.type)
            if self._store is not None:
                note_subgroup_endpoints(self._store, self.rank, self.world_size)
        return self._mesh

    def report(self, *, loss: float) -> None:
        """Attaches this rank's mean loss over its batch to the current step.
        With tp or pp > 1 the step's loss counts each dp rank's batch once,
        from the rank of its last pipeline stage with tp coordinate 0; the
        other ranks' reports are ignored."""
        self._loss = float(loss)

    def check_step(self, loss: float | None) -> bool:
        """The bad-step check (spec ``controls.bad_step``,
        `worker/train/badstep.py`): call it after backward and before the
        optimizer step, on every rank, and step the optimizer only when it
        returns True; zero the gradients either way. It also reports `loss`
        as `report` does (None on a rank that computes no loss).

        With the policy off it only reports the loss and returns True (no
        collective). With it on, it is collective: this step's vote is
        all-reduced now with this rank's verdict (its loss or a gradient of
        a registered module not finite), and every rank gets the same
        answer: False when any rank's step was bad (with
        ``loss_spike_factor``, a rank's loss spiking counts as bad). A False step is
        recorded as skipped (the audit; rank 0's step event). When the
        skipped steps reach ``max_in_window`` within ``window_steps``, rank
        0 asks the coordinator to pause the job, naming them (the ranks go
        on until the pause comes); with no coordinator every rank raises
        `BadStepLimit`. Raises what the vote's all-reduce raises (a peer
        lost: ``with gen:`` ends the generation as for any step); calling it
        twice in one step is a RuntimeError."""
        if self._batch is None or self._checked is not None:
            raise RuntimeError("Generation.check_step: call it once per step, inside "
                               "the loop over gen.batches()")
        self._loss = float("nan") if loss is None else float(loss)
        policy = self.plan.spec.controls.bad_step
        if not policy.enabled:
            return True
        modules = [v for v in self.ctx.state.values() if isinstance(v, torch.nn.Module)]
        step = self._batch.step
        bad = locally_bad(loss, modules) or self._bad_steps.spiked(step, loss, policy)
        previous, agreed = self._boundary.vote_now(self._vote(self._batch, bad=bad))
        self._checked = (previous,)
        if not agreed.bad:
            self._bad_steps.applied(loss, policy)
            return True
        log.warning("step %d is not applied: a rank's loss or gradient is not finite or its "
                    "loss spiked (controls.bad_step)", step)
        if self._audit is not None:
            self._audit.skipped(step)
        if self.rank == 0:
            eventlog.append({"event": "bad_step", "t": time.time(),
                             "generation": self.generation, "step": step})
        reason = self._bad_steps.record(step, policy)
        if reason is not None:
            self._pause(reason)
        return False

    def _pause(self, reason: str) -> None:
        """Too many bad steps: rank 0 reports the pause (once taken, never
        again); without a coordinator every rank raises `BadStepLimit`."""
        s = self.ctx
        if s.reporter is None:
            raise BadStepLimit(reason)
        if self.rank == 0 and not self._bad_steps.reported:
            log.error("%s", reason)
            self._bad_steps.reported = s.reporter.report_pause(self.plan, reason)

    def _end_step(self, batch: Batch) -> bool:
        """The agreed step boundary (`boundary.StepBoundary`): this step's vote
        goes out (unless `check_step` sent it), the previous step's agreed
        vote decides, the same on every rank. Returns True when the ranks
        must leave for a newer plan (or stop)."""
        if self._checked is not None:
            agreed = self._checked[0]
        else:
            agreed = self._boundary.vote(self._vote(batch))
        if self._copies is not None:
            self._copies.after_step(batch.step)
        newer = agreed is not None and agreed.newest_generation > self.generation
        stop = agreed is not None and (agreed.last_holder or self._everyone_leaves(agreed))
        final = batch.step >= self.max_steps
        if self._checkpoints is not None:
            drain = (agreed is not None and agreed.draining
                     and self._drain_saved_step is None) or (
                stop and self._drain_saved_step != batch.step)
            every = self._checkpoints.every_steps
            if drain or final or (every and batch.step % every == 0):
                # the final step is committed before it is reported: the job's
                # success ends the generation, and with it the right to commit
                self._checkpoints.save(batch.step, self.stream.cursor_after(batch.step),
                                       wait=drain or final, store=self._store)
                if drain:
                    self._drain_saved_step = batch.step
        elif stop:
            log.error("last holder of the state is draining without checkpoint.uri: "
                      "the job will restart from scratch")
        if self.rank == 0 and agreed is not None:
            self._after_step(agreed)
        if newer or stop or final:  # leaving: nothing stays in flight
            last = self._boundary.settle()
            if self._copies is not None:
                self._copies.settle()
            if self.rank == 0 and last is not None:
                self._after_step(last)
        if stop:
            self.ctx.finished = True
            self._record_state("drained")
            return True
        if newer:
            self._record_state("switch")
        return newer

    def _everyone_leaves(self, agreed: Agreed) -> bool:
        """Every rank's node is draining and the plan has no spare to take
        the state: it leaves with the ranks whatever the coordinator plans
        next, so they stop at this boundary, where the drain checkpoint is
        written (a switch to the plan that places none of them could come
        boundaries later, and the steps trained meanwhile would be redone
        after the restore). Without checkpoint.uri they wait for that plan."""
        return (agreed.every_draining and self._checkpoints is not None
                and not self.plan.spares)

    def _vote(self, batch: Batch, *, bad: bool = False) -> Vote:
        """This rank's contribution to the agreement at the end of `batch`'s step."""
        s = self.ctx
        latest = s.latest()
        seen = max(latest.generation if latest is not None else 0, self.generation)
        if s.reporter is not None and s.reporter.coordinator_generation > seen:
            seen = s.reporter.coordinator_generation
        share = (self._loss * len(batch.indices)
                 if self._counts_loss and self._loss == self._loss else 0.0)
        channel = s.channel
        return Vote(step=batch.step, generation_seen=seen,
                    loss_share=share / batch.global_batch_size,
                    draining=channel is not None and channel.draining(),
                    last_holder=channel is not None and channel.last_holder(),
                    ended_t=time.time(), bad=bad, timing=self._boundary.timing.last)

    def _settle_last_vote(self) -> None:
        """Leaving the generation without a broken collective (the user's own
        error, a break out of the loop): waits for the vote in flight so rank
        0 still records and reports the last finished step. A failure here
        is logged only: it must not mask the user's exception."""
        try:
            last = self._boundary.settle()
        except Exception as e:  # noqa: BLE001 - the user's error is what propagates
            log.warning("the last step's agreement failed on the way out: %s", e)
            return
        if self.rank == 0 and last is not None:
            self._after_step(last)

    def _report_final(self) -> None:
        """Rank 0, after max_steps: sends the final step report again unless the
        coordinator took it."""
        s = self.ctx
        if s.reporter is None or s.reporter.accepted == (self.generation, s.step):
            return  # taken: the STOP plan is on its way
        epoch, offset = self.stream.cursor_after(s.step)
        s.reporter.submit(generation=self.generation, step=s.step,
                           samples_consumed=s.step * self.stream.global_batch_size,
                           loss=s.last_loss, epoch=epoch, offset=offset)

    def _after_step(self, agreed: Agreed) -> None:
        """Rank 0: the step's local record first, then the report (whoever sees
        the job finish can read every step's record). The record's ``t`` is
        when the step ended, not when its agreement was read."""
        s = self.ctx
        step, loss = agreed.step, agreed.loss
        eventlog.append({"event": "step", "t": agreed.ended_t, "generation": self.generation,
                        "world_size": self.world_size, "step": step, "loss": loss})
        epoch, offset = self.stream.cursor_after(step)
        s.last_loss = loss
        self._step_times.step_ended(agreed.ended_t)
        if self._member_timings is not None and agreed.compute_s:
            self._member_timings.add(agreed.compute_s, agreed.collective_s)
        if s.reporter is not None:
            ckpt = self._checkpoints
            s.reporter.submit(generation=self.generation, step=step,
                               samples_consumed=step * self.stream.global_batch_size,
                               loss=loss, epoch=epoch, offset=offset,
                               checkpoint_stall_s=(ckpt.stall_s or 0.0) if ckpt else 0.0,
                               checkpoint_stall_total_s=ckpt.stall_total_s if ckpt else 0.0,
                               step_quantiles=self._step_times.quantiles(),
                               member_timings=self._member_timings)
            if step >= self.max_steps:
                s.reporter.flush()

    # -- bookkeeping -----------------------------------------------------------

    def _record_start(self, outcome: Outcome, formed_s: float,
                      spans: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> None:
        """`spans`: rank 0's (startup, rendezvous, transfer) seconds, reported
        with the start for badput by cause."""
        s = self.ctx
        source = outcome.source
        if self.rank == 0 and s.reporter is not None:
            epoch, offset = self.stream.cursor_after(s.step)
            s.reporter.start(generation=self.generation, step=s.step,
                              samples_consumed=s.step * self.stream.global_batch_size,
                              restored_from=outcome.kind, epoch=epoch, offset=offset,
                              state_lost=outcome.state_lost, spans=spans)
        if self.rank == 0:
            eventlog.append({"event": "generation", "generation": self.generation,
                     "world_size": self.world_size, "step": self.ctx.step,
                     "source_rank": -1 if source is None else source,
                     "formed_s": round(formed_s, 4), "reason": self.plan.reason})
        log.info("rank %d/%d joined generation %d at step %d (state from %s)", self.rank,
                 self.world_size, self.generation, self.ctx.step,
                 "memory" if source is None else f"rank {source}")
        self._record_state("start")

    def _record_state(self, when: str) -> None:
        if not self.ctx.env.audit_dir:
            return
        path = os.path.join(self.ctx.env.audit_dir,
                            f"state-g{self.generation:06d}-r{self.rank:05d}.jsonl")
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"generation": self.generation, "rank": self.rank,
                                "when": when, "step": self.ctx.step,
                                "digest": state_digest(self.ctx.state)}) + "\n")

    def _close(self) -> None:
        self._abandon_in_flight()
        if self._checkpoints is not None:
            self._checkpoints.close(wait_for_commit=self.ctx.clean)
            self._checkpoints = None
        if self._audit is not None:
            self._audit.close()
            self._audit = None
        leave_group()

    def _note_applied(self, *_: Any) -> None:
        """Optimizer step post-hook of every registered optimizer: the current
        step's update is in the state now.

        With several registered optimizers the step counts as applied once
        any of them stepped (an optimizer stepped only every few steps never
        holds the others' steps back); a step broken between two of them is
        half applied either way, so step them together, after the step's
        last collective."""
        if self._batch is not None:
            self._applied = self._batch.step

    def _reach(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Optimizer step pre-hook of a layout holding pieces: waits for the
        world (`StepBoundary.reach`). When that wait breaks, this rank's
        gradients of the step are complete (its backward and gradient
        collectives returned), and the gloo all-reduce may have completed on
        another rank, which then applied the step: the update is kept
        (`_pending_update`) so that the next agreement can apply it here too
        and the survivors hold one step whole (`HeldState.apply_pending`).
        An optimizer stepped with a closure (which runs forward and backward
        again) keeps none."""
        try:
            self._boundary.reach()
        except Exception:
            if not args and not kwargs:
                self._pending = _pending_update(optimizer)
            raise

    def _abandon_in_flight(self) -> None:
        """Drops the vote and peer copies in flight, a sharded layout's
        optimizer step pre-hook (its all-reduce is over this generation's group)
        and the optimizers' post-hooks (`_note_applied`). Idempotent."""
        if self._step_hook is not None:
            self._step_hook.remove()
        for hook in self._applied_hooks:
            hook.remove()
        self._boundary.abandon()
        if self._copies is not None:
            self._copies.abandon()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:  # noqa: ANN001
        """A failed collective ends the generation quietly once a newer plan
        comes (the state is kept meanwhile, up to the plan wait); anything
        else, and a collective failure that no plan follows, propagates.

        A step that broke after a registered optimizer's step returned on
        this rank (a loss all-reduce or a logging gather after
        ``optimizer.step()`` met a dead peer) is held as applied: the state
        step becomes that step and the RNG state is captured here, as at the
        end of a step, so the next generation starts with the step after it
        and never trains its batch again. The step's agreement (its record,
        its loss, a peer copy or checkpoint of it) is not made: its vote
        never went out. A rank that broke before its optimizer step holds
        the step before; the next generation's agreement takes the newest
        state any rank holds (`worker/train/agreement.py`), and first applies
        the update of a rank that broke in its optimizer step's wait for the
        world (`_reach`) when a survivor holds that step."""
        if exc is None or not is_collective_failure(exc) or _raised_by_script(exc):
            self._settle_last_vote()  # the last finished step is still recorded
            return False
        s = self.ctx
        why = failure_line(exc)
        broken = s.step + 1
        # held as applied when its update is in; pending when only the wait
        # for the world before it broke
        applied = s.held.broke(self._applied, pending=self._pending)
        log.warning("generation %d broke on rank %d at step %d%s: %s", self.generation,
                    self.rank, broken, " after its optimizer step (held as applied)"
                    if applied else " in its optimizer step's wait for the world (its update "
                    "pending)" if s.held.pending_step is not None else "", why)
        self._abandon_in_flight()
        lost = lost_peer(exc, self.plan, s.env.member_id)
        if lost is not None and s.reporter is not None:
            s.reporter.report_lost_peer(self.plan, rank=self.rank, peer=lost)
        leave_group(broken=True, cause=exc)
        if not s.newer_plan_within(self.generation, s.wait_s,
                                   broken=f"rank {self.rank} at step {broken}: {why}"[:200]):
            log.error("no new generation within %.0fs of a failed collective: giving up "
                      "the state", s.wait_s)
            return False
        return True


def _pending_update(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """The optimizer step that `optimizer`'s gradients, as they are now, make:
    applied later (`HeldState.apply_pending`), after the session has dropped
    every gradient for the next start and without the generation's hooks (it
    waits for no one). The gradients are kept by reference here, and handed
    back to their parameters only for that step."""
    grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]

    def update() -> None:
        for p, g in grads:
            p.grad = g
        try:
            optimizer.step()
        finally:
            for p, _ in grads:
                p.grad = None
    return update
