"""Checkpoints of a `Session` through `springback.storage`: periodic, on drain,
and the restore used when no surviving rank holds the state.

Survivors hand state over in memory (see `session.py`); storage is only the
fallback for losing every holder. This module sits beside the session core and
is active only when the job spec has ``checkpoint.uri`` and the session was
given a model (and optimizer). A job's checkpoints go to its own directory,
``<checkpoint.uri>/<job_id>/step-…-g…``, so jobs sharing a URI never meet.

Failure semantics:

* Saving is asynchronous (`Checkpointer.save` returns after a host-memory
  snapshot); the write and the manifest commit run in the background. A
  periodic checkpoint never waits for the previous one: when it comes due
  while any rank is still writing or committing the previous one (slow
  storage, a slow CommitCheckpoint or prune on rank 0), every rank skips it
  (agreed with one all-reduce of a busy flag, so no rank writes a step the
  others skipped); the skip is logged and counted (`skipped`). A slow store
  thus makes checkpoints rarer, never steps slower. Rank 0
  records a committed checkpoint with CommitCheckpoint, fenced by generation,
  then deletes everything storage holds beyond the coordinator's record: what
  the commit retired, partials that can no longer commit, a retired
  checkpoint whose delete failed after an earlier commit. A failed
  delete is logged and retried after the next commit. A storage failure of a
  save is reported with ReportCheckpointError and training goes on.
* A drain checkpoint (any rank's node draining) is saved at the agreed step
  boundary and waited for (up to `DRAIN_SAVE_TIMEOUT_S`) before the ranks move
  on, so a node that was the last holder of the state leaves it committed. The
  checkpoint of the final step (max_steps) is waited for the same way, before
  that step is reported. The ranks leave such a save together, when rank 0's
  commit is done (`_leave_with_rank_0`): on a slow store rank 0's commit ends
  seconds after the others' writes, and a rank waiting for it in the step's
  next collective instead would give up at the collective timeout and break
  the generation whose checkpoint was being committed.
* With pipeline stages (pp > 1) a stage's plain tensors and settings are held
  by its ranks only: the first save of a generation all-gathers which rank
  holds which non-DTensor entry (a collective, like the busy flag), and each
  is written by one of its holders (`storage.snapshot.PlainHolders`).
* At the end of a generation the in-flight save is waited for up to
  `CLOSE_TIMEOUT_S`; a save cut short by a dead peer never commits (its
  manifest is written last) and is deleted after the next commit.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from springback.v1 import types_pb2 as pb
from springback.client.polling import wait_until
from springback.client.workers import MemberCalls
from springback.worker.rank.context import RankContext
from springback.worker.state.mesh import MeshLayout
from springback.worker.rank.rendezvous import handed_to_gloo
from springback.worker.state.peerobjects import all_gather_objects

if TYPE_CHECKING:
    from springback.storage.snapshot import PlainHolders

log = logging.getLogger(__name__)

DRAIN_SAVE_TIMEOUT_S = 60.0
COMMIT_WAIT_SLACK_S = 15.0
"""How much longer than `DRAIN_SAVE_TIMEOUT_S` the other ranks wait for rank
0 to end a waited save (its wait, then its commit record's RPC)."""
CLOSE_TIMEOUT_S = 30.0
RPC_TIMEOUT_S = 10.0


class GenerationCheckpoints:
    """One generation's checkpointer for one rank."""

    def __init__(self, *, ctx: RankContext, plan: pb.Plan, rank: int) -> None:
        """`ctx` gives the registered state, the rank's environment and the
        coordinator's reporter (None: commits are not recorded)."""
        from springback.storage import Checkpointer, job_checkpoint_uri

        self._ctx = ctx
        self._plan = plan
        self._rank = rank
        self.every_steps = int(plan.spec.checkpoint.every_steps)
        self.base_uri = job_checkpoint_uri(plan.spec.checkpoint.uri, plan.job_id or ctx.env.job_id)
        self._holders: PlainHolders | None = None  # gathered at the first save, with pp > 1
        self._ckpt = Checkpointer(self.base_uri, rank=rank,
                                  world_size=plan.world_size,
                                  on_commit=self._on_commit if rank == 0 else None,
                                  on_error=self._on_error)

    def _state(self) -> dict[str, Any]:
        from springback.storage import model_state_dict

        state = self._ctx.state
        return model_state_dict(state["model"], state.get("optimizer"), extra_state=extra_state(state))

    @property
    def skipped(self) -> int:
        """Periodic checkpoints skipped because the previous one was still busy."""
        return self._ckpt.stats.skipped

    def _any_rank_busy(self) -> bool:
        """Collective: True when some rank's previous checkpoint is still being
        written or committed. Raises what a failed collective raises (the
        generation ends, as on a failed step)."""
        busy = 1.0 if self._ckpt.in_flight() else 0.0
        if self._plan.world_size == 1:
            return busy > 0
        t = torch.tensor([busy], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        handed_to_gloo(t)
        return t.item() > 0

    def save(self, step: int, cursor: tuple[int, int], *, wait: bool = False,
             store: dist.Store | None = None) -> bool:
        """Saves `step` (collective: every rank of the generation calls it).

        A periodic save (``wait=False``) returns at once after the snapshot, or
        skips the step on every rank when any rank's previous checkpoint is
        still busy (returns False). A drain or final save (``wait=True``) is
        never skipped: it waits for the previous checkpoint, then for its own
        commit, up to `DRAIN_SAVE_TIMEOUT_S`, and returns on every rank once
        rank 0's wait ended (through the generation's `store`; raises what
        the store raises when rank 0, which serves it, died).
        """
        if not wait and self._any_rank_busy():
            self._ckpt.stats.skipped += 1
            log.warning("checkpoint of step %d skipped on every rank: the previous one is still "
                        "being written or committed (%d skipped in this generation)",
                        step, self._ckpt.stats.skipped)
            return False
        # With the optimizer, the copy to host memory overlaps the next forward
        # and backward; its next step() waits for the copy (storage's pre-hook).
        state = self._state()
        layout = MeshLayout.from_plan(self._plan)
        if layout.pp > 1 and self._holders is None:
            self._holders = gather_holders(state, self._plan.world_size)
        self._ckpt.save(step, state, generation=self._plan.generation, cursor=cursor,
                        layout=layout.as_dict(), optimizer=self._ctx.state.get("optimizer"),
                        urgent=wait, holders=self._holders)
        if wait:
            try:
                self._ckpt.wait(DRAIN_SAVE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - reported by on_error already
                log.error("drain checkpoint of step %d failed: %s", step, e)
            self._leave_with_rank_0(step, store)
        return True

    def _leave_with_rank_0(self, step: int, store: dist.Store | None) -> None:
        """Rank 0 marks its waited save of `step` ended (committed or failed);
        every other rank waits for that mark, so no rank enters the next
        collective while rank 0 still commits. Ends the wait after
        `DRAIN_SAVE_TIMEOUT_S` + `COMMIT_WAIT_SLACK_S` with a warning (rank 0
        is then stuck past its own deadline; the next collective decides)."""
        if store is None or self._plan.world_size == 1:
            return
        key = f"waited-save/{step}"
        if self._rank == 0:
            store.set(key, "ended")
            return
        if not wait_until(lambda: store.check([key]), interval_s=0.02,
                          timeout_s=DRAIN_SAVE_TIMEOUT_S + COMMIT_WAIT_SLACK_S):
            log.warning("rank 0 did not end its save of step %d within %.0fs; going on",
                        step, DRAIN_SAVE_TIMEOUT_S + COMMIT_WAIT_SLACK_S)

    @property
    def stall_s(self) -> float | None:
        """How long the latest save blocked training (save() plus the optimizer
        step that waited for its copy); None before the first save."""
        stats = self._ckpt.stats
        return stats.last_stall_s + stats.last_hook_wait_s if stats.saves else None

    @property
    def stall_total_s(self) -> float:
        """Every save's stall in this generation, summed (0.0 before the first)."""
        return self._ckpt.stats.total_stall_s

    def close(self, *, wait_for_commit: bool) -> None:
        """Ends this generation's checkpointing.

        After a clean step boundary every peer is alive, so the in-flight
        checkpoint is waited for (up to `CLOSE_TIMEOUT_S`) and commits under
        this generation. After a failure a peer may be dead and the commit
        would only time out: wait just until the snapshot is in host memory
        (the state is about to change) and let the upload end in the
        background; a late commit is rejected by the coordinator's fencing
        and the files are cleaned up as partial. Such a checkpoint that does
        not commit is abandoned, not failed: a warning, no checkpoint error
        reported for the job.
        """
        if wait_for_commit:
            self._ckpt.close(CLOSE_TIMEOUT_S)
        else:
            self._ckpt.abandon()
            self._ckpt.wait_snapshot()
            self._ckpt.close(0)

    def _calls(self) -> MemberCalls | None:
        reporter = self._ctx.reporter
        if reporter is None:
            return None
        env = self._ctx.env
        return MemberCalls(reporter.stub, env.job_id, env.member_id, timeout_s=RPC_TIMEOUT_S)

    def _on_commit(self, info: Any) -> None:
        from springback.storage import prune_to_record

        calls = self._calls()
        if calls is None:
            return
        generation = self._plan.generation
        # what this commit retired is no longer in the record: pruned too
        calls.commit_then_prune(generation, info.to_checkpoint_ref(), lambda retained: (
            prune_to_record(self.base_uri, retained, current_generation=generation)))

    def _on_error(self, exc: BaseException) -> None:
        calls = self._calls()
        if calls is None:
            return
        calls.report_checkpoint_error(self._plan.generation,
                                      f"rank {self._rank}: {type(exc).__name__}: {exc}")


def gather_holders(state: dict[str, Any], world_size: int) -> PlainHolders:
    """Collective: which ranks hold each non-DTensor entry of the checkpointed
    state, and its size (a save's ``holders`` where the ranks hold different
    plain entries, as a pipeline's stages do). Raises ValueError naming an entry whose size differs
    between its holders (they would write different data for one key), and
    what a failed collective raises."""
    from springback.storage.snapshot import plain_entries

    holders: dict[str, tuple[int, list[int]]] = {}
    for r, entries in enumerate(all_gather_objects(plain_entries(state), world_size)):
        for fqn, size in cast(dict[str, int], entries).items():
            known = holders.setdefault(fqn, (size, []))
            if known[0] != size:
                raise ValueError(f"checkpoint entry {fqn} has {known[0]} bytes on rank "
                                 f"{known[1][0]} and {size} on rank {r}")
            known[1].append(r)
    return {fqn: (size, tuple(ranks)) for fqn, (size, ranks) in holders.items()}


def extra_state(state: dict[str, Any]) -> dict[str, Any]:
    """The Session's registered ``state=`` entries besides the model and the
    optimizer (an LR scheduler, ...): checkpointed and restored with them."""
    return {k: v for k, v in state.items() if k not in ("model", "optimizer")}


def restore_from_checkpoint(ref: pb.CheckpointRef, state: dict[str, Any]) -> int:
    """The session's restore hook: loads the plan's checkpoint (collective over
    the current group, any world size) into the registered model, optimizer
    and other ``state=`` entries, and this rank's RNG state (saved by rank
    r mod N, `worker/rank/rngstate.py`), and returns the step it holds.

    Files are verified against the manifest's checksums first; when the plan's
    checkpoint is damaged or missing, the newest intact older one under the same
    base URI is restored instead, with a warning naming the bad files (the
    returned step says which). All or nothing: the state is loaded into copies
    and applied once complete, so a failed restore leaves the registered state
    as it was. Raises storage's CorruptCheckpoint / CheckpointNotFound when none
    is usable, CheckpointMismatch when the checkpoint lacks an entry the state
    needs (parameters never stepped before the save are fine: restored without
    optimizer state).
    """
    from springback.storage import restore_model

    base = ref.uri.rstrip("/").rsplit("/", 1)[0]
    result = restore_model(base, state["model"], state.get("optimizer"),
                           extra_state=extra_state(state), max_step=ref.step,
                           restore_rng=True)
    if result.manifest.step != ref.step:
        log.warning("checkpoint of step %d unusable; restored step %d from %s instead",
                    ref.step, result.manifest.step, result.uri)
    else:
        log.info("restored step %d from checkpoint %s", ref.step, result.uri)
    return int(result.manifest.step)
