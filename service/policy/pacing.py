"""Paced liveness: the heartbeat interval a replica tells its members.

Each replica serves the heartbeats that reach it (`heartbeats`) and paces them
on its own: with ``n`` distinct members heartbeating here within the last
liveness timeout and a budget of ``budget_per_s`` heartbeats per second, the
interval is

    clamp(n / budget_per_s, liveness / 4, liveness / 2)

so the replica's heartbeat rate ``n / interval`` stays within the budget while
the interval allows it. The floor (a quarter of the timeout) is the cadence
of a small job: three heartbeats may be lost before a lease expires. The cap
(half the timeout) keeps one lost heartbeat survivable; past it the budget
is exceeded (`over_budget`) rather than the timeout risked, and the remedy is
another replica or a longer liveness timeout (docs/scale.md, "Paced
liveness").

Detection is not slowed by pacing: a hung node's lease expires one liveness
timeout after its last renewal, i.e. between ``liveness - interval`` and
``liveness`` after it hung. What pacing spends is margin: at the cap, a
heartbeat more than half the timeout late expires a live member.

Failure semantics: none; the pacer is memory only. A replica that restarts
starts from the floor and grows back as members heartbeat to it; the members
follow the newest interval any replica told them.
"""

from __future__ import annotations

DEFAULT_BUDGET_PER_S = 2000.0
_PRUNE_EVERY_S = 1.0


class HeartbeatPacer:
    """Counts the members heartbeating to this replica and names their interval;
    loop-only (no lock)."""

    def __init__(self, liveness_timeout_s: float,
                 budget_per_s: float = DEFAULT_BUDGET_PER_S) -> None:
        if budget_per_s <= 0:
            raise ValueError(f"heartbeat_budget_per_s: {budget_per_s} must be positive")
        self.liveness_timeout_s = liveness_timeout_s
        self.budget_per_s = budget_per_s
        self._last_seen: dict[str, float] = {}  # member id -> time of its newest heartbeat
        self._pruned_at = 0.0

    def seen(self, member_id: str, now: float) -> None:
        """One heartbeat of `member_id` at `now` (a monotonic clock, seconds)."""
        self._last_seen[member_id] = now
        if now - self._pruned_at >= _PRUNE_EVERY_S:
            oldest = now - self.liveness_timeout_s
            self._last_seen = {m: t for m, t in self._last_seen.items() if t >= oldest}
            self._pruned_at = now

    @property
    def num_members(self) -> int:
        """Members that heartbeat here within the last liveness timeout (up to
        a second stale)."""
        return len(self._last_seen)

    def interval_s(self) -> float:
        """The interval to tell a member now (module docstring)."""
        floor, cap = self.liveness_timeout_s / 4, self.liveness_timeout_s / 2
        return min(max(self.num_members / self.budget_per_s, floor), cap)

    def over_budget(self) -> bool:
        """Whether even the cap's interval exceeds the budget."""
        return self.num_members / (self.liveness_timeout_s / 2) > self.budget_per_s
