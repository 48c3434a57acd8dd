"""Which etcd lease each member holds, as one replica knows it
(`Coordinator.leases`): learned at a join, a heartbeat or a read of the
members, dropped when the member goes (`forget`) or leadership changes
(`clear`). Member ids name no job. A cache: a miss is read from etcd, and
nothing here is durable.
"""

from __future__ import annotations

from springback.client.errors import NotFound
from springback.service.etcd import keys
from springback.service.etcd.store import Store

MEMBER_CHECK_S = 1.0
"""A step reporter's registration is read from etcd at most this often (a
report every step would otherwise be an etcd read every step)."""


class MemberLeases:
    """Member id -> lease id, and when each was last found registered."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lease_of: dict[str, int] = {}
        self._checked: dict[str, float] = {}

    def remember(self, member_id: str, lease_id: int) -> None:
        self._lease_of[member_id] = lease_id

    def cached(self, member_id: str) -> int | None:
        """The member's lease id if this replica knows it (no I/O)."""
        return self._lease_of.get(member_id)

    def forget(self, member_id: str) -> None:
        self._lease_of.pop(member_id, None)
        self._checked.pop(member_id, None)

    def clear(self) -> None:
        self._lease_of.clear()
        self._checked.clear()

    def lease_of(self, job_id: str, member_id: str, store: Store | None = None) -> int:
        """The member's lease id (cached), read with `store` (default: ours) on a miss."""
        lease = self._lease_of.get(member_id)
        if lease is None:
            entry = (store or self._store).get(keys.member(job_id, member_id))
            if entry is None:
                raise NotFound(
                    f"member {member_id!r} of job {job_id!r} is not registered (expired or "
                    "left): stop local ranks and join again"
                )
            lease = self._lease_of[member_id] = entry.lease_id
        return lease

    def check_registered(self, job_id: str, member_id: str, now: float) -> None:
        """Raises `NotFound` unless the member is registered, read from etcd
        at most every `MEMBER_CHECK_S` (`now`: monotonic seconds): a member
        whose lease expired is NOT_FOUND within that long."""
        if now - self._checked.get(member_id, -MEMBER_CHECK_S) >= MEMBER_CHECK_S:
            if self._store.get(keys.member(job_id, member_id)) is None:
                self._checked.pop(member_id, None)
                raise NotFound(f"member {member_id!r} of job {job_id!r} is not registered "
                               "(expired or left): its reports no longer count")
            self._checked[member_id] = now
