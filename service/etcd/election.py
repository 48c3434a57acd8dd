"""Leader election over etcd: one coordinator replica leads, the others follow.

Campaign is a create-only put of the leader record bound to this replica's
lease (TTL ``ttl_s``). The record's create revision is the *fencing token*:
every leader-only write compares it (`fence`), so a replica that lost its
lease without noticing (paused, partitioned) cannot write anything.

Failure semantics: the leader renews its lease every ``ttl_s / 3``. A
replica believes it leads only until its *local lease deadline*: the start of
its last successful grant or renewal plus the TTL, on the monotonic clock.
etcd counts the TTL from when it processed that request, later, so the belief
always ends before the lease can expire in etcd and a successor can be
elected: a replica cut off from etcd, or paused (SIGSTOP), stops acting as
leader by itself within ``ttl_s``, even while its renewal call still hangs.
If a renewal finds the lease expired, or fails past the deadline, the replica
steps down (``on_lost`` runs) and campaigns again. A write decided before the
deadline but delivered after it (a delayed packet, a pause between the check
and the send) is what the fencing comparison catches. A killed leader is
replaced once its lease expires: within ``ttl_s`` plus one campaign interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from springback.service.etcd import keys
from springback.client.errors import NotLeader, SpringbackError
from springback.service.etcd.store import Store

log = logging.getLogger(__name__)


class Election:
    def __init__(
        self,
        store: Store,
        address: str,
        *,
        ttl_s: int = 3,
        on_elected: Callable[[], None] | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self._store = store
        self.address = address
        self._ttl_s = ttl_s
        self._on_elected = on_elected
        self._on_lost = on_lost
        self._lease: Any = None
        self._token = 0  # create revision of our leader record; 0 when not leader
        self._lease_deadline = 0.0  # monotonic: we stop believing we lead at this time
        self._leader_cache: tuple[float, str | None] = (0.0, None)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # token and lease against a resignation
        self._thread = threading.Thread(target=self._run, name="election", daemon=True)
        self.num_errors = 0

    # -- public --------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def is_leader(self) -> bool:
        """True while this replica holds the leader record and its local lease
        deadline has not passed (see the module docstring)."""
        return self._token != 0 and time.monotonic() < self._lease_deadline

    def fence(self) -> list[Any]:
        """Comparisons that hold only while this replica is the leader.

        Raises `NotLeader` when it is not; add the result to every leader-only
        transaction's compare list.
        """
        token = self._token
        if not token or time.monotonic() >= self._lease_deadline:
            raise NotLeader(f"replica {self.address} is not the leader")
        return [self._store.txn.create(keys.LEADER) == token]

    def leader_address(self, max_age_s: float = 0.5) -> str | None:
        """The current leader's address (cached up to ``max_age_s``), or None."""
        if self.is_leader():
            return self.address
        at, address = self._leader_cache
        if time.monotonic() - at > max_age_s:
            entry = self._store.get(keys.LEADER)
            address = entry.value.decode() if entry else None
            self._leader_cache = (time.monotonic(), address)
        return address

    def resign(self) -> None:
        """Stops campaigning and gives up leadership now (best effort): the
        leader record goes with its lease before `on_lost` runs, so a successor
        can win its next campaign at once. A campaign of ours still in flight
        gives up what it wins (see `_campaign`)."""
        with self._lock:
            self._stop.set()
            token, lease = self._token, self._lease
            self._token, self._lease = 0, None
        if lease is not None:
            try:
                self._store.revoke_lease(lease.id)
            except SpringbackError as e:
                log.warning("resign: could not revoke lease: %s", e)
        if token:
            self._lost("resigned")
        self._thread.join(timeout=5)

    # -- loop ----------------------------------------------------------------

    def _run(self) -> None:
        interval = self._ttl_s / 3
        while not self._stop.is_set():
            try:
                if self._token:
                    self._renew()
                else:
                    self._campaign()
            except SpringbackError as e:
                self.num_errors += 1
                log.warning("election: %s", e)
                if self._token and self._lease_deadline < time.monotonic():
                    self._step_down("lease could not be renewed before it expired")
            self._stop.wait(interval if self._token else interval / 2)

    def _campaign(self) -> None:
        if self._store.get(keys.LEADER) is not None:
            return
        started = time.monotonic()
        lease = self._store.grant_lease(self._ttl_s)
        txn = self._store.txn
        won = self._store.transaction(
            compare=[txn.create(keys.LEADER) == 0],
            success=[txn.put(keys.LEADER, self.address, lease=lease)],
        )
        entry = self._store.get(keys.LEADER) if won else None
        with self._lock:  # a resignation meanwhile wins over this campaign
            elected = (entry is not None and entry.lease_id == lease.id
                       and not self._stop.is_set())
            if entry is not None and elected:
                self._lease = lease
                self._lease_deadline = started + self._ttl_s
                self._token = entry.create_revision
        if not elected:
            self._store.revoke_lease(lease.id)
            return
        log.info("elected leader %s (token %d)", self.address, self._token)
        if self._on_elected:
            self._on_elected()

    def _renew(self) -> None:
        started = time.monotonic()
        lease = self._lease
        if lease is None:  # resigned meanwhile
            return
        ttl = self._store.refresh_lease(lease.id)
        if ttl <= 0:
            self._step_down("leader lease expired")
            return
        self._lease_deadline = started + ttl

    def _step_down(self, reason: str) -> None:
        with self._lock:
            self._token = 0
            self._lease = None
        self._lost(reason)

    def _lost(self, reason: str) -> None:
        log.warning("leader %s stepping down: %s", self.address, reason)
        if self._on_lost:
            self._on_lost()
