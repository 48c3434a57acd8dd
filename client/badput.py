"""Badput by cause and cost per useful step, from a job's generation events.

Pure functions of `springback.v1` messages (no I/O; nothing raised for
well-formed messages), shared by `job get`, `job events` and the
coordinator's metrics.

The job's wall time, from its first generation's creation to its end (or
`now`), is split generation by generation; each generation owns the time
from its creation to the next one's. Every second lands in exactly one cause,
so the causes sum to the wall time (no "other" bucket):

* ``waiting``: a WAIT generation (PENDING: too few members; PAUSED).
* For a RUN generation, from its creation to its start report (rank 0's word
  that the ranks agreed on the state): ``state_transfer`` (rank 0's measured
  agreement and transfer: hand-over, reshard, peer-copy roll-back, restore),
  ``reforming`` (rank 0's measured rendezvous of the group), ``startup``
  (rank 0's measured process start, imports and build, for a new process),
  and the rest (the plan reaching the ranks, the old generation's last
  step): ``reforming``; in the job's first RUN generation the rendezvous and
  the rest are ``startup``.
* From the start report to the end of training: ``checkpoint`` (rank 0's
  checkpoint stalls, summed), ``redone`` (the steps redone after a rewind
  times the measured step time), and ``useful`` (the rest).
* ``detection``: when the next generation was made for a failure (a node
  lost, a rank failure), from this generation's last step report to the
  next one's creation: the time the failure went unnoticed.

`change_costs` splits what each kill and each join cost the survivors into
detection, reforming, build, fill, first step and redone (these causes,
renamed, and the first step's time beyond the median step), for the goodput
bench's breakdown.

Limits: times are taken where the leader received reports (step reports
come at most every 0.25 s, so detection may include up to that much
training); rank spans are clipped to the window they belong to; a span the
ranks did not report (an older rank) falls to the window's rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

CAUSES = ("useful", "startup", "detection", "reforming", "state_transfer", "redone",
          "checkpoint", "waiting")
"""Every cause, in the order shown."""

_FAILURES = (js.CHANGE_KIND_NODE_LOST, js.CHANGE_KIND_RANK_FAILURE)


def _t(ts: Any) -> float | None:
    return ts.ToNanoseconds() / 1e9 if ts.seconds or ts.nanos else None


def _job_end(job: pb.Job, events: Sequence[js.GenerationEvent], now: float) -> float:
    last = _t(events[-1].created_at) or now
    finished = _t(job.finished_at)
    return max(finished if finished is not None else now, last)


def generation_causes(event: js.GenerationEvent, end_s: float, *, first_run: bool,
                      next_kind: int | None) -> dict[str, float]:
    """Seconds by cause of `event`'s generation, which lasted until `end_s`;
    `first_run`: the job's first RUN generation; `next_kind`: the next
    generation's `ChangeKind` (None: this is the newest)."""
    out = dict.fromkeys(CAUSES, 0.0)
    created = _t(event.created_at) or end_s
    window = max(end_s - created, 0.0)
    if event.action != pb.PLAN_ACTION_RUN:
        out["waiting"] = window
        return out
    started = _t(event.started_at)
    if started is None:
        started = _t(event.first_step_at)
    pre = window if started is None else min(max(started - created, 0.0), window)
    forming = "startup" if first_run else "reforming"
    out["state_transfer"] = min(event.transfer_s, pre)
    out[forming] = min(event.rendezvous_s, pre - out["state_transfer"])
    out["startup"] += min(event.startup_s, pre - out["state_transfer"] - out[forming])
    out[forming] += pre - out["state_transfer"] - out["reforming"] - out["startup"]
    begin = created + pre
    train_end = end_s
    last = _t(event.last_step_at)
    if next_kind in _FAILURES:
        train_end = min(max(last if last is not None else begin, begin), end_s)
        out["detection"] = end_s - train_end
    steps = max(train_end - begin, 0.0)
    out["checkpoint"] = min(event.checkpoint_stall_s, steps)
    out["redone"] = min(event.steps_redone * event.step_s, steps - out["checkpoint"])
    out["useful"] = steps - out["checkpoint"] - out["redone"]
    return out


def per_generation(job: pb.Job, events: Sequence[js.GenerationEvent],
                   now: float) -> list[tuple[js.GenerationEvent, float, dict[str, float]]]:
    """(event, its wall seconds, its causes) of every generation, oldest first."""
    if not events:
        return []
    end = _job_end(job, events, now)
    out = []
    seen_run = False
    for i, event in enumerate(events):
        nxt = events[i + 1] if i + 1 < len(events) else None
        until = (_t(nxt.created_at) or end) if nxt is not None else end
        first_run = event.action == pb.PLAN_ACTION_RUN and not seen_run
        seen_run = seen_run or event.action == pb.PLAN_ACTION_RUN
        causes = generation_causes(event, until, first_run=first_run,
                                   next_kind=nxt.kind if nxt is not None else None)
        out.append((event, max(until - (_t(event.created_at) or until), 0.0), causes))
    return out


def job_badput(job: pb.Job, events: Sequence[js.GenerationEvent], now: float) -> dict[str, Any]:
    """``{"wall_s", "causes": {cause: s}, "useful_ratio"}`` of the whole job,
    and its cost (`cost`) when the spec names a price."""
    rows = per_generation(job, events, now)
    causes = dict.fromkeys(CAUSES, 0.0)
    for _, _, c in rows:
        for k, v in c.items():
            causes[k] += v
    wall = sum(w for _, w, _ in rows)
    out: dict[str, Any] = {"wall_s": wall, "causes": causes,
                           "useful_ratio": causes["useful"] / wall if wall > 0 else None}
    out["cost"] = cost(job, rows)
    return out


def cost(job: pb.Job, rows: Sequence[tuple[js.GenerationEvent, float, dict[str, float]]]
         ) -> dict[str, Any]:
    """Node-hours of the job (active members and hot spares apart), the
    useful ones (useful seconds x the generation's members), and, with
    ``spec.price_per_node_hour``, the money: in all, per useful step (the
    job's step) and per 1,000 samples consumed (None where nothing was
    done yet). Spares are as the generation was planned (a later spares-only
    change is not seen)."""
    active = sum(w * len(e.members) for e, w, _ in rows) / 3600
    spares = sum(w * len(e.spares) for e, w, _ in rows) / 3600
    useful = sum(c["useful"] * len(e.members) for e, _, c in rows) / 3600
    price = job.spec.price_per_node_hour
    out: dict[str, Any] = {"node_hours": active + spares, "node_hours_active": active,
                           "node_hours_spares": spares, "node_hours_useful": useful,
                           "price_per_node_hour": price or None}
    total = (active + spares) * price if price else None
    out["cost"] = total
    steps, samples = job.status.step, job.status.samples_consumed
    out["cost_per_useful_step"] = total / steps if total is not None and steps else None
    out["cost_per_1000_samples"] = (total / samples * 1000 if total is not None and samples
                                    else None)
    return out


KILLS = _FAILURES
"""The change kinds of a kill: a node lost, a rank failure."""

CHANGE_COLUMNS = ("detection", "waiting", "reforming", "build", "fill", "first_step", "redone")
"""The columns of a change's cost (`ChangeCost`), in the order shown."""


@dataclass(frozen=True)
class ChangeCost:
    """What one kill or join cost the job's survivors, in seconds (see
    `change_costs`)."""

    generation: int
    kind: str
    """"kill" or "join"."""
    change_kind: int
    at_s: float
    """The generation's creation, in seconds after the job's first generation."""
    waits: bool
    """A WAIT generation (too few members: a kill that left fewer than min_workers)."""
    started: bool
    """The generation's ranks reported a first step (False: it waited, or was
    replaced first)."""
    detection: float
    waiting: float
    reforming: float
    build: float
    fill: float
    first_step: float | None
    """None: not measured (see `change_costs`)."""
    redone: float
    steps_redone: int
    step_gap_s: float | None = None
    """The survivors' pause around the change: the previous generation's last
    step report to this generation's first (None when either is missing).
    Both where the leader received them: step reports wait up to 0.25 s."""
    median_step_s: float | None = None
    """The previous generation's median step (rank 0's p50, else the leader's
    step time; None when neither is known)."""

    @property
    def total(self) -> float:
        return sum(v for k in CHANGE_COLUMNS if (v := getattr(self, k)) is not None)

    @property
    def gap_ratio(self) -> float | None:
        """`step_gap_s` in median steps (issue 47's join target: at most 1.5)."""
        if self.step_gap_s is None or not self.median_step_s:
            return None
        return self.step_gap_s / self.median_step_s


def change_costs(job: pb.Job, events: Sequence[js.GenerationEvent],
                 now: float) -> list[ChangeCost]:
    """Every generation made by a kill (`KILLS`) or a join, oldest first, with
    the time it cost the survivors split by where it went; every column but
    ``first_step`` is a cause of `generation_causes` (via `per_generation`),
    renamed (the total is every column but ``first_step``'s None):

    * ``detection``: the previous generation's ``detection`` (its last step
      report to this generation's creation: the failure unnoticed); 0 for a
      join.
    * ``waiting``: its ``waiting`` (a WAIT generation: the kill left fewer
      than ``min_workers``; the survivors wait for a join, whose own
      generation is the next row).
    * ``reforming``: this generation's ``reforming`` (rank 0's rendezvous,
      the plan reaching the ranks, the old generation's last step; a
      joiner's process start while rank 0 waits for it at the rendezvous is
      here too).
    * ``build``: its ``startup`` (rank 0's process start, imports and model
      build: a new rank 0 only).
    * ``fill``: its ``state_transfer`` (agreeing on and moving the state).
    * ``redone``: its ``redone`` (steps trained again x the step time);
      ``steps_redone``: how many.
    * ``step_gap_s`` (not a column of the total): the survivors' longest
      pause, the last step report of the newest earlier generation that
      stepped to this one's first, and ``median_step_s`` that generation's
      median step, to read it against (`ChangeCost.gap_ratio`).
    * ``first_step``: the generation's first step beyond its median step:
      from the start report to the first step report (both where the leader
      received them) less rank 0's step p50 (``step_s`` when no p50 came),
      at least 0 and at most its ``useful`` (where `generation_causes` counts
      it). None when it cannot be measured: the generation never reported a
      first step, no start report came (``started_at`` is then the first
      step's), or no step time is known. Step reports wait at most 0.25 s
      after the previous one, so a first step faster than that after the
      previous generation's last report reads up to that much long.

    The job's first RUN generation has no survivors and is not a change;
    other kinds (drain, leave, operator, control, a generation made again)
    are not listed."""
    rows = per_generation(job, events, now)
    if not rows:
        return []
    origin = _t(rows[0][0].created_at) or now
    out = []
    seen_run = False
    for i, (event, _, causes) in enumerate(rows):
        first_run = event.action == pb.PLAN_ACTION_RUN and not seen_run
        seen_run = seen_run or event.action == pb.PLAN_ACTION_RUN
        kind = ("kill" if event.kind in KILLS else "join" if event.kind == js.CHANGE_KIND_JOIN
                else None)
        if kind is None or first_run:
            continue
        out.append(ChangeCost(
            generation=event.generation, kind=kind, change_kind=event.kind,
            at_s=(_t(event.created_at) or origin) - origin,
            waits=event.action == pb.PLAN_ACTION_WAIT,
            started=_t(event.first_step_at) is not None,
            detection=rows[i - 1][2]["detection"] if i else 0.0, waiting=causes["waiting"],
            reforming=causes["reforming"], build=causes["startup"],
            fill=causes["state_transfer"], first_step=_first_step_excess(event, causes),
            redone=causes["redone"], steps_redone=event.steps_redone,
            **_step_gap([r[0] for r in rows[:i]], event)))
    return out


def _step_gap(earlier: Sequence[js.GenerationEvent], event: js.GenerationEvent
              ) -> dict[str, float | None]:
    """`ChangeCost.step_gap_s` and ``median_step_s`` of `event`, against the
    newest earlier generation that stepped (a WAIT generation in between
    did not)."""
    ran = next((e for e in reversed(earlier) if _t(e.last_step_at) is not None), None)
    if ran is None:
        return {"step_gap_s": None, "median_step_s": None}
    first, last = _t(event.first_step_at), _t(ran.last_step_at)
    assert last is not None
    return {"step_gap_s": first - last if first is not None and first >= last else None,
            "median_step_s": ran.step_p50_s or ran.step_s or None}


def _first_step_excess(event: js.GenerationEvent, causes: dict[str, float]) -> float | None:
    started, first = _t(event.started_at), _t(event.first_step_at)
    median = event.step_p50_s or event.step_s
    if started is None or first is None or first <= started or median <= 0:
        return None
    return min(max(first - started - median, 0.0), causes["useful"])


def change_summary(costs: Sequence[ChangeCost]) -> dict[str, dict[str, Any]]:
    """Per kind ("kill", "join"; a kind with no change is absent): ``count``,
    ``total`` and ``mean`` (each a dict of `CHANGE_COLUMNS` and ``total``,
    seconds; ``first_step`` over the changes that measured it, None when
    none did), ``steps_redone`` and ``first_step_measured`` (how many)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in ("kill", "join"):
        mine = [c for c in costs if c.kind == kind]
        if not mine:
            continue
        total: dict[str, Any] = {}
        mean: dict[str, Any] = {}
        for col in (*CHANGE_COLUMNS, "total"):
            values = [v for c in mine if (v := getattr(c, col)) is not None]
            total[col] = sum(values) if values else None
            mean[col] = sum(values) / len(values) if values else None
        out[kind] = {"count": len(mine), "total": total, "mean": mean,
                     "steps_redone": sum(c.steps_redone for c in mine),
                     "first_step_measured": sum(c.first_step is not None for c in mine)}
    return out
