"""The one path of the leader's writes: fenced etcd transactions.

Every write a coordinator replica makes as leader (a job's record and plan, a
member's registration, a checkpoint commit, a history record, a deletion) is
one etcd transaction whose comparisons start with the leader's fencing token
(`Election.fence`: the leader record's create revision). A replica that lost
leadership without noticing (paused, partitioned) therefore writes nothing.

Take the token with `fence` *before* reading what the write depends on, and
pass it to `write`: a decision made while this replica led is applied only if
it still leads when the transaction lands. The caller's own comparisons (the
mod revisions of what it read) join the same transaction, so a concurrent
writer makes the whole write fail and nothing is applied (`write` returns
False; `write_or_conflict` raises `Conflict`).

No lock is held here: etcd orders the transactions. Failure semantics:
`StoreUnavailable` when etcd does not answer within the store's deadline
(the transaction either applied fully or not at all; reading again tells
which), `NotLeader` from `fence` when this replica does not lead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from springback.client.errors import Conflict
from springback.service.etcd.store import Store

Fence = Callable[[], list[Any]]


class FencedWriter:
    """Fenced transactions against one store; thread-safe (holds no state)."""

    def __init__(self, store: Store, fence: Fence) -> None:
        self.store = store
        self._fence = fence

    @property
    def txn(self) -> Any:
        """Builders of comparisons and operations (``txn.put``, ``txn.mod(key) == rev``)."""
        return self.store.txn

    def fence(self) -> list[Any]:
        """The leader's comparisons; raises `NotLeader` unless this replica leads now."""
        return self._fence()

    def write(self, fence: list[Any], compare: Sequence[Any], ops: Sequence[Any]) -> bool:
        """Applies `ops` atomically iff `fence` and `compare` hold; False: nothing applied."""
        return self.store.transaction(list(fence) + list(compare), list(ops))

    def write_or_conflict(self, fence: list[Any], compare: Sequence[Any], ops: Sequence[Any],
                          what: str) -> None:
        """`write`, raising `Conflict` (ABORTED: read again and retry) when nothing applied."""
        if not self.write(fence, compare, ops):
            raise Conflict(f"{what}: concurrent update, retry")

    def create(self, key: str, value: bytes, *, lease: Any = None,
               fence: list[Any] | None = None) -> bool:
        """Create-only put of `key` (fenced): False when it exists or this replica
        lost leadership (nothing written). `fence` defaults to one taken now."""
        txn = self.store.txn
        return self.write(fence if fence is not None else self.fence(),
                          [txn.version(key) == 0], [txn.put(key, value, lease=lease)])
