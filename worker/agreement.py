"""How the ranks of a new generation agree on the state they start from.

Every rank all-gathers the step its in-memory state holds. The newest state
any rank holds wins, unless the plan's checkpoint is newer: with no rank
holding state (every rank crashed, all holders lost) the plan's checkpoint
is restored even when the plan expected peers to serve it, so a job never
starts from scratch while a commit exists.

* DDP form (`StateAgreement.agree`): the state of the highest step (the
  plan's source rank when it holds it) is broadcast whole, unless every rank
  ended the previous generation cleanly at the same step; with no state
  anywhere and no checkpoint, rank 0's fresh initialisation is broadcast.
* Both forms carry each rank's RNG state with the state (`worker/rngstate.py`).
* Sharded form (`StateAgreement.agree_sharded`, see `worker/sharded.py`):
  the model is built on the new mesh and its shards filled from the ranks
  holding the rows (`worker/reshard.py`); when some rows have no live
  holder, every rank rolls back to the newest step the peer copies cover
  (`worker/peercopy.py`), else the plan's checkpoint is restored.

Failure semantics: every step here is collective over the generation's
group; a failed collective raises what it raises (the generation fails to
start and the session waits for the next plan, keeping its state). A
restore from storage is all or nothing (see `checkpointing.py`).
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from springback.v1 import types_pb2 as pb
from springback.worker import rngstate
from springback.worker.context import RankContext
from springback.worker.mesh import MeshLayout, build_mesh
from springback.worker.peercopy import GenerationCopies, PeerCopyStore
from springback.worker.rendezvous import handed_to_gloo, note_subgroup_endpoints
from springback.worker.reshard import (
    Rows,
    all_gather_objects,
    broadcast_object,
    exchange,
    plan_transfers,
)
from springback.worker.sharded import Held, ShardedModel

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


class StateAgreement:
    """One rank's side of the agreement, for every generation of a Session."""

    def __init__(self, ctx: RankContext,
                 restore_checkpoint: Callable[[pb.CheckpointRef, dict[str, Any]], int] | None,
                 sharded: ShardedModel | None) -> None:
        self.ctx = ctx
        self.restore_checkpoint = restore_checkpoint
        self.sharded = sharded
        self.copies = PeerCopyStore()
        """The sharded form's snapshots and peer copies (`worker/peercopy.py`)."""

    def copies_for(self, plan: pb.Plan, rank: int) -> GenerationCopies | None:
        """The generation's peer copies (the sharded form only; None where
        none are made)."""
        if self.sharded is None:
            return None
        return GenerationCopies.for_generation(self.copies, self.ctx, self.sharded, plan, rank)

    def agree(self, plan: pb.Plan, rank: int) -> tuple[int | None, int]:
        """Makes every rank's state identical; returns (source rank or None,
        where the state came from: a `RestoreKind`).

        The newest state any rank holds wins, unless the plan's checkpoint is
        newer: with no rank holding state (every rank crashed, all holders
        lost) the plan's checkpoint is restored even when the plan expected
        peers to serve it, so a job never starts from scratch while a
        commit exists."""
        world = plan.world_size
        steps, clean = self.gather_steps(world)
        best = max(steps)
        if self.restore_if_newer(plan, best):
            return None, pb.RESTORE_KIND_CHECKPOINT
        if best >= 0 and clean and all(s == best for s in steps):
            rngstate.apply(self.ctx.rng)
            return None, pb.RESTORE_KIND_PEERS  # every rank already holds the same state
        if best < 0:
            source, best = 0, 0  # fresh start: rank 0's initialisation wins
            kind = pb.RESTORE_KIND_NONE
        elif (plan.restore.kind == pb.RESTORE_KIND_PEERS and plan.restore.source_rank < world
              and steps[plan.restore.source_rank] == best):
            source, kind = plan.restore.source_rank, pb.RESTORE_KIND_PEERS
        else:
            source, kind = steps.index(best), pb.RESTORE_KIND_PEERS
        mine = ({"state": {k: v.state_dict() for k, v in self.ctx.state.items()},
                 "rng": self._own_rng()} if rank == source else None)
        received = broadcast_object(mine, source, rank)
        if rank != source:
            for k, v in self.ctx.state.items():
                v.load_state_dict(received["state"][k])
        self._carry_rng(steps[rank] == best, received["rng"])
        self.ctx.state_step = best
        return source, kind

    def _own_rng(self) -> rngstate.RngState:
        """This rank's RNG state at its state's step boundary."""
        return self.ctx.rng if self.ctx.rng is not None else rngstate.capture()

    def _carry_rng(self, held: bool, source_rng: rngstate.RngState) -> None:
        """A rank that held the agreed step goes back to its own RNG state at
        that boundary, one that received the state takes the source's
        (`worker/rngstate.py`)."""
        rngstate.apply(self.ctx.rng if held else source_rng)

    def gather_steps(self, world: int) -> tuple[list[int], bool]:
        """Collective: the step every rank's state holds, and whether all
        ended the previous generation cleanly."""
        mine = torch.tensor([self.ctx.state_step, int(self.ctx.clean)], dtype=torch.int64)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        handed_to_gloo(mine, *gathered)
        return [int(t[0]) for t in gathered], all(int(t[1]) for t in gathered)

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
        self.restore(ref, f"no rank holds the state the plan expected (best step {best})"
                      if plan.restore.kind == pb.RESTORE_KIND_PEERS else "")
        return True

    def restore(self, ref: pb.CheckpointRef, why: str) -> None:
        if self.restore_checkpoint is None:
            raise RuntimeError(f"plan says restore from checkpoint {ref.uri} "
                               "but no restore hook is set")
        if why:
            log.warning("%s: restoring checkpoint step %d", why, ref.step)
        self.ctx.state_step = self.restore_checkpoint(ref, self.ctx.state)
        self.ctx.clean = False

    def agree_sharded(self, plan: pb.Plan, rank: int, store: dist.Store
                      ) -> tuple[int | None, int, DeviceMesh]:
        """`agree` for the sharded form: builds the model on the new mesh
        (the script's build function; BuildFailed when it raises) and fills
        it (`_fill`). Returns (source, kind, the generation's mesh)."""
        sm = self.sharded
        assert sm is not None
        held = sm.capture()
        steps, _ = self.gather_steps(plan.world_size)
        best = max(steps)
        t0 = time.monotonic()
        mesh = build_mesh(MeshLayout.from_plan(plan), self.ctx.device.type)
        note_subgroup_endpoints(store, rank, plan.world_size)  # a reset there names its peer
        restores = self._will_restore(plan, best)
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
        if self.restore_if_newer(plan, best):
            self.copies.clear()  # of another timeline now
            return None, pb.RESTORE_KIND_CHECKPOINT, mesh
        if best < 0:
            self._built_for_real(mesh)
            self.ctx.state_step = 0
            self.copies.clear()
            return 0, pb.RESTORE_KIND_NONE, mesh
        source, kind = self._fill(plan, rank, steps, held, mesh)
        log.info("generation %d state agreed on rank %d (built in %.2fs, filled in %.2fs)",
                 plan.generation, rank, built_s, time.monotonic() - t0)
        return source, kind, mesh

    def _built_for_real(self, mesh: DeviceMesh) -> None:
        """The model as the build function initialises it, where it was built
        on the meta device for a fill that is not coming (nothing holds the
        state)."""
        sm = self.sharded
        assert sm is not None
        if sm.uninitialised:
            sm.rebuild(mesh, self.ctx.device)
            self.ctx.state["model"], self.ctx.state["optimizer"] = sm.model, sm.optimizer

    def _fill(self, plan: pb.Plan, rank: int, steps: list[int], held: Held, mesh: DeviceMesh
              ) -> tuple[int | None, int]:
        """The built model gets the newest shards from their live holders
        (in memory), else the plan's checkpoint, else stays as built."""
        sm = self.sharded
        assert sm is not None
        best = max(steps)
        source = steps.index(best)
        have = {k: rows for k, (_, rows) in held.items()} if steps[rank] == best else {}
        haves = cast(list[dict[str, Rows]], all_gather_objects(have, plan.world_size))
        keys: dict[str, Rows] = {k: r for h in haves for k, r in h.items()}
        targets = sm.targets(keys)
        needs = all_gather_objects({k: r for k, (_, r) in targets.items()}, plan.world_size)
        transfers = plan_transfers(haves, needs)  # type: ignore[arg-type]
        if transfers is None:
            ref = plan.restore.checkpoint if plan.restore.checkpoint.uri else None
            rolled = self.copies.roll_back(self.ctx, sm, plan.world_size, rank,
                                           newest_commit=int(ref.step) if ref else -1)
            if rolled is not None:
                return rolled
            self.copies.clear()
            if ref is None:
                log.error("shards of step %d have no live holder and nothing was committed: "
                          "starting from the built model", best)
                self._built_for_real(mesh)
                self.ctx.state_step = 0
                return 0, pb.RESTORE_KIND_NONE
            if sm.uninitialised and sm.model is not None and any(
                    m._non_persistent_buffers_set for m in sm.model.modules()):
                self._built_for_real(mesh)  # the checkpoint holds no non-persistent buffers
            self.restore(ref, f"shards of step {best} have no live holder")
            return None, pb.RESTORE_KIND_CHECKPOINT
        received = exchange(transfers, rank, held, targets)
        del held
        extra = {k: v for k, v in self.ctx.state.items() if k not in ("model", "optimizer")}
        mine = ({"hyper": sm.hyperparameters(), "extra": {k: v.state_dict() for k, v in
                                                          extra.items()},
                 "rng": self._own_rng()}
                if rank == source else None)
        replicated = broadcast_object(mine, source, rank)
        sm.set_hyperparameters(replicated["hyper"])
        if rank != source:
            for k, v in extra.items():
                v.load_state_dict(replicated["extra"][k])
        self._carry_rng(steps[rank] == best, replicated["rng"])  # the build drew from it too
        log.info("resharded step %d in memory: %d transfers, %d bytes received here",
                 best, len(transfers), received)
        self.ctx.state_step = best
        return source, pb.RESTORE_KIND_PEERS
