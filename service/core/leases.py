"""Which etcd lease each member holds, as one replica knows it
(`Coordinator.leases`): learned at a join, a heartbeat or a read of the
members, dropped when the member goes (`forget`) or leadership changes
(`clear`). Member ids name no job. A cache: a miss is read from etcd, and
nothing here is durable.

A forgotten lease is never learned again: a read of the members that began
before the member went (a change on another thread) would otherwise put its
lease back after `forget`, and the fenced member's credential would pass
`revocation` until its next heartbeat. Lease ids are not reused, so the
forgotten ones are kept as tombstones (the newest `TOMBSTONES`).
"""

from __future__ import annotations

import threading

from springback.client.errors import NotFound
from springback.service.etcd import keys
from springback.service.etcd.store import Store

MEMBER_CHECK_S = 1.0
"""A step reporter's registration is read from etcd at most this often (a
report every step would otherwise be an etcd read every step)."""

TOMBSTONES = 65_536
"""Forgotten lease ids kept so a stale read cannot bring one back; a read
older than this many departures is not a concern."""


class MemberLeases:
    """Member id -> lease id, and when each was last found registered."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lease_of: dict[str, int] = {}
        self._checked: dict[str, float] = {}
        self._forgotten: dict[int, None] = {}  # insertion-ordered: oldest first
        self._lock = threading.Lock()  # a remember never lands between forget's steps

    def remember(self, member_id: str, lease_id: int) -> None:
        """Caches the member's lease, unless that lease was forgotten (its
        member went after the read that found it)."""
        with self._lock:
            if lease_id not in self._forgotten:
                self._lease_of[member_id] = lease_id

    def cached(self, member_id: str) -> int | None:
        """The member's lease id if this replica knows it (no I/O)."""
        return self._lease_of.get(member_id)

    def forget(self, member_id: str, lease_id: int | None = None) -> None:
        """Drops the member's cached lease and `lease_id` (when the caller
        knows it) for good: neither is learned again."""
        with self._lock:
            cached = self._lease_of.pop(member_id, None)
            self._checked.pop(member_id, None)
            for lease in (cached, lease_id):
                if lease is not None:
                    self._forgotten[lease] = None
            while len(self._forgotten) > TOMBSTONES:
                del self._forgotten[next(iter(self._forgotten))]

    def clear(self) -> None:
        with self._lock:
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
            lease = entry.lease_id
            self.remember(member_id, lease)
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
