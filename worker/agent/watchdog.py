"""The agent's rank watchdog: a local rank that stopped answering is killed,
so the job recovers as from a crash instead of failing.

A rank hung in the user's code (a deadlock, an endless loop, a stuck
kernel) while its agent is healthy is invisible to the coordinator: the
member heartbeats, its plan stream is open. Its peers' collectives time out,
they report the generation broken, and the coordinator makes it again with
the same members — which the hung rank never joins. Without a watchdog the
job would go round that loop until `failures.max_per_step` failed it.

The signal is the plan channel. A `Session` rank reads the agent's plan file
at every step boundary and while it waits (rendezvous, the next plan), and
notes the newest generation it read in its statistics file
(`rankstats`: ``seen_generation``, flushed at once). A rank is **hung** when
a plan newer than any it has read was published more than the *answer
deadline* ago, and the rank is not inside a bounded operation it declared
(``busy``: agreeing on the state at a generation start — a restore, a state
hand-over, a build — whose collectives and storage calls have deadlines of
their own). The answer deadline is

    2 x collective timeout + 2 x the rank's last step time + `GRACE_S`

A healthy rank always answers within it: a rank blocked in a collective with
a hung peer gets its error within one collective timeout, then reads the
plan; one in the middle of a long step reads it at the step's end. The agent
then SIGKILLs the hung rank and reports it like any crashed rank, with the
reason; a warm standby takes its place and the state comes from the
survivors (nothing lost, at most the step in flight redone).

Limits: ranks that do not use `Session` (restart mode, torchrun-style
scripts) write no statistics and are not watched; a rank that has not reached
`Session()` yet (importing, building) is not watched either (its peers'
rendezvous deadline applies), nor one whose `generations()` loop has ended
(what its script does after training reads no plan). A statistics file left by an earlier process of
the same local rank is recognised by its pid and ignored.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from springback.worker import rankstats

GRACE_S = 5.0
"""Slack on top of the answer deadline: scheduling noise, a slow file system."""


class RankWatchdog:
    """Agent side: which local ranks have not answered the newest plan in time."""

    def __init__(self, control_dir: str, collective_timeout_s: float) -> None:
        self.control_dir = control_dir
        self.collective_timeout_s = collective_timeout_s
        self._latest = (0, 0.0)  # (generation, when published): one object, read once
        self._answered: tuple[int, set[tuple[int, int]]] = (0, set())
        """(generation, the (local rank, pid) that have read its plan): those
        need no look at their statistics until a newer plan is published."""

    def published(self, generation: int) -> None:
        """The agent published the plan of `generation` to its ranks (called on
        the plan-stream thread while `hung` may run on the agent's loop)."""
        if generation > self._latest[0]:
            self._latest = (generation, time.monotonic())

    def hung(self, ranks: Iterable[tuple[int, int]]) -> list[tuple[int, str]]:
        """Of the running ranks given as (local rank, pid), those that are hung
        (see the module docstring), each with the reason to report.

        Reads the ranks' statistics files only while some rank has not been
        seen to read the newest plan (the agent asks every 50 ms)."""
        generation, published_at = self._latest  # a plan published meanwhile waits its turn
        if not generation:
            return []
        waited = time.monotonic() - published_at
        if waited <= 2 * self.collective_timeout_s + GRACE_S:
            return []  # nobody can be late yet: skip reading the files
        if self._answered[0] != generation:
            self._answered = (generation, set())
        answered = self._answered[1]
        ranks = [r for r in ranks if r not in answered]
        if not ranks:
            return []  # every rank has read the newest plan: nothing to read
        stats = rankstats.read_all(self.control_dir)
        out = []
        for local_rank, pid in ranks:
            s = stats.get(local_rank)
            if s is None or s.get("pid") != pid or s.get("busy"):
                continue
            seen = int(s.get("seen_generation", 0))
            if seen >= generation:
                answered.add((local_rank, pid))
                continue
            deadline = (2 * self.collective_timeout_s + 2 * float(s.get("last_step_seconds", 0))
                        + GRACE_S)
            if waited > deadline:
                out.append((local_rank, (
                    f"local rank {local_rank} (pid {pid}) is hung: it has not read the plan of "
                    f"generation {generation} within {waited:.1f}s of its publication "
                    f"(answer deadline {deadline:.1f}s; last read generation {seen})")))
        return out
