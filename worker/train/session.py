"""The training library: what a user's ``train.py`` imports.

A `Session` lives as long as the rank process and survives generations: the
model and optimizer stay in memory, and only the process group is rebuilt.

    session = Session(model=model, optimizer=opt)
    for gen in session.generations():        # one per plan this rank runs in
        with gen:                            # a dead peer ends the generation quietly
            ddp = DDP(model, process_group=gen.group)
            for batch in gen.batches():      # stops at a step boundary on a new plan
                loss = ...; loss.backward()
                if gen.check_step(loss.item()):  # False: a bad step (controls.bad_step)
                    opt.step()
                opt.zero_grad()

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
* A step whose loss or gradient is not finite on any rank is skipped on
  every rank when the job's ``controls.bad_step`` is enabled and the loop
  asks `Generation.check_step` before its optimizer step
  (`worker/train/badstep.py`): the state is left as it was, the batch is
  recorded as skipped, and too many such steps in the window pause the job.
* A step is held as applied once a registered optimizer's step returned
  (`Generation.__exit__`): a collective that fails after it (a loss
  all-reduce, a logging gather) ends the generation at that step, and the
  next one starts with the step after it, so its samples are applied once.
  The rest of the loop body is not run again: do every collective of a step
  before the optimizer step where the layout holds pieces of the state
  (docs/worker.md), and keep what follows it to local work.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
import torch.distributed as dist

from springback.client import plans
from springback.v1 import types_pb2 as pb
from springback.worker.rank import rngstate
from springback.worker.control import PlanChannel, await_activation
from springback.client.env import LOCAL_RANK, STANDBY_FILE, RankEnv
from springback.storage.errors import TransientStorageError
from springback.worker.rankstats import RankStats
from springback.worker.rank.rendezvous import (
    RendezvousAborted,
    form_group,
    host_node_store,
    leave_group,
)
from springback.worker.rank.device import group_backend, rank_device
from springback.worker.train.generation import Generation
from springback.worker.train.agreement import StateAgreement
from springback.worker.train.badstep import BadSteps
from springback.worker.rank.context import DEFAULT_PLAN_WAIT_S, RankContext
from springback.worker.state.sharded import BuildFn, ShardedModel

log = logging.getLogger(__name__)

STORAGE_RETRY_MAX_S = 30.0
"""The longest wait between two starts that the store refused (`_wait_for_storage`)."""

FINAL_RESEND_S = 1.0
"""How often rank 0 re-sends the final step report while it waits for STOP."""

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
        form, see `worker/state/sharded.py`) instead of model and optimizer, the
        library builds them on every generation's mesh and reshards their
        state in memory; `state=` entries are handed over whole; with
        `build_on_meta` (the default) a build whose values will all be
        overwritten runs on the meta device first (`worker/state/sharded.py`);
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
            from springback.worker.train.checkpointing import restore_from_checkpoint
            restore_checkpoint = restore_from_checkpoint
            # imported now, not inside a generation's restore: its first
            # collective waits under the collective timeout while the slowest
            # rank imports (seconds on a loaded machine; a restore of every
            # rank's warm standby timed out at a 2 s timeout that way in CI)
            import springback.storage.restoring  # noqa: F401
        self._plan_wait_override_s = plan_wait_s  # else the job's failures.plan_wait_s
        self._fallback = (num_samples, global_batch_size, seed, max_steps)
        self._generation = 0
        self._was_member = False
        self._started_once = False  # this process's start-up was reported
        self._storage_refusals = 0  # generations in a row the store refused to start
        self._storage_refused: tuple[int, str] | None = None  # (rank, error) of the last start
        self._standalone_store: dist.TCPStore | None = None
        self._bad_steps = BadSteps()  # the bad-step window spans generations
        self.ctx = RankContext(env=self.env, state=self.state, device=self.device,
                               wait_s=plan_wait_s or DEFAULT_PLAN_WAIT_S)
        if self.env.control_dir:
            self.ctx.channel = PlanChannel(self.env.control_dir)
            self.ctx.stats = RankStats(self.env.control_dir, self.env.local_rank)
        else:
            self.ctx.standalone_plan = self._make_standalone_plan()
        if self.env.coordinator and self.env.job_id:
            from springback.worker.train.reporter import StepReporter
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
                       master_port=self._standalone_store.port,
                       rendezvous_secret=secrets.token_hex(16))
        plan.members.add(member_id="", node_rank=0, first_rank=0, num_local_ranks=1)
        plans.set_nodes(plan)
        plan.spec.data.num_samples = n
        plan.spec.data.global_batch_size = b
        plan.spec.data.seed = seed or 0
        plan.spec.max_steps = max_steps or 0
        return plan


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
                me = plans.own_entry(plan, self.env.member_id)
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
                self._storage_refused = None
                gen = self._start(plan)
                if gen is None and self._storage_refused is not None:
                    if not self._wait_for_storage(plan):
                        raise RuntimeError(
                            f"generation {plan.generation} could not start (storage "
                            f"unavailable) and no newer plan came within {self.ctx.wait_s:.0f}s")
                    continue
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
        me = plans.own_entry(plan, self.env.member_id)
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
            store = form_group(job_id=plan.job_id, generation=plan.generation,
                       secret=plan.rendezvous_secret, rank=rank,
                       world_size=plan.world_size, master_addr=plan.master_addr,
                       master_port=plan.master_port, backend=self.backend,
                       collective_timeout_s=self.env.collective_timeout_s,
                       rendezvous_timeout_s=self.env.rendezvous_timeout_s,
                       superseded=superseded)
            t1 = time.monotonic()
            with self.ctx.busy("agreeing on the state"):  # reads no plan meanwhile
                outcome = (self._agreement.agree_sharded(plan, rank, store)
                           if self._agreement.sharded is not None
                           else self._agreement.agree(plan, rank))
            self.ctx.held.started(rngstate.capture())  # the agreed state's (a restore set it too)
        except (RendezvousAborted, RuntimeError) as e:
            log.warning("generation %d could not start on rank %d: %s", plan.generation,
                        rank, e)
            leave_group(broken=True, cause=e)
            self.ctx.held.start_failed()
            return None
        except TransientStorageError as e:
            # Every rank meets it together (the restore's retries are
            # collective): the store stayed unavailable past its retry budget.
            # Weather, not a crash: the rank lives on and rank 0 asks the
            # coordinator to wait for storage and make the generation again.
            log.error("generation %d could not start on rank %d: storage unavailable: %s",
                      plan.generation, rank, e)
            leave_group(broken=True, cause=e)
            self.ctx.held.start_failed()  # a restore cut short may have written part of the state
            self._storage_refusals += 1
            self._storage_refused = (rank, str(e))
            return None
        self._storage_refusals = 0
        gen = Generation(self.ctx, plan, rank)
        gen._store, gen._mesh = store, outcome.mesh
        gen._copies = self._agreement.copies_for(plan, rank)
        gen._bad_steps = self._bad_steps
        t2 = time.monotonic()
        startup_s = 0.0
        if not self._started_once:  # this process's start-up: its creation to this generation
            self._started_once = True
            startup_s = max(time.time() - _process_started_at() - (t2 - t0), 0.0)
        gen._record_start(outcome, t2 - t0, (startup_s, t1 - t0, t2 - t1))
        if self.ctx.stats is not None:
            self.ctx.stats.generation_started(generation=plan.generation,
                                           world_size=plan.world_size, rank=rank, step=self.step)
        return gen

    def _wait_for_storage(self, plan: pb.Plan) -> bool:
        """After a start the store refused (every rank alike): rank 0 tells the
        coordinator, which shows the job waiting for storage and makes the
        generation again; the first time at once, then after a backoff that
        doubles up to `STORAGE_RETRY_MAX_S` (a store that stays down is not
        hammered with restores). Every rank waits for the next plan; False
        when none came within the plan wait (the rank then exits)."""
        rank, error = self._storage_refused or (0, "")
        n = self._storage_refusals
        backoff = 0.0 if n <= 1 else min(2.0 ** (n - 1), STORAGE_RETRY_MAX_S)
        return self.ctx.newer_plan_within(
            plan.generation, max(self.ctx.wait_s, backoff + 1.0),
            broken=f"storage unavailable: {error}" if rank == 0 else "",
            storage_unavailable=True, first_ask_s=backoff)

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


_IMPORTED_AT = time.time()


def _process_started_at() -> float:
    """When this process was created (wall clock, from /proc); where /proc
    cannot say, when this module was imported (start-up then misses the
    interpreter's own start)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


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
                               collective_timeout_s=float(identity["collective_timeout_s"]),
                               token=identity.get("credential") or None)
