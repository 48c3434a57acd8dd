"""Serving member liveness only while this replica can reach etcd.

Every replica renews members' leases itself (heartbeats are not forwarded to
the leader), so a replica cut off from etcd must not hold heartbeats: a
heartbeat waiting there on etcd's deadline outlives the agent's own deadline
(about a second) and is lost, and a client that keeps choosing that replica
lets its member expire while the rest of the cluster is healthy.

`EtcdReachability` probes etcd every ``PROBE_INTERVAL_S`` over its own
connection with a short deadline (``PROBE_TIMEOUT_S``). When no probe has
succeeded for ``UNREACHABLE_AFTER_S`` the replica counts as cut off: liveness
calls fail at once with UNAVAILABLE (the client's channel retries them on
another replica) and ``on_change(False)`` runs, which the server turns into
health NOT_SERVING, so clients' channels stop choosing this replica at all.
The first successful probe restores both. Heartbeats themselves use the same
short deadline, so one that meets a freshly cut link fails in time for the
client to retry elsewhere; a failed heartbeat is not evidence of a cut (on a
saturated machine the asyncio loop's lag makes renewals look late while etcd
answers: see `heartbeats`), only the probe, on its own thread, is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from springback.service.etcd import keys
from springback.client.errors import StoreUnavailable
from springback.service.etcd.store import EtcdSecurity, Store

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.25
"""How often etcd is probed (a one-key read)."""
PROBE_TIMEOUT_S = 0.5
"""Deadline of a probe and of a heartbeat's etcd calls: below any client's
heartbeat deadline, so a failure leaves time for a retry on another replica."""
UNREACHABLE_AFTER_S = 1.0
"""No successful probe for this long: the replica stops serving liveness."""


class EtcdReachability:
    """Whether this replica can reach etcd, and the short-deadline store that
    liveness calls use. Thread-safe; `start` once, `close` once."""

    def __init__(self, endpoints: str, *, on_change: Callable[[bool], None] | None = None,
                 security: EtcdSecurity | None = None) -> None:
        self.store = Store(endpoints, timeout_s=PROBE_TIMEOUT_S, security=security)
        self._on_change = on_change
        self._last_ok = time.monotonic()
        self._reachable = True
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-probe", daemon=True)
        self.num_probe_failures = 0

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.store.close()

    @property
    def reachable(self) -> bool:
        return self._reachable

    def require_reachable(self) -> None:
        """Raises `StoreUnavailable` (UNAVAILABLE: retry another replica) when cut off."""
        if not self._reachable:
            raise StoreUnavailable(
                f"this replica has not reached etcd for over {UNREACHABLE_AFTER_S:g} s; "
                "send liveness calls to another replica")

    def _set(self, reachable: bool) -> None:
        with self._lock:
            if reachable == self._reachable:
                return
            self._reachable = reachable
        log.warning("etcd %s: %s liveness calls", "reachable again" if reachable
                    else "unreachable", "serving" if reachable else "refusing")
        if self._on_change is not None:
            self._on_change(reachable)

    def _run(self) -> None:
        while not self._stop.wait(PROBE_INTERVAL_S):
            try:
                self.store.get(keys.LEADER)
                self._last_ok = time.monotonic()
            except StoreUnavailable as e:
                self.num_probe_failures += 1
                log.debug("etcd probe failed: %s", e)
            self._set(time.monotonic() - self._last_ok < UNREACHABLE_AFTER_S)
