"""Member reports fenced inside the etcd transaction that applies them.

A report that writes (a checkpoint commit, a rank failure, a storage error)
is accepted only from a member that is live *and* planned in the job's
current generation, and those facts must still hold when the write lands:
checking them first and writing later would accept a member that expired in
between (its lease gone) or a generation that was replaced in between.
`report_fence` reads the plan and the member's key, checks them, and returns
etcd comparisons (the plan's mod revision, the member key's create revision)
that the caller adds to its write; a transaction that fails them applied
nothing and is retried from fresh reads, which then raise the right error.
"""

from __future__ import annotations

from typing import Any

from springback.service.etcd import keys
from springback.service.core.coordinator import Coordinator, JobMutation
from springback.client.errors import Conflict, FailedPrecondition, NotFound, StaleGeneration
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

ATTEMPTS = 3
"""Fresh read-check-write rounds before a report that keeps losing to
concurrent writers gives up with ABORTED (nothing written)."""


def report_fence(coordinator: Coordinator, job_id: str, member_id: str,
                 generation: int, *, older: bool = False) -> list[Any]:
    """Comparisons that hold while `member_id` is live and planned in
    `generation`, the job's current generation. With `older`, a report of an
    earlier generation is accepted from a live member too (a rank failure
    reported after another member's report already replanned).

    Raises `StaleGeneration` (another generation is current), `NotFound` (the
    member expired or left: it is fenced) or `FailedPrecondition` (live, but
    holds no ranks in this generation, e.g. a hot spare). Two etcd reads; no
    write.
    """
    return _fence(coordinator, job_id, member_id, generation, older=older)[0]


def _fence(coordinator: Coordinator, job_id: str, member_id: str, generation: int, *,
           older: bool) -> tuple[list[Any], int]:
    """`report_fence`'s comparisons and the current generation they hold for."""
    store = coordinator.store
    plan_entry = store.get(keys.plan(job_id), pb.Plan)
    current = plan_entry.value.generation if plan_entry else 0
    if generation > current or (generation != current and not older):
        raise StaleGeneration(job_id, generation, current)
    member_key = keys.member(job_id, member_id)
    member = store.get(member_key)
    if member is None:
        raise NotFound(
            f"member {member_id!r} of job {job_id!r} is not registered (expired or left): "
            "stop local ranks and join again"
        )
    if generation == current and member_id not in {m.member_id for m in plan_entry.value.members}:
        raise FailedPrecondition(
            f"job {job_id}: member {member_id} holds no ranks in generation {generation}"
        )
    txn = store.txn
    return [
        txn.mod(keys.plan(job_id)) == plan_entry.mod_revision,
        txn.create(member_key) == member.create_revision,
    ], current


def change_as_member(coordinator: Coordinator, job_id: str, member_id: str, generation: int,
                     reason: str, mutate: JobMutation | None = None, *, kind: js.ChangeKind,
                     older: bool = False,
                     replan_if_current: bool = False, **kwargs: Any) -> pb.Job:
    """`Coordinator.change` on behalf of a member's report, fenced by `report_fence`
    (`older` as there) in the same transaction; retried from fresh reads on
    `Conflict` (`ATTEMPTS` rounds, then `Conflict`). Not leader: `NotLeader`.

    With `replan_if_current`, a new generation is forced exactly when the
    reported `generation` is still the current one *in the plan the
    transaction compares*: of two reports of one broken generation racing
    each other, the first replans and the second (its comparison failed,
    re-read) only records."""
    for attempt in range(ATTEMPTS):
        coordinator.require_leader()
        fence, current = _fence(coordinator, job_id, member_id, generation, older=older)
        if replan_if_current:
            kwargs["force_generation"] = current == generation
        try:
            return coordinator.change(job_id, reason, mutate, kind=kind, extra_compare=fence,
                                      **kwargs)
        except Conflict:
            if attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")
