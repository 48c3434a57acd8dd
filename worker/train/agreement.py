"""How the ranks of a new generation agree on the state they start from.

Every rank all-gathers the step its in-memory state holds. The newest state
any rank holds wins, unless the plan's checkpoint is newer: with no rank
holding state (every rank crashed, all holders lost) the plan's checkpoint
is restored even when the plan expected peers to serve it, so a job never
starts from scratch while a commit exists.

* DDP form (`StateAgreement.agree`): the state of the highest step (the
  plan's source rank when it holds it) is handed to every rank that does not
  hold it, unless every rank ended the previous generation cleanly at the
  same step; with no state anywhere and no checkpoint, rank 0's fresh
  initialisation is handed over. The source broadcasts the state's skeleton
  (everything but its tensors' bytes) and every holder of the same state
  (the source, and the ranks that ended cleanly at its step) serves a stripe
  of the tensors' raw bytes, point to point, in chunks sized for the link
  (`worker/state/handover.py`).
* Both forms carry each rank's RNG state with the state (`worker/rank/rngstate.py`).
* Sharded form (`StateAgreement.agree_sharded`, see `worker/state/sharded.py`):
  a rank whose last step broke in its optimizer step's wait for the world
  applies that step when another rank holds it (`_settle_pending`); then the
  model is built on the new mesh and its shards filled from the ranks
  holding the rows (`worker/state/reshard.py`); when some rows have no live
  holder, every rank rolls back to the newest step the peer copies cover
  (`worker/state/peercopy.py`), else the plan's checkpoint is restored.

Failure semantics: every step here is collective over the generation's
group; a failed collective raises what it raises (the generation fails to
start and the session waits for the next plan, keeping its state). Recovery
is a transaction:

* what a rank held when a start began stays what it offers until a start
  succeeds: the DDP form loads received or restored state only once it is
  complete (a restore is all or nothing: `checkpointing.py`); the sharded
  form keeps the pieces it captured (`Captured`) and the step they are of
  across failed starts, and never takes a failed start's model for a
  source;
* a fill (exchange, peer-copy roll back) is used only when it covers every
  parameter and buffer of the new model and every rank wrote every row it
  needed (`reshard.agree_written`), else the next source is tried;
* a placement the in-memory reshard does not handle (`NotReshardable`, a
  plain parameter not declared replicated, plain tensors that differ between
  ranks) is an agreed decision: every rank restores the plan's checkpoint,
  and with none the job fails (`StateUnrecoverable`) naming it;
* a restore reads only a checkpoint directly in the job's own directory
  (`outside_job`: the coordinator's rule at commit, checked again before
  anything is read); any other URI fails the job (`StateUnrecoverable`)
  naming the URI and the directory;
* with no holder, no complete peer copy and no commit the state is lost:
  the ranks start from the built model, with their ``state=`` entries as
  the script made them, at step 0 and say so
  (`Outcome.state_lost`, reported to the coordinator, which records the loss
  and applies ``failures.on_state_lost``).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import time
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from springback.client.jobdir import outside_job_directory
from springback.v1 import types_pb2 as pb
from springback.worker.rank import rngstate
from springback.worker.rank.context import RankContext
from springback.worker.state.mesh import MeshLayout, build_mesh
from springback.worker.state.peercopy import GenerationCopies, PeerCopyStore
from springback.worker.rank.rendezvous import handed_to_gloo, note_subgroup_endpoints
from springback.worker.state import handover
from springback.worker.state.peerobjects import all_gather_objects, broadcast_object
from springback.worker.state.reshard import (
    Box,
    agree_written,
    exchange,
    plan_transfers,
)
from springback.worker.state.sharded import Captured, ShardedModel, unfilled

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


class StateUnrecoverable(Exception):
    """The ranks agreed that nothing can fill the new generation's state and
    no membership would change that (the rank fails with this: it is not a
    RuntimeError, so never taken for a membership change)."""


def outside_job(plan: pb.Plan, uri: str, job_id: str) -> str | None:
    """Why this rank refuses to restore checkpoint `uri`, or None. With a
    ``checkpoint.uri`` in the spec, a checkpoint the job may restore lies
    directly in its own directory, ``<checkpoint.uri>/<job id>/<name>``: the
    rule the coordinator applies at commit (`springback.client.jobdir`),
    checked again here because a restore unpickles what it reads and a
    record written straight into etcd never passed the coordinator."""
    base = plan.spec.checkpoint.uri
    if not base:
        return None
    why = outside_job_directory(uri, base, plan.job_id or job_id)
    return None if why is None else f"refusing to restore checkpoint {uri!r}: {why}"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a generation's agreement settled on."""

    source: int | None
    """The rank whose whole-held state every rank took (None: a restore, or
    every rank already held it)."""
    kind: int
    """Where the state came from: a `RestoreKind`."""
    mesh: DeviceMesh | None = None
    """The sharded form's mesh (built by the agreement)."""
    state_lost: str = ""
    """Set when the ranks started from scratch: why (the coordinator decides
    from the job's progress whether trained state was lost)."""


class StateAgreement:
    """One rank's side of the agreement, for every generation of a Session."""

    def __init__(self, ctx: RankContext,
                 restore_checkpoint: Callable[[pb.CheckpointRef, dict[str, Any]], int] | None,
                 sharded: ShardedModel | None) -> None:
        self.ctx = ctx
        self.restore_checkpoint = restore_checkpoint
        self.sharded = sharded
        self.copies = PeerCopyStore()
        """The sharded form's snapshots and peer copies (`worker/state/peercopy.py`)."""
        self._captured: Captured | None = None
        """The sharded form: what this rank held when the current start
        began, kept until a start succeeds (the transaction)."""
        self._initial_extras = ({k: copy.deepcopy(v.state_dict())
                                 for k, v in self._extras().items()}
                                if sharded is not None else {})
        """The sharded form: the ``state=`` entries as the script made them
        (a copy), what a lost state starts them from (`_lost`)."""

    def _extras(self) -> dict[str, Any]:
        """The ``state=`` entries: every registered object but the model and
        its optimizer."""
        return {k: v for k, v in self.ctx.state.items() if k not in ("model", "optimizer")}

    def copies_for(self, plan: pb.Plan, rank: int) -> GenerationCopies | None:
        """The generation's peer copies (the sharded form only; None where
        none are made)."""
        if self.sharded is None:
            return None
        return GenerationCopies.for_generation(self.copies, self.ctx, self.sharded, plan, rank)

    def agree(self, plan: pb.Plan, rank: int) -> Outcome:
        """Makes every rank's state identical (the DDP form).

        The newest state any rank holds wins, unless the plan's checkpoint is
        newer: with no rank holding state (every rank crashed, all holders
        lost) the plan's checkpoint is restored even when the plan expected
        peers to serve it, so a job never starts from scratch while a
        commit exists. A receiving rank loads the state only once all of it
        has arrived: a source or peer lost mid hand-over leaves every rank
        with what it held."""
        world = plan.world_size
        steps, cleans, _ = self.gather_steps(world)
        best = max(steps)
        if self.restore_if_newer(plan, best):
            return Outcome(None, pb.RESTORE_KIND_CHECKPOINT)
        if best >= 0 and all(cleans) and all(s == best for s in steps):
            rngstate.apply(self.ctx.rng)
            return Outcome(None, pb.RESTORE_KIND_PEERS)  # every rank already holds the same state
        lost = ""
        if best < 0:
            source, best = 0, 0  # fresh start: rank 0's initialisation wins
            kind = pb.RESTORE_KIND_NONE
            lost = "no rank holds trained state and the plan names no checkpoint"
        elif (plan.restore.kind == pb.RESTORE_KIND_PEERS and plan.restore.source_rank < world
              and steps[plan.restore.source_rank] == best):
            source, kind = plan.restore.source_rank, pb.RESTORE_KIND_PEERS
        else:
            source, kind = steps.index(best), pb.RESTORE_KIND_PEERS
        holders = _holders(steps, cleans, source) if steps[source] >= 0 else [source]
        source_rng = self._hand_over(source, holders, rank, world)
        self._carry_rng(steps[rank] == best, source_rng)
        self.ctx.held.agreed(best)
        return Outcome(source, kind, state_lost=lost)

    def _hand_over(self, source: int, holders: list[int], rank: int,
                   world: int) -> rngstate.RngState:
        """Every rank ends with the source's state (`worker/state/handover.py`):
        the source broadcasts the state's skeleton and its RNG state, every
        holder whose tensors match the skeleton serves a stripe of the
        tensors' bytes to the ranks that do not hold it, which load it only
        once all of it has arrived. Returns the source's RNG state.
        Collective; a failure raises before any rank's state changes."""
        mine = ({k: v.state_dict() for k, v in self.ctx.state.items()}
                if rank in holders else None)
        skeleton, tensors = handover.split(mine) if mine is not None else (None, [])
        received = broadcast_object({"state": skeleton, "rng": self._own_rng()}
                                    if rank == source else None, source, rank)
        skeleton = received["state"]
        serves = torch.tensor([int(mine is not None and handover.same_layout(tensors, skeleton))])
        flags = [torch.zeros_like(serves) for _ in range(world)]
        dist.all_gather(flags, serves)
        handed_to_gloo(serves, *flags)
        servers = [r for r in holders if int(flags[r])]
        metas = handover.placeholders(skeleton)
        transfer = handover.plan_handover([m.numel() * m.element_size() for m in metas], servers,
                                          [r for r in range(world) if r not in servers])
        t0 = time.monotonic()
        got = handover.stream(transfer, rank, tensors if rank in servers else None, skeleton)
        if got is not None:  # complete: loaded only now
            t1 = time.monotonic()
            state = handover.join(skeleton, got)
            for k, v in self.ctx.state.items():
                v.load_state_dict(state[k])
            log.info("received the state from ranks %s: %d bytes in %.2fs, loaded in %.2fs",
                     servers, sum(c.nbytes for c in transfer.chunks), t1 - t0,
                     time.monotonic() - t1)
        return cast(rngstate.RngState, received["rng"])

    def _own_rng(self) -> rngstate.RngState:
        """This rank's RNG state at its state's step boundary."""
        return self.ctx.rng if self.ctx.rng is not None else rngstate.capture()

    def _carry_rng(self, held: bool, source_rng: rngstate.RngState) -> None:
        """A rank that held the agreed step goes back to its own RNG state at
        that boundary, one that received the state takes the source's
        (`worker/rank/rngstate.py`)."""
        rngstate.apply(self.ctx.rng if held else source_rng)

    def gather_steps(self, world: int, *, refused: bool = False
                     ) -> tuple[list[int], list[bool], bool]:
        """Collective: the step every rank's state holds, whether each ended
        the previous generation cleanly, and whether any rank's state cannot
        be resharded in memory (`refused`: the sharded form)."""
        gathered = _all_gather_ints([self.ctx.state_step, int(self.ctx.clean), int(refused)],
                                    world)
        return ([t[0] for t in gathered], [bool(t[1]) for t in gathered],
                any(t[2] for t in gathered))

    def _settle_pending(self, world: int) -> None:
        """Collective (the sharded form's every start, before the capture): a
        rank whose last step broke in its optimizer step's wait for the world
        (`Generation._reach`) applies that step's update when another rank
        holds the step, else drops it (`HeldState.apply_pending`,
        `drop_pending`).

        The wait is a gloo all-reduce, which can complete on one rank and
        fail on another when a peer dies inside it: the first applies step k,
        the second holds step k-1, and no step would be held whole by the
        survivors. A rank holding step k proves that every rank entered step
        k's wait, so every rank's gradients of step k were complete and the
        pending update is the one the holder applied. An update that raises
        leaves its rank holding nothing (it is filled like a joiner, and the
        start goes on)."""
        held = self.ctx.held
        pending = held.pending_step
        gathered = _all_gather_ints([held.state_step], world)
        if pending is None:
            return
        holders = [r for r, (step,) in enumerate(gathered) if step == pending]
        if not holders:
            log.info("step %d's update, pending since its optimizer step's wait broke, is "
                     "dropped: no rank holds that step", pending)
            held.drop_pending()
            return
        try:
            held.apply_pending()
        except Exception:  # the others go on: this rank offers nothing now
            log.exception("step %d's pending update failed: this rank holds no state", pending)
            return
        log.warning("applied step %d's update, pending since its optimizer step's wait broke: "
                    "ranks %s hold that step", pending, holders)

    @staticmethod
    def _will_restore(plan: pb.Plan, best: int) -> bool:
        """Whether `restore_if_newer` restores the plan's checkpoint."""
        ref = plan.restore.checkpoint if plan.restore.checkpoint.uri else None
        return ref is not None and best < int(ref.step) and plan.restore.kind in (
            pb.RESTORE_KIND_CHECKPOINT, pb.RESTORE_KIND_PEERS)

    def restore_if_newer(self, plan: pb.Plan, best: int) -> bool:
        """Restores the plan's checkpoint when it is newer than every rank's
        state (see `agree`); False when it is not."""
        if not self._will_restore(plan, best):
            return False
        ref = plan.restore.checkpoint
        self.restore(plan, ref, f"no rank holds the state the plan expected (best step {best})"
                     if plan.restore.kind == pb.RESTORE_KIND_PEERS else "")
        return True

    def restore(self, plan: pb.Plan, ref: pb.CheckpointRef, why: str) -> None:
        """Restores `ref` through the restore hook. The URI is checked first,
        before anything is read (`outside_job`): a record written straight
        into etcd bypasses the coordinator's check at commit."""
        refused = outside_job(plan, ref.uri, self.ctx.env.job_id)
        if refused is not None:
            if self.ctx.reporter is not None:  # the job fails at once, naming it
                self.ctx.reporter.report_fatal(plan, refused)
            raise StateUnrecoverable(refused)
        if self.restore_checkpoint is None:
            raise RuntimeError(f"plan says restore from checkpoint {ref.uri} "
                               "but no restore hook is set")
        if why:
            log.warning("%s: restoring checkpoint step %d", why, ref.step)
        self.ctx.held.restored(self.restore_checkpoint(ref, self.ctx.state))

    def agree_sharded(self, plan: pb.Plan, rank: int, store: dist.Store) -> Outcome:
        """`agree` for the sharded form: builds the model on the new mesh
        (the script's build function; BuildFailed when it raises) and fills
        it (`_fill`).

        A transaction (module docstring): what this rank held when the first
        attempt began (`Captured`) is kept, with `ctx.state_step`, until an
        attempt succeeds; a start that fails anywhere after it (a peer lost
        in a collective, the build wait, the exchange, a roll back, a
        restore) leaves the model it built unused, and the next attempt
        starts from the same pieces. Raises `StateUnrecoverable` (not a
        membership change) when the ranks agree that nothing can fill the
        new model and the job cannot go on."""
        sm = self.sharded
        assert sm is not None
        self._settle_pending(plan.world_size)
        if self._captured is None:
            self._captured = sm.capture()
        else:  # the failed start's model: never a source
            sm.release()
        captured = self._captured
        steps, _, refused = self.gather_steps(plan.world_size, refused=bool(captured.refused))
        best = max(steps)
        t0 = time.monotonic()
        mesh = build_mesh(MeshLayout.from_plan(plan), self.ctx.device.type)
        note_subgroup_endpoints(store, rank, plan.world_size)  # a reset there names its peer
        ref = plan.restore.checkpoint if plan.restore.checkpoint.uri else None
        restores = self._will_restore(plan, best) or (refused and ref is not None)
        # every value is overwritten when some rank holds state or a checkpoint
        # is restored: no initialisation (`sharded.py`), unless nothing fills it
        sm.rebuild(mesh, self.ctx.device, filled=best >= 0 or restores,
                   from_checkpoint=restores)
        # the build takes the script's time, not a collective's: wait for the
        # slowest rank's build under the rendezvous deadline (a store wait)
        store.set(f"built/{rank}", "1")
        store.wait([f"built/{r}" for r in range(plan.world_size)],
                   datetime.timedelta(seconds=self.ctx.env.rendezvous_timeout_s))
        self.ctx.state["model"], self.ctx.state["optimizer"] = sm.model, sm.optimizer
        built_s, t0 = time.monotonic() - t0, time.monotonic()
        if refused:
            why = next((w for w in cast(list[str], all_gather_objects(
                captured.refused, plan.world_size)) if w), "")
            outcome = self._refused(plan, rank, best, why, ref, mesh)
        elif self._will_restore(plan, best):
            self._restore_sharded(plan, plan.restore.checkpoint,
                                  f"no rank holds the state the plan expected (best step {best})"
                                  if plan.restore.kind == pb.RESTORE_KIND_PEERS else "")
            outcome = Outcome(None, pb.RESTORE_KIND_CHECKPOINT, mesh)
        elif best < 0:
            outcome = self._lost(mesh, "no rank holds trained state and the plan names no "
                                       "checkpoint")
        else:
            outcome = self._fill(plan, rank, steps, captured, mesh)
        self._captured = None  # started: the pieces are the new model's now
        if outcome.kind != pb.RESTORE_KIND_PEERS:
            self.copies.clear()  # of another timeline now
        log.info("generation %d state agreed on rank %d (built in %.2fs, filled in %.2fs)",
                 plan.generation, rank, built_s, time.monotonic() - t0)
        return outcome

    def _refused(self, plan: pb.Plan, rank: int, best: int, why: str,
                 ref: pb.CheckpointRef | None, mesh: DeviceMesh) -> Outcome:
        """Some rank's state cannot be resharded in memory, `why` (every rank
        knows from the agreement): the plan's checkpoint is restored on every
        rank, else the job cannot go on (`StateUnrecoverable`, reported by
        rank 0)."""
        if ref is None:
            message = (f"the state of step {best} cannot be resharded in memory ({why}) and "
                       "nothing was committed to restore instead")
            if rank == 0 and self.ctx.reporter is not None:
                self.ctx.reporter.report_fatal(plan, message)
            raise StateUnrecoverable(message)
        self._restore_sharded(plan, ref, f"the state of step {best} cannot be resharded in memory "
                                   f"({why})")
        return Outcome(None, pb.RESTORE_KIND_CHECKPOINT, mesh)

    def _restore_sharded(self, plan: pb.Plan, ref: pb.CheckpointRef, why: str) -> None:
        """Restores `ref` into the new model. Optimizer entries made for a fill
        (`ShardedModel.targets`) are dropped first: the checkpoint fills what
        it holds, and a parameter never stepped before the save starts
        without state, never with uninitialised memory."""
        sm = self.sharded
        assert sm is not None and sm.optimizer is not None and sm.mesh is not None
        sm.optimizer.state.clear()
        if sm.uninitialised and sm.model is not None and any(
                m._non_persistent_buffers_set for m in sm.model.modules()):
            self._built_for_real(sm.mesh)  # the checkpoint holds no non-persistent buffers
        self.restore(plan, ref, why)

    def _lost(self, mesh: DeviceMesh, why: str) -> Outcome:
        """The state is lost (the model is the build's own): the ``state=``
        entries start again from the values the script gave them, on every
        rank (a survivor's would be of a step no rank holds any more), and the
        ranks start at step 0, saying `why`."""
        for k, v in self._extras().items():
            v.load_state_dict(copy.deepcopy(self._initial_extras[k]))
        self.ctx.held.started_fresh()
        return Outcome(0, pb.RESTORE_KIND_NONE, mesh, state_lost=why)

    def _built_for_real(self, mesh: DeviceMesh) -> None:
        """The model as the build function initialises it (nothing holds the
        state): built again, so that no entry a fill made (uninitialised
        memory, optimizer state) is kept."""
        sm = self.sharded
        assert sm is not None
        sm.rebuild(mesh, self.ctx.device)
        self.ctx.state["model"], self.ctx.state["optimizer"] = sm.model, sm.optimizer

    def _fill(self, plan: pb.Plan, rank: int, steps: list[int], captured: Captured,
              mesh: DeviceMesh) -> Outcome:
        """The built model gets the newest shards from their live holders
        (in memory), else the peer copies' newest complete step, else the
        plan's checkpoint, else the state is lost (built again for real,
        step 0, said in the outcome). Every rank learns every rank's holdings
        and needs (two all-gathers), so each source is chosen alike
        everywhere; a fill is used only when it covers every tensor of the
        new model (`ShardedModel.missing`) and every rank wrote all it
        needed (`reshard.agree_written`)."""
        sm = self.sharded
        assert sm is not None
        best = max(steps)
        source = steps.index(best)
        have = ({"rows": {k: rows for k, (_, rows) in captured.held.items()},
                 "digests": captured.digests, "loose": captured.loose}
                if steps[rank] == best else {})
        haves = cast(list[dict[str, Any]], all_gather_objects(have, plan.world_size))
        keys: dict[str, Box] = {k: r for h in haves for k, r in h.get("rows", {}).items()}
        ref = plan.restore.checkpoint if plan.restore.checkpoint.uri else None
        differing = _differing_replicas(haves)
        if differing:
            return self._refused(plan, rank, best, ", ".join(differing), ref, mesh)
        # a pipeline stage's model has its own layers only: every rank learns
        # every model's keys with the needs, so the fill is judged alike
        targets = sm.targets(keys)
        gathered = cast(list[dict[str, Any]], all_gather_objects(
            {"needs": {k: r for k, (_, r) in targets.items()}, "own": sorted(sm.own_keys())},
            plan.world_size))
        missing = unfilled(keys, [set(g["own"]) for g in gathered])
        if missing:
            log.warning("the held state of step %d does not fill the new model: %s",
                        best, ", ".join(missing[:5]))
            return self._next_source(plan, rank, best, ref, mesh,
                                     f"the held state does not fill {', '.join(missing[:3])}")
        transfers = plan_transfers([h.get("rows", {}) for h in haves],
                                   [g["needs"] for g in gathered])
        if transfers is None:
            return self._next_source(plan, rank, best, ref, mesh, "")
        written = exchange(transfers, rank, captured.held, targets)
        if not agree_written(transfers, rank, targets):
            return self._next_source(plan, rank, best, ref, mesh, "the exchange left rows unwritten")
        extra = self._extras()
        mine = ({"hyper": sm.hyperparameters(), "extra": {k: v.state_dict() for k, v in
                                                          extra.items()},
                 "rng": self._own_rng()}
                if rank == source else None)
        replicated = broadcast_object(mine, source, rank)
        sm.set_hyperparameters(replicated["hyper"])
        own = sm.own_keys()  # each stage's from its holders
        sm.set_loose_state({fqn: entries for h in haves for fqn, entries in h.get("loose", {}).items()
                            if f"param/{fqn}" in own})
        if rank != source:
            for k, v in extra.items():
                v.load_state_dict(replicated["extra"][k])
        self._carry_rng(steps[rank] == best, replicated["rng"])  # the build drew from it too
        log.info("resharded step %d in memory: %d transfers, %d bytes received here",
                 best, len(transfers), written)
        self.ctx.held.agreed(best)
        return Outcome(source, pb.RESTORE_KIND_PEERS, mesh)

    def _next_source(self, plan: pb.Plan, rank: int, best: int, ref: pb.CheckpointRef | None,
                     mesh: DeviceMesh, why: str) -> Outcome:
        """The live holders cannot fill the new model (some rows have none,
        or `why`): the newest complete peer-copy step, else the plan's
        checkpoint, else the state is lost (built again for real, step 0)."""
        sm = self.sharded
        assert sm is not None
        rolled = self.copies.roll_back(self.ctx, sm, plan.world_size, rank,
                                       newest_commit=int(ref.step) if ref else -1)
        if rolled is not None:
            return Outcome(rolled[0], rolled[1], mesh)
        if ref is None:
            log.error("shards of step %d have no live holder and nothing was committed: "
                      "the state is lost, starting from the built model", best)
            self._built_for_real(mesh)
            return self._lost(mesh, f"the shards of step {best} have no live holder"
                                    f"{f' ({why})' if why else ''}, no complete peer copy and "
                                    "nothing was committed")
        self._restore_sharded(plan, ref, f"shards of step {best} have no live holder"
                                   + (f" ({why})" if why else ""))
        return Outcome(None, pb.RESTORE_KIND_CHECKPOINT, mesh)


def _all_gather_ints(values: list[int], world: int) -> list[list[int]]:
    """Collective: every rank's `values` (the same length everywhere), by rank."""
    mine = torch.tensor(values, dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    handed_to_gloo(mine, *gathered)
    return [[int(v) for v in t] for t in gathered]


def _holders(steps: list[int], cleans: list[bool], source: int) -> list[int]:
    """The ranks whose state is the source's: the source, and when it ended
    the previous generation cleanly every rank that did so at the same step
    (in DDP they stopped at the same step boundary). A rank that broke
    mid-step may have applied part of a step: it receives."""
    if not cleans[source]:
        return [source]
    return [r for r, (s, c) in enumerate(zip(steps, cleans)) if s == steps[source] and c]


def _differing_replicas(haves: list[dict[str, Any]]) -> list[str]:
    """Plain tensors (taken as replicated) whose holders hold different
    values: they are some rank's own slice, which no other rank may take."""
    seen: dict[str, set[str]] = {}
    for have in haves:
        for key, digest in have.get("digests", {}).items():
            seen.setdefault(key, set()).add(digest)
    return [f"{key} is a plain tensor whose values differ between ranks (a rank's own slice?)"
            for key, digests in sorted(seen.items()) if len(digests) > 1]
