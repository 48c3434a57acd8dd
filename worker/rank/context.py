"""What a rank's generations share with their `Session`, as one explicit object.

A `Session` owns one `RankContext` for the life of the rank process and hands
it to every `Generation` it yields: the registered state and how far it got
(what it holds: `HeldState`, `worker/rank/heldstate.py`; whether the job
finished), and the links to the agent (plan channel, rank statistics)
and to the coordinator (step reporter). Nothing else crosses between a
Session and its generations.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from springback.v1 import types_pb2 as pb
from springback.worker.control import PlanChannel
from springback.client.env import RankEnv
from springback.worker.rank.heldstate import HeldState
from springback.worker.rank.rngstate import RngState
from springback.worker.rankstats import RankStats

DEFAULT_PLAN_WAIT_S = 300.0
"""The plan wait when neither the job (failures.plan_wait_s) nor Session sets one."""


@dataclass
class RankContext:
    """One rank's shared state and links (see the module docstring)."""

    env: RankEnv
    state: dict[str, Any]
    """The registered objects (model, optimizer, other ``state=`` entries)."""
    device: torch.device
    channel: PlanChannel | None = None
    """The agent's plans; None in a standalone run."""
    stats: RankStats | None = None
    reporter: Any = None
    """The coordinator's StepReporter; None without a coordinator."""
    standalone_plan: pb.Plan | None = None
    held: HeldState = field(default_factory=HeldState)
    """What `state` holds (step, clean boundary, RNG state) and the rules that
    change it (`worker/rank/heldstate.py`); read through the properties below."""
    finished: bool = False
    final: Callable[[], None] | None = None
    """After max_steps: re-sends the final step report (rank 0) until a plan comes."""
    last_loss: float = float("nan")
    wait_s: float = DEFAULT_PLAN_WAIT_S
    """The plan wait: the job's failures.plan_wait_s unless Session overrides it."""

    @property
    def state_step(self) -> int:
        """Step the in-memory state holds; -1: none yet (read-only: `held`)."""
        return self.held.state_step

    @property
    def step(self) -> int:
        """Last step whose update the in-memory state holds (0 before training)."""
        return self.held.step

    @property
    def clean(self) -> bool:
        """The last generation ended at an agreed step boundary (read-only: `held`)."""
        return self.held.clean

    @property
    def rng(self) -> RngState | None:
        """The RNG state at the boundary after `state_step` (`worker/rank/rngstate.py`);
        None before the first step (read-only: `held`)."""
        return self.held.rng

    def latest(self) -> pb.Plan | None:
        """The newest plan the agent published (the standalone plan without one)."""
        if self.channel is None:
            return self.standalone_plan
        plan = self.channel.latest()
        if plan is not None and self.stats is not None:
            self.stats.plan_seen(plan.generation)  # this rank answers (worker/agent/watchdog.py)
        return plan

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """Marks a bounded operation that reads no plan (its own deadlines end
        it), so the agent's rank watchdog does not take the silence for a
        hang (worker/agent/watchdog.py)."""
        if self.stats is not None:
            self.stats.busy(what)
        try:
            yield
        finally:
            if self.stats is not None:
                self.stats.busy("")

    def newer_plan_within(self, generation: int, timeout_s: float, broken: str = "", *,
                          storage_unavailable: bool = False,
                          first_ask_s: float | None = None) -> bool:
        """Waits until any plan (of whatever action) newer than `generation`
        was published; False when `timeout_s` passed first.

        With `broken` (why this rank's generation broke) and a coordinator,
        a plan that has not come within one collective timeout (the agent
        sets it to the liveness timeout: long enough for a dead peer to
        expire), or within `first_ask_s` when given, is asked for: the rank
        reports the broken generation with its state kept (and
        `storage_unavailable` when the store refused its start), and again
        every collective timeout while it waits, so a break without a
        membership change (a reset link, a peer's transient error, a store
        that came back) is replanned instead of waiting out the whole plan
        wait."""
        start = time.monotonic()
        deadline = start + timeout_s
        ask_every = max(self.env.collective_timeout_s, 1.0)
        next_ask = start + (ask_every if first_ask_s is None else first_ask_s)
        while (latest := self.latest()) is None or latest.generation <= generation:
            now = time.monotonic()
            if now >= deadline:
                return False
            if broken and self.reporter is not None and now >= next_ask:
                self.reporter.report_broken(generation, broken,
                                            storage_unavailable=storage_unavailable)
                next_ask = time.monotonic() + ask_every
            time.sleep(0.02)
        return True
