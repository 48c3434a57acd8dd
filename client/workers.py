"""A member's one-shot WorkerService calls, beside the job client (`api.py`).

The agent (ReportFailure, DrainMember, LeaveJob), restart mode's progress
relay (ReportStep, CommitCheckpoint) and the training library's checkpoints
(CommitCheckpoint, ReportCheckpointError) make the same kind of call: one
attempt within `RPC_TIMEOUT_S`, and an error that is logged and dropped (the
coordinator learns what it missed another way: the peers' collectives fail,
the member expires, the next report supersedes the lost one). `MemberCalls`
owns that timeout and that error handling, so each caller says only what a
failure means for it; each method returns the answer, or None when the call
failed. `commit_then_prune` is the one commit-then-prune: the coordinator's
record decides what storage keeps (retention is its rule alone).

The member's stream calls (Heartbeat, WatchPlans) are loops whose errors
mean a fence or a reconnect (`worker/agent/member.py`), not calls made here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as wpb

log = logging.getLogger("springback.client")

RPC_TIMEOUT_S = 5.0
"""One attempt of a member's call."""


class MemberCalls:
    """The calls of one member (`member_id` of `job_id`) on `stub`, a
    WorkerService stub carrying the member's credential. A failed call is
    logged as ``<what> failed: <code> <details>[; <then>]`` and answers None."""

    def __init__(self, stub: Any, job_id: str, member_id: str, *,
                 timeout_s: float = RPC_TIMEOUT_S) -> None:
        self.stub, self.job_id, self.member_id = stub, job_id, member_id
        self.timeout_s = timeout_s

    def _call(self, method: str, request: Any, *, what: str = "", then: str = "",
              timeout_s: float | None = None) -> Any:
        try:
            return getattr(self.stub, method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            log.warning("%s failed: %s %s%s", what or method, e.code().name, e.details(),
                        f"; {then}" if then else "")
            return None

    def report_failure(self, generation: int, reason: str, *, what: str = "",
                       then: str = "the peers' collectives fail anyway",
                       timeout_s: float | None = None, **fields: Any
                       ) -> wpb.ReportFailureResponse | None:
        """ReportFailure of `generation`; `fields` are the request's others
        (``state_kept``, ``lost_peer``/``lost_rank``, ``job_fatal``,
        ``job_pause``, ``storage_unavailable``: what the failure is)."""
        return self._call("ReportFailure", wpb.ReportFailureRequest(
            job_id=self.job_id, member_id=self.member_id, generation=generation, reason=reason,
            **fields), what=what, then=then, timeout_s=timeout_s)

    def report_step(self, generation: int, step: int, loss: float, *, start: bool = False,
                    restored_from: pb.RestoreKind = pb.RESTORE_KIND_UNSPECIFIED,
                    store_intrusion: str = "") -> wpb.ReportStepResponse | None:
        return self._call("ReportStep", wpb.ReportStepRequest(
            job_id=self.job_id, member_id=self.member_id, generation=generation, step=step,
            loss=loss, generation_start=start, restored_from=restored_from,
            store_intrusion=store_intrusion),
            what=f"ReportStep(step={step}{', generation start' if start else ''})")

    def commit_checkpoint(self, generation: int, ref: pb.CheckpointRef
                          ) -> wpb.CommitCheckpointResponse | None:
        return self._call("CommitCheckpoint", wpb.CommitCheckpointRequest(
            job_id=self.job_id, member_id=self.member_id, generation=generation,
            checkpoint=ref), what=f"CommitCheckpoint(step={ref.step})")

    def commit_then_prune(self, generation: int, ref: pb.CheckpointRef,
                          prune: Callable[[list[str]], object]) -> bool:
        """Commits `ref` under `generation`; once recorded, `prune(retained
        URIs)` deletes what the coordinator's record no longer holds (e.g.
        ``storage.prune_to_record``). A failed prune is logged: the next
        commit's prune finds the same files. False when the commit failed."""
        resp = self.commit_checkpoint(generation, ref)
        if resp is None:
            return False
        log.info("checkpoint of step %d recorded", ref.step)
        try:
            prune([r.uri for r in resp.retained])
        except Exception as e:  # noqa: BLE001 - storage errors of any kind: retried next time
            log.warning("deleting unrecorded checkpoints failed, retried after the next "
                        "commit: %s", e)
        return True

    def report_checkpoint_error(self, generation: int, error: str
                                ) -> wpb.ReportCheckpointErrorResponse | None:
        return self._call("ReportCheckpointError", wpb.ReportCheckpointErrorRequest(
            job_id=self.job_id, member_id=self.member_id, generation=generation, error=error))

    def drain_member(self, reason: str, *, preempted: bool) -> wpb.DrainMemberResponse | None:
        return self._call("DrainMember", wpb.DrainMemberRequest(
            job_id=self.job_id, member_id=self.member_id, reason=reason, preempted=preempted),
            then="leaving without handing over")

    def leave_job(self, reason: str, *, preempted: bool = False) -> wpb.LeaveJobResponse | None:
        return self._call("LeaveJob", wpb.LeaveJobRequest(
            job_id=self.job_id, member_id=self.member_id, reason=reason, preempted=preempted),
            then="the member expires by itself")
