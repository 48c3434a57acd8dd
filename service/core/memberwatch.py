"""The leader's watch on every job's members: each job's membership
fingerprint, (count, newest mod revision), kept from etcd's events instead of
read from etcd on every reconcile pass.

`Store.fingerprint` makes etcd read and sort every key under a job's members
(for their newest mod revision): taken for every job on every reconcile pass,
a storm of N joins cost O(N^2). A `MemberWatch` reads every member key (keys
only) once, at a revision R, and watches the members of all jobs from R + 1;
each put or delete of a member key then updates its job's key -> mod revision
map, so a job's fingerprint costs no read: it is what `Store.fingerprint`
returns at the newest revision the watch delivered (the settle logic gets the
same values, `Reconciler.settled`).

Failure semantics: a job's watched value is used only while the watch is
known to have missed no event (`live`); otherwise `fingerprint` reads etcd
(`Store.fingerprint`) as the reconcile loop did before the watch. It stops
being live when the watch breaks (its callback gets an error, or None: the
stream ended), when `stop` runs (a leadership change,
`Coordinator.leadership_changed`), when a read of etcd fails, and when the
check finds that it missed an event. The check (every `RESYNC_S`) reads the
whole members prefix's fingerprint at a revision H and compares the watched
one with it once the watch has delivered everything up to H: at the first
event past H, or at the next check if none came (an event not delivered
within `RESYNC_S` counts as missed: etcd3's watcher does not report every way
a watch ends, and an etcd-side cancel is silent). `refresh` (run by each of
the leader's reconcile passes) reads every member key again and watches
afresh whenever the watch is not live: values are only ever rebuilt from a
full read, never patched across a gap.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

from springback.client.errors import SpringbackError
from springback.service.etcd import keys
from springback.service.etcd.store import Store

log = logging.getLogger(__name__)

RESYNC_S = 1.0
"""How often the watched fingerprints are checked against a read of etcd
(one count and one sorted read of all jobs' members)."""


class _Members:
    """One job's member keys and their mod revisions, as the watch saw them."""

    __slots__ = ("revisions", "newest")

    def __init__(self) -> None:
        self.revisions: dict[str, int] = {}
        self.newest: int | None = 0  # None: its key was deleted, found again when asked

    def put(self, key: str, revision: int) -> None:
        self.revisions[key] = revision
        if self.newest is not None:
            self.newest = max(self.newest, revision)

    def delete(self, key: str) -> None:
        if self.revisions.pop(key, None) == self.newest:
            self.newest = None

    def fingerprint(self) -> tuple[int, int]:
        if self.newest is None:
            self.newest = max(self.revisions.values(), default=0)
        return len(self.revisions), self.newest


class MemberWatch:
    """Every job's members' fingerprint on the leader (see the module
    docstring). `fingerprint` from any thread; `refresh` from the reconcile
    loop only; `stop` from any thread. Events arrive on etcd's watch thread."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._epoch = 0  # bumped when the values are dropped: an older watch's events are ignored
        self._watch_id: Any = None
        self._live = False
        self._jobs: dict[str, _Members] = {}
        self._delivered = 0  # the newest revision the watch delivered (or the full read's)
        self._check: tuple[int, int, int] | None = None  # a read (count, newest, revision)
        self._checked_at = 0.0
        self._retry_at = 0.0  # monotonic: no start tried before
        self.num_rebuilds = 0
        """Full reads of every member key (each watch started)."""
        self.num_misses = 0
        """Checks that found the watch behind etcd (it was started again)."""

    @property
    def live(self) -> bool:
        """Whether `fingerprint` answers from the watch (no etcd read)."""
        return self._live

    @property
    def watch_id(self) -> Any:
        """The etcd watch's id (None while none is started)."""
        return self._watch_id

    def fingerprint(self, job_id: str) -> tuple[int, int]:
        """(count, newest mod revision) of the job's member keys: watched while
        `live`, else read from etcd (`StoreUnavailable` from that read)."""
        with self._lock:
            if self._live:
                members = self._jobs.get(job_id)
                return members.fingerprint() if members is not None else (0, 0)
        return self._store.fingerprint(keys.members(job_id))

    def refresh(self) -> None:
        """Starts the watch when it is not live, or checks it when a check is
        due; never raises: a failure leaves it not live (logged) and is
        tried again `RESYNC_S` later (meanwhile `fingerprint` reads etcd)."""
        now = time.monotonic()
        try:
            if not self._live:
                if now >= self._retry_at:  # a failed start is tried again RESYNC_S later
                    self._retry_at = now + RESYNC_S
                    self._start()
            elif now - self._checked_at >= RESYNC_S:
                self._read_check()
        except SpringbackError as e:
            if not self._live:
                log.info("member watch not started (%s); reading members from etcd", e)
            self._drop(f"{e}")
        except Exception as e:  # a bug, or an etcd3 error not translated: fall back, log it
            log.exception("member watch failed")
            self._drop(f"{type(e).__name__}: {e}")

    def stop(self) -> None:
        """Drops the watched values and cancels the watch (a leadership
        change): `fingerprint` reads etcd until `refresh` starts it again."""
        self._drop(None)
        self._retry_at = 0.0  # a new leader starts it at once

    def _drop(self, why: str | None) -> None:
        with self._lock:
            self._lose(why)
            watch_id, self._watch_id = self._watch_id, None
        if watch_id is not None:
            self._store.cancel_watch(watch_id)

    def _lose(self, why: str | None) -> None:
        """Not live from now on, until a full read (lock held)."""
        if why is not None and self._live:
            log.info("member watch: %s; reading members from etcd until it is started again", why)
        self._epoch += 1
        self._live = False
        self._jobs = {}
        self._check = None

    def _start(self) -> None:
        self._drop(None)  # an old watch's events are ignored from here on
        with self._lock:
            epoch = self._epoch  # a `stop` from here on leaves it stopped
        revisions, revision = self._store.revisions(keys.MEMBERS)
        jobs: dict[str, _Members] = {}
        for key, mod_revision in revisions.items():
            jobs.setdefault(keys.member_job_and_id(key)[0], _Members()).put(key, mod_revision)
        with self._lock:
            if self._epoch != epoch:
                return
            self._jobs, self._delivered = jobs, revision  # the watch's events apply from here
        watch_id = self._store.watch_prefix(keys.MEMBERS, functools.partial(self._on_watch, epoch),
                                            start_revision=revision + 1)
        with self._lock:
            if self._epoch == epoch:  # nothing broke or stopped it meanwhile
                self._watch_id, self._live = watch_id, True
                self._checked_at, self._retry_at = time.monotonic(), 0.0
                self.num_rebuilds += 1
                return
        self._store.cancel_watch(watch_id)

    def _read_check(self) -> None:
        count, newest, revision = self._store.fingerprint_at(keys.MEMBERS)
        with self._lock:
            self._checked_at = time.monotonic()
            if not self._live:
                return
            if self._check is not None:  # no event past its revision came in RESYNC_S
                self._compare()
            # A watch that delivered past this read cannot be compared with it: next time.
            fresh = self._live and self._delivered <= revision
            self._check = (count, newest, revision) if fresh else None

    def _compare(self) -> None:
        """The pending check against what the watch delivered up to its revision (lock held)."""
        assert self._check is not None
        watched = (sum(len(m.revisions) for m in self._jobs.values()),
                   max((m.fingerprint()[1] for m in self._jobs.values()), default=0))
        read, self._check = self._check, None
        if watched != read[:2]:
            self.num_misses += 1
            self._lose(f"missed an event (watched {watched}, etcd {read[:2]} "
                       f"at revision {read[2]})")

    def _on_watch(self, epoch: int, response: Any) -> None:
        with self._lock:
            if epoch != self._epoch:
                return  # a watch dropped since
            if not hasattr(response, "events"):  # an error, or None: its stream ended
                self._lose(f"the watch broke ({response})")
                return
            for event in response.events:
                if self._check is not None and event.mod_revision > self._check[2]:
                    self._compare()
                    if epoch != self._epoch:
                        return
                self._delivered = max(self._delivered, event.mod_revision)
                key = event.key.decode()
                job_id = keys.member_job_and_id(key)[0]
                members = self._jobs.setdefault(job_id, _Members())
                if type(event).__name__ == "DeleteEvent":
                    members.delete(key)
                    if not members.revisions:
                        del self._jobs[job_id]  # (0, 0), as for a job never joined
                else:
                    members.put(key, event.mod_revision)
