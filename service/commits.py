"""Checkpoint commits: the etcd record that makes a written checkpoint count.

A worker commits after every shard and the manifest are durable in storage.
The commit is fenced by generation (a stale one is FAILED_PRECONDITION and
records nothing) and applies retention in the same transaction: the refs it
retires are returned so the caller deletes their files *after* the newer
commit is durable, together with the refs still recorded, so the caller can
also remove what storage holds beyond them (a retired checkpoint whose delete
failed earlier). Committing the same step twice is a no-op.
"""

from __future__ import annotations

from springback.service import keys
from springback.service.coordinator import Coordinator, timestamp_now
from springback.service.errors import InvalidArgument
from springback.v1 import types_pb2 as pb


def retained(steps: list[int], keep_last: int, keep_every: int) -> set[int]:
    """The steps retention keeps: the newest `keep_last` (0: all), plus every
    step that is a multiple of `keep_every` (0: none)."""
    newest = sorted(steps, reverse=True)
    keep = set(newest if keep_last == 0 else newest[:keep_last])
    if keep_every:
        keep.update(s for s in steps if s % keep_every == 0)
    return keep


class Commits:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def commit(self, job_id: str, member_id: str, generation: int,
               ref: pb.CheckpointRef) -> tuple[list[pb.CheckpointRef], list[pb.CheckpointRef]]:
        """Records `ref` as committed; returns (the checkpoints retention
        retires, the checkpoints recorded after this commit)."""
        if ref.step == 0:
            raise InvalidArgument("checkpoint.step", "must be positive")
        if not ref.uri:
            raise InvalidArgument("checkpoint.uri", "is required")
        coordinator = self.coordinator
        coordinator.require_leader()
        coordinator.check_generation(job_id, generation)
        coordinator.lease_of(job_id, member_id)  # NOT_FOUND for a fenced member
        existing = coordinator.list_checkpoints(job_id)
        if any(c.step == ref.step for c in existing):
            return [], existing
        committed = pb.CheckpointRef()
        committed.CopyFrom(ref)
        committed.generation = generation
        committed.committed_at.CopyFrom(timestamp_now())
        job = coordinator.get_job(job_id)
        keep = retained([c.step for c in existing] + [ref.step],
                        job.spec.checkpoint.keep_last, job.spec.checkpoint.keep_every)
        retired = [c for c in existing if c.step not in keep]
        txn = coordinator.store.txn

        def ops() -> list:
            return [txn.put(keys.checkpoint(job_id, ref.step), committed.SerializeToString())] + [
                txn.delete(keys.checkpoint(job_id, c.step)) for c in retired
            ]

        def record(job: pb.Job) -> None:
            coordinator.check_generation(job_id, generation)
            if committed.step >= job.status.last_checkpoint.step:
                job.status.last_checkpoint.CopyFrom(committed)
            job.status.checkpoint_error = ""

        coordinator.change_with_retry(
            job_id, f"checkpoint at step {ref.step} committed", record, extra_ops=ops
        )
        kept = [c for c in existing if c.step in keep] + [committed]
        return retired, sorted(kept, key=lambda c: c.step)

    def report_error(self, job_id: str, member_id: str, generation: int, error: str) -> None:
        """Shows a persistent storage failure in the job status (training goes on)."""
        coordinator = self.coordinator
        coordinator.check_generation(job_id, generation)
        coordinator.lease_of(job_id, member_id)

        def record(job: pb.Job) -> None:
            job.status.checkpoint_error = error[:1000]

        coordinator.change_with_retry(job_id, f"checkpoint error: {error[:200]}", record)
