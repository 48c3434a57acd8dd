"""Every replica's view of the jobs' current plans, for plan streams that cost no thread.

Plan streams (WatchPlans, one per agent) are served by *every* replica, not
forwarded to the leader: only the leader writes plans, and each replica reads
them from etcd with one prefix watch on ``/springback/v1/plans/``. A
`PlanBoard` keeps the newest plan per job and each member's slice of it,
serialized once per member (`Posted`), and wakes the waiting streams on the
replica's asyncio loop.

Ordering: a plan's generation only grows, and a plan rewritten within its
generation (new hot spares) has a higher mod revision, so the board keeps the
entry with the highest (generation, mod revision) whichever way watch events
and reads interleave. Failure semantics: a watch that breaks (etcd restarted,
connection lost) is re-created and the prefix read again by the resync
thread, which also compares the prefix's fingerprint every ``RESYNC_S`` (two
small reads), so a missed event delays a plan by at most that long; a write
the watch did not deliver by then counts as a broken watch (etcd3's watcher
does not report every way a watch stream ends). While
this replica cannot reach etcd, streams are ended with UNAVAILABLE by the
servicer (the agent reconnects to another replica); the board itself only
keeps what it last saw.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from typing import Any

from springback.client import plans
from springback.service.etcd import keys
from springback.client.errors import SpringbackError
from springback.service.etcd.store import Entry, Store
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws

log = logging.getLogger(__name__)

RESYNC_S = 1.0
"""How often the prefix's fingerprint is compared (and the watch re-created if broken)."""


REASON_SENT = 240
"""Characters of a plan's reason sent to members (the whole reason is in the
job's history and status)."""


def skeleton_of(plan: pb.Plan, digest: bytes) -> pb.Plan:
    """The part of the whole `plan` that every member is sent: all but the
    members' entries and the spares' names, which `nodes` and `num_spares`
    stand for (client/plans.py), its reason cut to `REASON_SENT` characters,
    and the whole plan's `digest`."""
    part = pb.Plan()
    part.CopyFrom(plan)
    plans.set_nodes(part)
    del part.members[:], part.spares[:]
    part.num_spares = len(plan.spares)
    part.digest = digest
    part.rendezvous_secret = ""  # for the members the plan places only (`Posted.slice`)
    if len(part.reason) > REASON_SENT:  # a join storm's reason names every joiner
        part.reason = part.reason[:REASON_SENT - 1] + "…"
    return part


class Posted:
    """A job's current plan as streams send it: to each member its own slice,
    the skeleton plus its own entry (none for a member the plan does not
    place, only its own name for a spare; the rendezvous secret to the
    members it places only), so a generation costs each stream
    O(1) bytes. Built on etcd's watch thread; `response` runs on the loop."""

    def __init__(self, value: bytes, mod_revision: int) -> None:
        self.plan = pb.Plan.FromString(value)
        self.mod_revision = mod_revision
        self.digest = hashlib.sha256(value).digest()
        self._skeleton = skeleton_of(self.plan, self.digest)
        self._entries = {m.member_id: m for m in self.plan.members}
        self._spares = frozenset(self.plan.spares)
        self.planned = frozenset(self._entries) | self._spares
        """Member ids with ranks or a spare's place in the plan."""
        self._responses: dict[str, bytes] = {}

    @property
    def order(self) -> tuple[int, int]:
        return self.plan.generation, self.mod_revision

    def slice(self, member_id: str) -> pb.Plan:
        part = pb.Plan()
        part.CopyFrom(self._skeleton)
        entry = self._entries.get(member_id)
        if entry is not None:
            part.members.append(entry)
            part.rendezvous_secret = self.plan.rendezvous_secret
        if member_id in self._spares:
            part.spares.append(member_id)
        return part

    def response(self, member_id: str) -> bytes:
        """The serialized `WatchPlansResponse` with `member_id`'s slice,
        encoded once per member and plan."""
        encoded = self._responses.get(member_id)
        if encoded is None:
            encoded = ws.WatchPlansResponse(plan=self.slice(member_id)).SerializeToString()
            self._responses[member_id] = encoded
        return encoded


class PlanBoard:
    """The newest plan per job on this replica; `start` once, `close` once.

    Updates arrive on etcd's watch thread and the resync thread; readers and
    waiters run on `loop` (the gRPC server's asyncio loop)."""

    def __init__(self, store: Store, loop: asyncio.AbstractEventLoop) -> None:
        self._store = store
        self._loop = loop
        self._posted: dict[str, Posted] = {}  # touched on the loop only
        self._changed: dict[str, asyncio.Event] = {}
        self._lock = threading.Lock()
        self._watch_id: Any = None
        self._broken = True
        self._fingerprint: tuple[int, int] | None = None
        self._watched_revision = 0  # newest mod revision the watch delivered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._resync_loop, name="plan-board", daemon=True)
        self.num_resyncs = 0

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            if self._watch_id is not None:
                self._store.cancel_watch(self._watch_id)

    # -- on the loop -------------------------------------------------------------

    def get(self, job_id: str) -> Posted | None:
        return self._posted.get(job_id)

    async def changed(self, job_id: str, timeout_s: float) -> None:
        """Returns when the job's plan changes, `wake_all` runs, or after `timeout_s`."""
        event = self._changed.setdefault(job_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def wake_all(self) -> None:
        """Wakes every waiting stream (they re-check, e.g. etcd reachability); thread-safe."""
        self._loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        for job_id in list(self._changed):
            self._wake(job_id)

    def _wake(self, job_id: str) -> None:
        event = self._changed.pop(job_id, None)
        if event is not None:
            event.set()

    def _apply(self, job_id: str, posted: Posted | None) -> None:
        current = self._posted.get(job_id)
        if posted is None:
            if current is not None:
                del self._posted[job_id]
                self._wake(job_id)
        elif current is None or posted.order > current.order:
            self._posted[job_id] = posted
            self._wake(job_id)

    def _retain(self, job_ids: frozenset[str]) -> None:
        for job_id in [j for j in self._posted if j not in job_ids]:
            self._apply(job_id, None)

    # -- off the loop --------------------------------------------------------------

    def _post(self, job_id: str, posted: Posted | None) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._apply, job_id, posted)

    def _on_watch(self, response: Any) -> None:
        if isinstance(response, Exception):
            log.info("plan watch broke (%s); resyncing", response)
            self._broken = True
            return
        for event in response.events:
            self._watched_revision = max(self._watched_revision, event.mod_revision)
            job_id = event.key.decode()[len(keys.PLANS):]
            if type(event).__name__ == "DeleteEvent":
                self._post(job_id, None)
            else:
                self._post(job_id, Posted(event.value, event.mod_revision))

    def _resync(self) -> None:
        """Re-creates a broken watch, then reads every plan when the prefix changed."""
        if self._broken:
            with self._lock:
                if self._watch_id is not None:
                    self._store.cancel_watch(self._watch_id)
                self._watch_id = self._store.watch_prefix(keys.PLANS, self._on_watch)
                self._broken = False
                self._fingerprint = None
        fingerprint = self._store.fingerprint(keys.PLANS)
        if fingerprint == self._fingerprint:
            return
        if self._fingerprint is not None and fingerprint[1] > self._watched_revision:
            # A write the watch did not deliver within RESYNC_S: the watch may
            # have ended silently (etcd3's watcher does not always call back).
            self._broken = True
        self.num_resyncs += 1
        entries: list[Entry] = self._store.get_prefix(keys.PLANS)
        seen = set()
        for entry in entries:
            job_id = entry.key[len(keys.PLANS):]
            seen.add(job_id)
            self._post(job_id, Posted(entry.value, entry.mod_revision))
        if not self._loop.is_closed():  # plans deleted meanwhile: keep only those read
            self._loop.call_soon_threadsafe(self._retain, frozenset(seen))
        self._fingerprint = fingerprint

    def _resync_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._resync()
            except SpringbackError as e:
                self._broken = True
                log.info("plan board resync: %s", e)
            except Exception:  # a bug: log it, keep serving what we have
                log.exception("plan board resync failed")
            self._stop.wait(RESYNC_S)
