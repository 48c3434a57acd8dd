"""client/workers.py: a member's one-shot calls own their timeout and error
handling, and commit-then-prune prunes to the record only after a commit."""

from __future__ import annotations

import logging

import grpc
import pytest

from springback.client.workers import MemberCalls
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as wpb


class Refused(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self) -> str:
        return "stale generation"


class Stub:
    """Answers CommitCheckpoint with `retained`, or raises `error`."""

    def __init__(self, retained: list[str], error: grpc.RpcError | None = None) -> None:
        self.retained, self.error = retained, error
        self.calls: list[tuple[str, object, float]] = []

    def __getattr__(self, method: str):  # noqa: ANN204
        def call(request: object, *, timeout: float) -> object:
            self.calls.append((method, request, timeout))
            if self.error is not None:
                raise self.error
            if method == "CommitCheckpoint":
                return wpb.CommitCheckpointResponse(
                    retained=[pb.CheckpointRef(uri=u) for u in self.retained])
            return getattr(wpb, f"{method}Response")()
        return call


def test_a_commit_prunes_to_the_record_and_every_call_names_the_member_and_its_timeout():
    stub = Stub(retained=["mem://ckpt/step_10", "mem://ckpt/step_20"])
    calls = MemberCalls(stub, "job", "m1", timeout_s=7.0)
    pruned: list[list[str]] = []

    assert calls.commit_then_prune(3, pb.CheckpointRef(step=20, uri="mem://ckpt/step_20"),
                                   pruned.append)
    assert pruned == [["mem://ckpt/step_10", "mem://ckpt/step_20"]]
    assert calls.report_step(3, 21, 0.5, start=True,
                             restored_from=pb.RESTORE_KIND_CHECKPOINT) is not None
    assert calls.leave_job("done") is not None
    (m1, commit, t1), (m2, step, t2), (m3, leave, t3) = stub.calls
    assert (m1, m2, m3) == ("CommitCheckpoint", "ReportStep", "LeaveJob")
    assert {t1, t2, t3} == {7.0}
    assert (commit.job_id, commit.member_id, commit.generation) == ("job", "m1", 3)
    assert step.generation_start and step.restored_from == pb.RESTORE_KIND_CHECKPOINT
    assert leave.reason == "done"


def test_a_refused_commit_prunes_nothing_and_a_failed_prune_is_logged(caplog):
    caplog.set_level(logging.INFO, "springback.client")
    refused = MemberCalls(Stub(retained=[], error=Refused()), "job", "m1")
    pruned: list[list[str]] = []
    assert not refused.commit_then_prune(3, pb.CheckpointRef(step=5, uri="u"), pruned.append)
    assert pruned == []
    assert "CommitCheckpoint(step=5) failed: FAILED_PRECONDITION stale generation" in caplog.text
    for call in (lambda c: c.report_failure(3, "crash"), lambda c: c.drain_member(
            "drain", preempted=False), lambda c: c.report_checkpoint_error(3, "disk full")):
        assert call(refused) is None  # logged and dropped, never raised

    def broken_prune(retained: list[str]) -> None:
        raise OSError("bucket unreachable")

    assert MemberCalls(Stub(retained=["u"]), "job", "m1").commit_then_prune(
        3, pb.CheckpointRef(step=5, uri="u"), broken_prune)
    assert "deleting unrecorded checkpoints failed" in caplog.text


if __name__ == "__main__":
    pytest.main([__file__])


def test_a_rank_s_failure_report_says_what_failed_with_its_own_deadline(caplog):
    caplog.set_level(logging.WARNING, "springback.client")
    stub = Stub(retained=[])
    calls = MemberCalls(stub, "job", "m1", timeout_s=5.0)
    assert calls.report_failure(4, "rank 0 saw rank 3's connection reset", lost_peer=True,
                                lost_rank=3, timeout_s=2.0) is not None
    (method, request, timeout), = stub.calls
    assert (method, timeout) == ("ReportFailure", 2.0)
    assert (request.generation, request.lost_peer, request.lost_rank, request.state_kept) == (
        4, True, 3, False)
    refused = MemberCalls(Stub(retained=[], error=Refused()), "job", "m1")
    assert refused.report_failure(4, "too many bad steps", state_kept=True, job_pause=True,
                                  what="pause report", then="asked again") is None
    assert "pause report failed: FAILED_PRECONDITION stale generation; asked again" in caplog.text
