"""The training library: what a user's ``train.py`` imports.

A `Session` lives as long as the rank process and survives generations: the
model and optimizer stay in memory, and only the process group is rebuilt.

    session = Session(model=model, optimizer=opt)
    for gen in session.generations():        # one per plan this rank runs in
        with gen:                            # a dead peer ends the generation quietly
            ddp = DDP(model, process_group=gen.group)
            for batch in gen.batches():      # stops at a step boundary on a new plan
                loss = ...; loss.backward(); opt.step(); opt.zero_grad()
                gen.report(loss=loss.item())

Failure semantics:

* A collective that fails inside ``with gen:`` (a peer was killed: connection
  reset at once; a peer stopped: the collective timeout, which the agent sets to
  the liveness timeout) ends the generation. The session keeps its state and
  waits for the coordinator's next plan up to the job's
  ``failures.plan_wait_s`` (300 s by default; a coordinator or etcd outage is
  exactly when the state is needed), then re-raises the error. Any other
  exception (the user's own, a RuntimeError included) is never taken for a
  membership change: it propagates at once, and the agent reports the rank's
  failure.
* At the start of every generation the ranks agree on the state: each reports
  the step its in-memory state holds (-1 for a fresh process). The state of the
  highest step (the plan's source rank when it holds it) is broadcast to every
  rank unless all ranks ended the previous generation cleanly at the same step.
  When the plan's checkpoint is newer than any rank's state (no rank holds
  any: every rank crashed, or the holders the plan counted on are gone) it is
  loaded through `restore_checkpoint` (the storage hook), also when the plan
  expected peers; only with no checkpoint at all is the state taken fresh
  from rank 0. Rank 0 then reports the agreed step and its source to the
  coordinator, which proves the state holders and counts steps redone.
* A generation that fails to start (its group cannot form) is dropped for the
  next plan; when none comes within the plan wait the session raises, so
  the agent reports the rank's failure and the coordinator plans anew.
* Reaching ``max_steps`` does not end the session by itself: the ranks wait
  (up to the plan wait, rank 0 re-sending the final step report) until the
  coordinator confirms with a STOP plan, or moves the job to a newer
  generation, in which the final step is reported again. A final report that
  a flaky network lost therefore never leaves a "finished" job pending.
* A new plan (join, drain) is switched to at a step boundary agreed by all
  ranks: every step ends with one small MAX all-reduce of the newest
  generation each rank has seen (and the step's loss), overlapped with the
  next step and read at its end (`boundary`): all ranks switch at the same
  step, one step after the plan was first seen.
* Every registered module's and optimizer's gradients are cleared when a
  generation starts: a step that broke mid-backward is run again from zero
  gradients, so its samples are applied once.
* Do the optimizer step last in the loop body: a failure after it would leave
  this rank's state one step ahead of the step it claims.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import time
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from springback.v1 import types_pb2 as pb
from springback.worker import eventlog, rngstate
from springback.worker.audit import AuditLog, state_digest
from springback.worker.boundary import Agreed, StepBoundary, Vote, carry_votes_hook
from springback.worker.control import PlanChannel, await_activation
from springback.client.env import LOCAL_RANK, STANDBY_FILE, RankEnv
from springback.worker.peerloss import lost_peer
from springback.worker.rankstats import RankStats
from springback.worker.rendezvous import (
    RendezvousAborted,
    form_group,
    host_node_store,
    is_collective_failure,
    leave_group,
    note_subgroup_endpoints,
)
from springback.worker.mesh import MeshLayout, build_mesh
from springback.worker.agreement import Outcome, StateAgreement
from springback.worker.context import DEFAULT_PLAN_WAIT_S, RankContext
from springback.worker.sampler import Batch, SampleStream
from springback.worker.peercopy import GenerationCopies
from springback.worker.sharded import BuildFn, ShardedModel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

FINAL_RESEND_S = 1.0

RestoreHook = Callable[[pb.CheckpointRef, dict[str, Any]], int]
"""Loads a committed checkpoint into the registered state; returns its step."""


class Session:
    """A rank's elastic training session; see the module docstring."""

    def __init__(self, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 state: dict[str, Any] | None = None,
                 num_samples: int | None = None, global_batch_size: int | None = None,
                 seed: int | None = None, max_steps: int | None = None,
                 backend: str = "gloo", restore_checkpoint: RestoreHook | None = None,
                 plan_wait_s: float | None = None, env: RankEnv | None = None,
                 build: BuildFn | None = None, build_on_meta: bool = True,
                 replicated: Collection[str] = ()) -> None:
        """`model`/`optimizer`/`state` (objects with state_dict/load_state_dict)
        are what survivors hand to joiners. With `build` (the sharded-model
        form, see `worker/sharded.py`) instead of model and optimizer, the
        library builds them on every generation's mesh and reshards their
        state in memory; `state=` entries are handed over whole; with
        `build_on_meta` (the default) a build whose values will all be
        overwritten runs on the meta device first (`worker/sharded.py`);
        `replicated` names the plain (not DTensor) parameters that hold the
        same values on every rank (any other is refused by the in-memory
        reshard: it may be a rank's own slice).
        Data and max_steps come from the job
        spec in the plan; the keyword arguments are fallbacks for standalone runs
        (``python train.py`` without an agent: one rank, world size 1).
        ``backend="nccl"`` makes ``cuda:<local rank>`` current (`self.device`)
        and forms every generation's group as ``cpu:gloo,cuda:nccl``: CUDA
        tensors (DDP, FSDP) go over NCCL, the library's own collectives over
        gloo; RuntimeError when no CUDA device is visible."""
        if build is not None and (model is not None or optimizer is not None):
            raise ValueError("Session: pass either build= (sharded) or model=/optimizer=, "
                             "not both")
        self.env = env or _activated(RankEnv.from_environ())
        if self.env.store_fd is not None and self.env.local_rank == 0:
            host_node_store(self.env.store_fd)
        self.state: dict[str, Any] = dict(state or {})
        if model is not None:
            self.state["model"] = model
        if optimizer is not None:
            self.state["optimizer"] = optimizer
        self.backend = group_backend(backend)
        self.device = rank_device(backend, self.env.local_rank)
        if restore_checkpoint is None and ("model" in self.state or build is not None):
            from springback.worker.checkpointing import restore_from_checkpoint
            restore_checkpoint = restore_from_checkpoint
        self._plan_wait_override_s = plan_wait_s  # else the job's failures.plan_wait_s
        self._fallback = (num_samples, global_batch_size, seed, max_steps)
        self._generation = 0
        self._was_member = False
        self._standalone_store: dist.TCPStore | None = None
        self.ctx = RankContext(env=self.env, state=self.state, device=self.device,
                               wait_s=plan_wait_s or DEFAULT_PLAN_WAIT_S)
        if self.env.control_dir:
            self.ctx.channel = PlanChannel(self.env.control_dir)
            self.ctx.stats = RankStats(self.env.control_dir, self.env.local_rank)
        else:
            self.ctx.standalone_plan = self._make_standalone_plan()
        if self.env.coordinator and self.env.job_id:
            from springback.worker.reporter import StepReporter
            self.ctx.reporter = StepReporter(self.env.coordinator, self.env.token,
                                             self.env.job_id, self.env.member_id)
        self._agreement = StateAgreement(self.ctx, restore_checkpoint,
                                         ShardedModel(build, on_meta=build_on_meta,
                                                      replicated=replicated)
                                         if build is not None else None)

    @property
    def finished(self) -> bool:
        """The job ended for this rank (max_steps confirmed, stopped, or drained
        as the last holder)."""
        return self.ctx.finished

    @property
    def step(self) -> int:
        """Last step whose update the in-memory state holds (0 before training)."""
        return self.ctx.step

    # -- plans ---------------------------------------------------------------

    def _make_standalone_plan(self) -> pb.Plan:
        n, b, seed, max_steps = self._fallback
        if not n or not b:
            raise ValueError("standalone run (no agent): pass num_samples and "
                             "global_batch_size to Session")
        self._standalone_store = dist.TCPStore("127.0.0.1", 0, is_master=True,
                                               wait_for_workers=False)
        plan = pb.Plan(job_id="standalone", generation=1, action=pb.PLAN_ACTION_RUN,
                       world_size=1, master_addr="127.0.0.1",
                       master_port=self._standalone_store.port)
        plan.members.add(member_id="", node_rank=0, first_rank=0, num_local_ranks=1)
        plan.spec.data.num_samples = n
        plan.spec.data.global_batch_size = b
        plan.spec.data.seed = seed or 0
        plan.spec.max_steps = max_steps or 0
        return plan

    def _me(self, plan: pb.Plan) -> pb.PlanMember | None:
        for m in plan.members:
            if m.member_id == self.env.member_id:
                return m
        return None

    def _next_plan(self) -> pb.Plan | None:
        """Waits for a plan newer than the current generation that this rank acts
        on. Returns None when the job stopped or this member was removed.

        After max_steps the wait is bounded by the plan wait (RuntimeError:
        the coordinator never confirmed the end), and rank 0 re-sends the
        final step report every second meanwhile."""
        deadline = time.monotonic() + self.ctx.wait_s
        resent = 0.0
        while True:
            plan = self.ctx.latest()
            if plan is not None and plan.generation > self._generation:
                if plan.action == pb.PLAN_ACTION_STOP:
                    return None
                me = self._me(plan)
                if plan.action == pb.PLAN_ACTION_RUN and me is not None:
                    if self.env.local_rank >= me.num_local_ranks:
                        return None
                    return plan
                if (self._was_member and me is None
                        and self.env.member_id not in plan.spares):
                    log.info("member %s is not in generation %d: leaving",
                             self.env.member_id, plan.generation)
                    return None
            if self.ctx.channel is None:
                return None  # standalone: the only plan was used
            if self.ctx.final is not None:
                now = time.monotonic()
                if now >= deadline:
                    raise RuntimeError(
                        f"max_steps reached in generation {self._generation} but the "
                        f"coordinator confirmed no end within {self.ctx.wait_s:.0f}s")
                if now - resent >= FINAL_RESEND_S:
                    self.ctx.final()
                    resent = now
            time.sleep(0.02)

    # -- generations ---------------------------------------------------------

    def generations(self) -> Iterator[Generation]:
        """Yields one `Generation` per plan this rank trains in, with the process
        group formed and state agreed. Ends when max_steps is reached, the job
        stops, or this member is no longer in the plan.

        A generation that cannot start here (superseded, a peer gone) is
        skipped for the next plan; if none comes within the plan wait,
        RuntimeError is raised, so the rank exits, its agent reports the
        failure and the coordinator plans again instead of the job hanging."""
        try:
            while not self.ctx.finished:
                plan = self._next_plan()
                if plan is None:
                    self.ctx.finished = self.ctx.finished or self.ctx.final is not None
                    break
                self.ctx.final = None
                self.ctx.wait_s = (self._plan_wait_override_s or plan.spec.failures.plan_wait_s
                                or DEFAULT_PLAN_WAIT_S)
                gen = self._start(plan)
                if gen is None:
                    if not self.ctx.newer_plan_within(plan.generation, self.ctx.wait_s,
                                                      broken="the generation could not start"):
                        raise RuntimeError(
                            f"generation {plan.generation} could not start and no newer plan "
                            f"came within {self.ctx.wait_s:.0f}s")
                    continue
                try:
                    yield gen
                finally:
                    gen._close()
        finally:
            self.close()

    def _start(self, plan: pb.Plan) -> Generation | None:
        me = self._me(plan)
        assert me is not None
        self._generation = plan.generation
        self._was_member = True
        rank = me.first_rank + self.env.local_rank
        t0 = time.monotonic()
        self._clear_gradients()

        def superseded() -> bool:
            latest = self.ctx.latest()
            return latest is not None and latest.generation > plan.generation

        try:
            store = form_group(job_id=plan.job_id, generation=plan.generation, rank=rank,
                       world_size=plan.world_size, master_addr=plan.master_addr,
                       master_port=plan.master_port, backend=self.backend,
                       collective_timeout_s=self.env.collective_timeout_s,
                       rendezvous_timeout_s=self.env.rendezvous_timeout_s,
                       superseded=superseded)
            with self.ctx.busy("agreeing on the state"):  # reads no plan meanwhile
                outcome = (self._agreement.agree_sharded(plan, rank, store)
                           if self._agreement.sharded is not None
                           else self._agreement.agree(plan, rank))
            self.ctx.rng = rngstate.capture()  # the agreed state's (a restore set it too)
        except (RendezvousAborted, RuntimeError) as e:
            log.warning("generation %d could not start on rank %d: %s", plan.generation,
                        rank, e)
            leave_group(broken=True, cause=e)
            self.ctx.clean = False
            return None
        gen = Generation(self.ctx, plan, rank)
        gen._store, gen._mesh = store, outcome.mesh
        gen._copies = self._agreement.copies_for(plan, rank)
        gen._record_start(outcome, time.monotonic() - t0)
        if self.ctx.stats is not None:
            self.ctx.stats.generation_started(generation=plan.generation,
                                           world_size=plan.world_size, rank=rank, step=self.step)
        return gen

    def _clear_gradients(self) -> None:
        """Drops the gradients every registered module and optimizer holds.

        A generation that broke mid-step (a peer died during DDP's all-reduce)
        leaves this rank's local, un-reduced gradients of that step in
        ``.grad``; the step is run again in the next generation and backward
        would accumulate onto them, applying those samples twice."""
        for obj in self.state.values():
            if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
                obj.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Flushes the last step report and drops the process group. Idempotent."""
        leave_group()
        if self.ctx.stats is not None:  # what the script does next reads no plan
            self.ctx.stats.busy("done training")
        if self.ctx.reporter is not None:
            self.ctx.reporter.close()
            self.ctx.reporter = None


def _activated(rank_env: RankEnv) -> RankEnv:
    """A warm standby waits here until its agent gives it a crashed rank's place."""
    path = os.environ.get(STANDBY_FILE)
    if not path:
        return rank_env
    identity = await_activation(path)
    log.info("standby activated as local rank %d", identity["local_rank"])
    # the script reads LOCAL_RANK after Session() like under torchrun; a standby
    # was started before its local rank was known
    os.environ[LOCAL_RANK] = str(identity["local_rank"])
    return dataclasses.replace(rank_env, local_rank=int(identity["local_rank"]),
                               member_id=identity["member_id"],
                               control_dir=identity["control_dir"],
                               collective_timeout_s=float(identity["collective_timeout_s"]))


def group_backend(backend: str) -> str:
    """The process-group backend for `backend`: with NCCL the library's own
    small collectives (CPU tensors) run on a gloo side of the same group."""
    if backend == "nccl":
        return "cpu:gloo,cuda:nccl"
    return backend


def rank_device(backend: str, local_rank: int) -> torch.device:
    """This rank's device: ``cuda:<local_rank>`` (made current) with NCCL."""
    if "nccl" not in backend:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"Session(backend={backend!r}) needs CUDA; no device is visible")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


_LIBRARY_DIRS = tuple(os.path.dirname(str(origin)) + os.sep for origin in (
    torch.__file__, __file__, importlib.util.find_spec("springback.storage").origin))  # type: ignore[union-attr]


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
        """This rank's data-parallel coordinate: ranks sharing it (TP and PP
        peers) get the same batches."""
        self.dp_size = self.layout.dp
        self._mesh: DeviceMesh | None = None
        self._store: dist.Store | None = None  # the generation's rendezvous store
        self._boundary = StepBoundary(rank, self.world_size)
        self._copies: GenerationCopies | None = None  # the sharded form's peer copies
        self._loss = float("nan")
        self._audit = (AuditLog(ctx.env.audit_dir, self.generation, rank)
                       if ctx.env.audit_dir else None)
        self._checkpoints = None
        self._drain_saved_step: int | None = None  # step of this generation's drain save
        if plan.spec.checkpoint.uri and "model" in ctx.state:
            from springback.worker.checkpointing import GenerationCheckpoints
            self._checkpoints = GenerationCheckpoints(ctx=ctx, plan=plan, rank=rank)

    # -- the step loop ---------------------------------------------------------

    def batches(self) -> Iterator[Batch]:
        """This rank's batch of each step, from the step after the agreed state.

        Stops after max_steps, or at the end of a step when any rank has seen a
        newer plan (all ranks stop at the same step). Raises what a failed
        collective raises; ``with gen:`` turns that into a quiet end."""
        s = self.ctx
        s.clean = False
        while s.state_step < self.max_steps:
            step = s.state_step + 1
            batch = self.stream.batch(step, self.dp_size, self.dp_rank)
            if self._audit is not None:
                self._audit.record(batch)
            self._loss = float("nan")
            yield batch
            s.state_step = step
            s.rng = rngstate.capture()  # the boundary's, carried into a next generation
            switch = self._end_step(batch)
            if s.stats is not None:
                s.stats.step_done(step, checkpoint_stall_s=None if self._checkpoints is None
                                   else self._checkpoints.stall_s)
            if switch:
                break
        s.clean = True
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
        costs no collective of its own (`worker/boundary.py`). Build it once
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
        """Attaches this rank's mean loss over its batch to the current step."""
        self._loss = float(loss)

    def _end_step(self, batch: Batch) -> bool:
        """The agreed step boundary (`boundary.StepBoundary`): this step's vote
        goes out, the previous step's agreed vote decides, the same on every
        rank. Returns True when the ranks must leave for a newer plan (or stop)."""
        agreed = self._boundary.vote(self._vote(batch))
        if self._copies is not None:
            self._copies.after_step(batch.step)
        newer = agreed is not None and agreed.newest_generation > self.generation
        stop = agreed is not None and agreed.last_holder  # the state leaves with us
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
                                       wait=drain or final)
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

    def _vote(self, batch: Batch) -> Vote:
        """This rank's contribution to the agreement at the end of `batch`'s step."""
        s = self.ctx
        latest = s.latest()
        seen = max(latest.generation if latest is not None else 0, self.generation)
        if s.reporter is not None and s.reporter.coordinator_generation > seen:
            seen = s.reporter.coordinator_generation
        share = 0.0 if self._loss != self._loss else self._loss * len(batch.indices)
        channel = s.channel
        return Vote(step=batch.step, generation_seen=seen,
                    loss_share=share / batch.global_batch_size,
                    draining=channel is not None and channel.draining(),
                    last_holder=channel is not None and channel.last_holder(),
                    ended_t=time.time())

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
        if s.reporter is not None:
            s.reporter.submit(generation=self.generation, step=step,
                               samples_consumed=step * self.stream.global_batch_size,
                               loss=loss, epoch=epoch, offset=offset)
            if step >= self.max_steps:
                s.reporter.flush()

    # -- bookkeeping -----------------------------------------------------------

    def _record_start(self, outcome: Outcome, formed_s: float) -> None:
        s = self.ctx
        source = outcome.source
        if self.rank == 0 and s.reporter is not None:
            epoch, offset = self.stream.cursor_after(s.step)
            s.reporter.start(generation=self.generation, step=s.step,
                              samples_consumed=s.step * self.stream.global_batch_size,
                              restored_from=outcome.kind, epoch=epoch, offset=offset,
                              state_lost=outcome.state_lost)
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

    def _abandon_in_flight(self) -> None:
        self._boundary.abandon()
        if self._copies is not None:
            self._copies.abandon()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:  # noqa: ANN001
        """A failed collective ends the generation quietly once a newer plan
        comes (the state is kept meanwhile, up to the plan wait); anything
        else, and a collective failure that no plan follows, propagates."""
        if exc is None or not is_collective_failure(exc) or _raised_by_script(exc):
            self._settle_last_vote()  # the last finished step is still recorded
            return False
        s = self.ctx
        s.clean = False
        why = str(exc).splitlines()[0] if str(exc) else repr(exc)
        log.warning("generation %d broke on rank %d at step %d: %s", self.generation,
                    self.rank, s.step + 1, why)
        self._abandon_in_flight()
        lost = lost_peer(exc, self.plan, s.env.member_id)
        if lost is not None and s.reporter is not None:
            s.reporter.report_lost_peer(self.plan, rank=self.rank, peer=lost[0],
                                        lost_member_id=lost[1])
        leave_group(broken=True, cause=exc)
        if not s.newer_plan_within(self.generation, s.wait_s,
                                   broken=f"rank {self.rank} at step {s.step + 1}: {why}"[:200]):
            log.error("no new generation within %.0fs of a failed collective: giving up "
                      "the state", s.wait_s)
            return False
        return True
