"""Per-rank training statistics, handed to the node agent for its metrics.

Each rank of a `Session` started by an agent keeps a few numbers about its own
training and writes them, at most once a second and at every generation start,
to ``<control_dir>/stats-<local_rank>.json`` (atomic rename). The agent reads
those files when its Prometheus endpoint is scraped (``springback run
--metrics-listen``), so a scrape costs the ranks nothing.

The numbers, all from this rank process's point of view:

* ``generation``, ``world_size``, ``rank``, ``step``: where it trains now.
* ``steps_total``: steps it completed; ``step_seconds_total``: the time those
  steps took, counted from the previous step's end within one generation (the
  first step of a generation, which includes warm-up, is not counted, nor are
  its seconds).
* ``last_step_seconds``: the latest such step time.
* ``recovery_seconds``: from its last step in an earlier generation to the
  start of the current one (0 until a generation change happened).
* ``recoveries_total``, ``recovery_seconds_sum`` and ``recovery_buckets``
  (cumulative counts of recoveries at most ``RECOVERY_BUCKETS_S[i]``): every
  recovery this rank measured, for the agent's histogram.
* ``checkpoint_stall_seconds``: how long the latest checkpoint blocked
  training (`save()` plus the optimizer step that waited for the copy).
* ``goodput``: ``step_seconds_total`` over the time since `Session()`.
* ``pid``, ``seen_generation`` and ``busy``: for the agent's rank watchdog
  (`worker/agent/watchdog.py`): the newest generation this rank has read from its
  plan channel (written at once when it changes), and what bounded operation
  it is inside, if any (agreeing on the state at a generation start: a
  restore, a state hand-over, a build), during which it reads no plan.

A failed write is ignored: statistics must never stop training.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 1.0
RECOVERY_BUCKETS_S = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
_PREFIX, _SUFFIX = "stats-", ".json"


class RankStats:
    """Rank side: updated by the session, flushed to the control directory."""

    def __init__(self, control_dir: str, local_rank: int) -> None:
        self._path = os.path.join(control_dir, f"{_PREFIX}{local_rank}{_SUFFIX}")
        self._started = time.monotonic()
        self._last_flush = float("-inf")
        self._last_step_end: float | None = None
        self._step_generation = 0
        self.values: dict[str, Any] = {
            "generation": 0, "world_size": 0, "rank": -1, "step": 0, "steps_total": 0,
            "step_seconds_total": 0.0, "last_step_seconds": 0.0, "recovery_seconds": 0.0,
            "checkpoint_stall_seconds": 0.0, "goodput": 0.0, "recoveries_total": 0,
            "recovery_seconds_sum": 0.0, "recovery_buckets": [0] * len(RECOVERY_BUCKETS_S),
            "pid": os.getpid(), "seen_generation": 0, "busy": ""}

    def plan_seen(self, generation: int) -> None:
        """This rank read a plan of `generation`; flushed at once when newer."""
        if generation > self.values["seen_generation"]:
            self.values["seen_generation"] = generation
            self.flush(force=True)

    def busy(self, what: str) -> None:
        """Entering (`what`) or, with "", leaving a bounded operation that reads
        no plan; flushed at once."""
        self.values["busy"] = what
        self.flush(force=True)

    def generation_started(self, *, generation: int, world_size: int, rank: int,
                           step: int) -> None:
        v = self.values
        if self._last_step_end is not None:
            v["recovery_seconds"] = recovery = time.monotonic() - self._last_step_end
            v["recoveries_total"] += 1
            v["recovery_seconds_sum"] += recovery
            v["recovery_buckets"] = [n + (recovery <= bound) for n, bound in
                                     zip(v["recovery_buckets"], RECOVERY_BUCKETS_S)]
        v.update(generation=generation, world_size=world_size, rank=rank, step=step)
        self.flush(force=True)

    def step_done(self, step: int, *, checkpoint_stall_s: float | None = None) -> None:
        now = time.monotonic()
        v = self.values
        if self._last_step_end is not None and self._step_generation == v["generation"]:
            v["last_step_seconds"] = now - self._last_step_end
            v["step_seconds_total"] += v["last_step_seconds"]
        self._last_step_end, self._step_generation = now, v["generation"]
        v["step"] = step
        v["steps_total"] += 1
        if checkpoint_stall_s is not None:
            v["checkpoint_stall_seconds"] = checkpoint_stall_s
        self.flush()

    def flush(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_flush < FLUSH_INTERVAL_S:
            return
        self._last_flush = now
        self.values["goodput"] = self.values["step_seconds_total"] / max(now - self._started, 1e-9)
        tmp = f"{self._path}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.values, f)
            os.replace(tmp, self._path)
        except OSError as e:
            log.debug("writing rank statistics failed: %s", e)


def read_all(control_dir: str) -> dict[int, dict[str, Any]]:
    """Agent side: the latest statistics of every local rank, by local rank."""
    out: dict[int, dict[str, float]] = {}
    for path in Path(control_dir).glob(f"{_PREFIX}*{_SUFFIX}"):
        try:
            local_rank = int(path.name[len(_PREFIX):-len(_SUFFIX)])
            out[local_rank] = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError):
            continue  # not ours, or replaced while reading: the next scrape sees it
    return out
