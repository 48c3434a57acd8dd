"""Member credentials revoked by fencing: a credential lives as long as its member.

A member credential names the etcd lease its member's key was registered with
(`credentials.issue`). `Revocation` lets it open calls only while that lease
is still the one the member's key is bound to. Once the member is fenced (its
lease expired), left (its lease revoked), or its id was registered afresh
under another lease (a join retried with the same join token after expiry),
every call with the old credential is refused UNAUTHENTICATED before its
handler runs, the message saying the member was fenced and must join again;
the agent's new join brings a new credential. Lease ids are not reused, so a
revoked credential never opens again.

Cost: no I/O when this replica knows the member's lease and it is the
credential's (`Coordinator.leases`, learned at a join, a heartbeat or a
check here); otherwise one read of the member's key with the liveness store's
short deadline, on a worker thread. The cached lease is dropped when this
replica sees the member go: its leave, a heartbeat finding the lease expired,
the leader's reconcile pass finding the key gone, peer evidence fencing it;
once dropped it is never learned again (`leases`: a read of the members that
began before the member went cannot put it back). Until then a fenced member's
call passes this check and meets the handler's own fence instead (NOT_FOUND
from a heartbeat or a report, see `heartbeats`, `fencing`): refused either way.
An etcd read that fails is UNAVAILABLE (the client retries another replica).
"""

from __future__ import annotations

import asyncio

from springback.service.etcd import keys
from springback.service.core.coordinator import Coordinator
from springback.service.transport.credentials import MemberCredential
from springback.service.etcd.store import Store


class Revocation:
    """Whether a member credential's incarnation is still its member's; loop-only."""

    def __init__(self, coordinator: Coordinator, store: Store) -> None:
        self._coordinator = coordinator
        self._store = store
        self.num_refused = 0

    async def refusal(self, member: MemberCredential) -> str | None:
        """Why a call with `member`'s credential is refused (its member was
        fenced), or None. Raises `StoreUnavailable` when the member's key
        cannot be read within the liveness deadline."""
        job_id, member_id, lease_id = member
        coordinator = self._coordinator
        if coordinator.leases.cached(member_id) == lease_id:
            return None
        entry = await asyncio.to_thread(self._store.get, keys.member(job_id, member_id))
        if entry is not None and entry.lease_id == lease_id:
            coordinator.leases.remember(member_id, lease_id)
            return None
        self.num_refused += 1
        return (f"the credential of member {member_id!r} of job {job_id!r} is revoked: the "
                "member was fenced (its lease expired, it left, or it joined again); "
                "join the job again for a new member credential")
