"""Checkpoint commits: the etcd record that makes a written checkpoint count.

A worker commits after every shard and the manifest are durable in storage.
Every check is part of the etcd transaction that records the commit: the
committing member must be live and planned in the job's current generation
(`fencing.report_fence`: a stale generation is FAILED_PRECONDITION, an
expired member NOT_FOUND), or live and planned in an earlier generation
after which no generation has started (`_newest_started`: every node
draining at once makes generations no rank starts while the last holders
commit the drain checkpoint; once a later generation's ranks agreed on a
state, an earlier generation's commit is stale), and the recorded checkpoints the decision was made
from must be unchanged (every commit also writes the job record, whose mod
revision is compared). A commit that loses to a concurrent writer is retried
from fresh reads; one that keeps losing is ABORTED and recorded nothing.

The ref's URI must lie in the job's own directory under its spec's
``checkpoint.uri`` (INVALID_ARGUMENT otherwise); a job without one records
no checkpoint at all (FAILED_PRECONDITION): ranks restore what the record
names and `job delete --checkpoints` deletes it, so a URI a member chose
must never get in.

Per step, the record holds one checkpoint:

* the same step and URI again (a retried call whose reply was lost): nothing
  is written, the reply is the record as it stands (idempotent);
* the same step, a different URI, in the same generation: refused
  (FAILED_PRECONDITION), the first commit stands;
* the same step from a later generation (training re-reached a step after a
  restore, e.g. because the recorded copy was damaged): the new ref replaces
  the old one, whose files the caller then deletes (it is no longer recorded).

Retention is applied in the same transaction. The reply is the refs still
recorded; the caller deletes what storage holds beyond them *after* the newer
commit is durable (`springback.storage.prune_to_record`), which also covers a
retired checkpoint whose delete failed earlier.
"""

from __future__ import annotations

from springback.service.core import fencing
from springback.service.etcd import keys
from springback.service.core.coordinator import Coordinator, timestamp_now
from springback.client.jobdir import outside_job_directory
from springback.client.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb


def retained(steps: list[int], keep_last: int, keep_every: int) -> set[int]:
    """The steps retention keeps: the newest `keep_last` (0: all), plus every
    step that is a multiple of `keep_every` (0: none).

    Springback's one retention rule: the coordinator applies it when it records
    a commit, and storage deletes what the record no longer holds
    (`springback.storage.prune_to_record`); storage has no rule of its own."""
    newest = sorted(steps, reverse=True)
    keep = set(newest if keep_last == 0 else newest[:keep_last])
    if keep_every:
        keep.update(s for s in steps if s % keep_every == 0)
    return keep


class Commits:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def commit(self, job_id: str, member_id: str, generation: int,
               ref: pb.CheckpointRef) -> list[pb.CheckpointRef]:
        """Records `ref` as committed; returns the checkpoints recorded after
        this commit, oldest first. See the module docstring for the rules."""
        if ref.step == 0:
            raise InvalidArgument("checkpoint.step", "must be positive")
        if not ref.uri:
            raise InvalidArgument("checkpoint.uri", "is required")
        for attempt in range(fencing.ATTEMPTS):
            try:
                return self._commit_once(job_id, member_id, generation, ref)
            except Conflict:
                if attempt == fencing.ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def _newest_started(self, job_id: str, generation: int) -> bool:
        """No generation after `generation` has started (its ranks agreed on a
        state), as this leader saw: a checkpoint of `generation` then still
        holds the newest trained state, as when every node drains at once and
        each drain makes a generation no rank ever starts while the last
        holders write the drain checkpoint. False when this leader saw no
        start (it became leader since): the commit is then judged as current
        or stale only."""
        newest = self.coordinator.history.newest_start(job_id)
        return newest is not None and newest <= generation

    def _commit_once(self, job_id: str, member_id: str, generation: int,
                     ref: pb.CheckpointRef) -> list[pb.CheckpointRef]:
        coordinator = self.coordinator
        coordinator.require_leader()
        store = coordinator.store
        job_entry = store.get(keys.job(job_id), pb.Job)
        if job_entry is None:
            raise NotFound(f"job {job_id!r} not found")
        compare = fencing.report_fence(coordinator, job_id, member_id, generation,
                                       older=self._newest_started(job_id, generation))
        base = job_entry.value.spec.checkpoint.uri
        if not base:  # nothing of such a job writes one: a URI here can only be forged
            raise FailedPrecondition(f"job {job_id} has no checkpoint.uri: it records no "
                                     "checkpoints")
        why = outside_job_directory(ref.uri, base, job_id)
        if why is not None:  # ranks would restore and a delete remove what it names
            raise InvalidArgument("checkpoint.uri", why)
        # Read after the job record: every commit writes both, so while the
        # job's mod revision holds (compared below) this is the whole record.
        existing = [e.value for e in store.get_prefix(keys.checkpoints(job_id), pb.CheckpointRef)]
        same = next((c for c in existing if c.step == ref.step), None)
        if same is not None and same.uri == ref.uri:
            return sorted(existing, key=lambda c: c.step)
        if same is not None and same.generation == generation:
            raise FailedPrecondition(
                f"job {job_id}: step {ref.step} is already committed in generation {generation} "
                f"at {same.uri}; a second commit of that step ({ref.uri}) is refused"
            )
        committed = pb.CheckpointRef()
        committed.CopyFrom(ref)
        committed.generation = generation
        committed.committed_at.CopyFrom(timestamp_now())
        others = [c for c in existing if c.step != ref.step]
        spec = job_entry.value.spec.checkpoint
        keep = retained([c.step for c in others] + [ref.step], spec.keep_last, spec.keep_every)
        retired = [c for c in others if c.step not in keep] + ([same] if same is not None else [])
        txn = store.txn
        ops = [txn.put(keys.checkpoint(job_id, ref.step), committed.SerializeToString())] + [
            txn.delete(keys.checkpoint(job_id, c.step)) for c in retired if c.step != ref.step
        ]
        compare.append(txn.mod(keys.job(job_id)) == job_entry.mod_revision)

        def record(job: pb.Job) -> None:
            if committed.step >= job.status.last_checkpoint.step:
                job.status.last_checkpoint.CopyFrom(committed)
            job.status.checkpoint_error = ""

        what = "replaced" if same is not None else "committed"
        coordinator.change(job_id, f"checkpoint at step {ref.step} {what}", record,
                           kind=js.CHANGE_KIND_OTHER, extra_ops=lambda: ops,
                           extra_compare=compare)
        kept = [c for c in others if c.step in keep] + [committed]
        return sorted(kept, key=lambda c: c.step)

    def report_error(self, job_id: str, member_id: str, generation: int, error: str) -> None:
        """Shows a persistent storage failure in the job status (training goes on).

        Fenced like a commit (same transaction); not idempotent in effect but
        harmless to repeat (the message is replaced)."""
        def record(job: pb.Job) -> None:
            job.status.checkpoint_error = error[:1000]

        fencing.change_as_member(self.coordinator, job_id, member_id, generation,
                                 f"checkpoint error: {error[:200]}", record,
                                 kind=js.CHANGE_KIND_OTHER)
