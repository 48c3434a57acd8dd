"""Per-job Prometheus metrics of the coordinator, from job records and history.

Collected at scrape time on the leader (other replicas export none, so a
Prometheus scraping every replica sees each job once): one read of the job
records and one of each job's history (`service/core/history.py`) per scrape.
Counters (recoveries, failures, restores, steps redone) are derived from the
history in etcd, so they survive leader changes and never go backwards while
the job exists. Badput by cause (`client.badput`) is derived the same way,
with one exception: the running generation's tail counts as useful until a
failure ends it, and then moves to ``detection`` (the useful counter may
step back by that tail, at most the step-report interval plus the failure
detection time).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
)
from prometheus_client.registry import Collector

from springback.client import badput
from springback.service.core.coordinator import Coordinator
from springback.service.core.history import FAILURE_KINDS
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

RECOVERY_BUCKETS_S = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)


def recovery_times(events: list[js.GenerationEvent]) -> list[float]:
    """Recovery time of every generation after the job's first training one
    (that one is start-up, not recovery)."""
    runs = [e for e in events if e.HasField("recovery")]
    return [e.recovery.ToNanoseconds() / 1e9 for e in runs[1:]]


def goodput(job: pb.Job, events: list[js.GenerationEvent], now: float) -> float | None:
    """Share of the wall time since the first step (until the job finished,
    or now) not spent recovering; None before the first step."""
    firsts = [e.first_step_at.ToNanoseconds() / 1e9 for e in events if e.HasField("first_step_at")]
    if not firsts:
        return None
    end = job.finished_at.ToNanoseconds() / 1e9 if job.finished_at.seconds else now
    elapsed = end - firsts[0]
    if elapsed <= 0:
        return None
    return max(0.0, 1.0 - sum(recovery_times(events)) / elapsed)


class JobMetrics(Collector):
    """The `springback_job_*` families (see docs/worker.md, "Metrics")."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    def collect(self) -> Iterator[Metric]:
        c = self._coordinator
        jobs = c.list_jobs() if c.election.is_leader() else []
        now = time.time()
        gauges = {name: GaugeMetricFamily(f"springback_job_{name}", text, labels=["job"])
                  for name, text in (
                      ("generation", "Current generation."),
                      ("world_size", "Ranks in the current plan."),
                      ("step", "Last completed step."),
                      ("loss", "Loss of the last reported step."),
                      ("samples_consumed", "Samples consumed over all epochs."),
                      ("running", "1 while the job trains."),
                      ("checkpoint_step", "Step of the newest committed checkpoint."),
                      ("checkpoint_age_seconds", "Time since the newest checkpoint was committed."),
                      ("goodput_ratio",
                       "Share of the time since the first step not spent recovering."),
                      ("storage_unavailable_seconds",
                       "How long the job has waited for its store (0: not waiting)."))}
        counters = {name: CounterMetricFamily(f"springback_job_{name}", text, labels=labels)
                    for name, text, labels in (
                        ("generations", "Generations made.", ["job"]),
                        ("restores", "Generations that restored a committed checkpoint.", ["job"]),
                        ("steps_redone", "Steps trained again after a restore.", ["job"]),
                        ("store_intrusions", "Generations whose rank 0 found keys under the "
                         "rendezvous store's guessable names (an outsider tried to enter: "
                         "docs/security.md).", ["job"]),
                        ("failures", "Generations made because of a failure, by kind.",
                         ["job", "kind"]),
                        ("badput_seconds", "Wall time by cause (client/badput.py; useful "
                         "included): the causes sum to the job's wall time.", ["job", "cause"]),
                        ("node_hours", "Node-hours held, by kind (active, spares, useful).",
                         ["job", "kind"]))}
        gauges["cost_per_useful_step"] = GaugeMetricFamily(
            "springback_job_cost_per_useful_step",
            "Cost (spec.price_per_node_hour x node-hours, spares included) per useful step.",
            labels=["job"])
        step_times = GaugeMetricFamily(
            "springback_job_step_seconds",
            "Rank 0's step time in the newest generation that reported one "
            "(worker/train/steptimes.py: its last 1,024 steps), by quantile.",
            labels=["job", "quantile"])
        member_timing = GaugeMetricFamily(
            "springback_job_member_step_seconds",
            "Per member, the median over its last steps (worker/train/ranktiming.py) of its "
            "compute before the step's collective (part=compute) and of its time in the "
            "collectives (part=collective); the current generation's.",
            labels=["job", "member", "part"])
        recoveries = HistogramMetricFamily(
            "springback_job_recovery_seconds",
            "From the last step before a generation to its first step (start-up excluded).",
            labels=["job"])
        for job in jobs:
            s, label = job.status, [job.id]
            events = c.history.events(job.id)
            for name, value in (("generation", s.generation), ("world_size", s.world_size),
                                ("step", s.step), ("loss", s.loss),
                                ("samples_consumed", s.samples_consumed),
                                ("running", float(s.state == pb.JOB_STATE_RUNNING))):
                gauges[name].add_metric(label, value)
            waited = (max(now - s.storage_unavailable_since.ToNanoseconds() / 1e9, 0.0)
                      if s.HasField("storage_unavailable_since") else 0.0)
            gauges["storage_unavailable_seconds"].add_metric(label, waited)
            if s.last_checkpoint.step:
                gauges["checkpoint_step"].add_metric(label, s.last_checkpoint.step)
                committed = s.last_checkpoint.committed_at.ToNanoseconds() / 1e9
                gauges["checkpoint_age_seconds"].add_metric(label, max(now - committed, 0.0))
            ratio = goodput(job, events, now)
            if ratio is not None:
                gauges["goodput_ratio"].add_metric(label, ratio)
            counters["generations"].add_metric(label, len(events))
            counters["restores"].add_metric(
                label, sum(e.restore == pb.RESTORE_KIND_CHECKPOINT for e in events))
            counters["steps_redone"].add_metric(label, sum(e.steps_redone for e in events))
            counters["store_intrusions"].add_metric(label, s.num_store_intrusions)
            for kind, kind_name in FAILURE_KINDS.items():
                counters["failures"].add_metric(
                    [job.id, kind_name], sum(e.kind == kind for e in events))
            total = badput.job_badput(job, events, now)
            for cause, seconds in total["causes"].items():
                counters["badput_seconds"].add_metric([job.id, cause], seconds)
            for held in ("active", "spares", "useful"):
                counters["node_hours"].add_metric([job.id, held],
                                                  total["cost"][f"node_hours_{held}"])
            if total["cost"]["cost_per_useful_step"] is not None:
                gauges["cost_per_useful_step"].add_metric(label,
                                                          total["cost"]["cost_per_useful_step"])
            timed = next((e for e in reversed(events) if e.step_p50_s), None)
            if timed is not None:
                for q, value in (("0.5", timed.step_p50_s), ("0.9", timed.step_p90_s),
                                 ("0.99", timed.step_p99_s)):
                    step_times.add_metric([job.id, q], value)
            for t in s.member_timing:
                member_timing.add_metric([job.id, t.member_id, "compute"], t.compute_p50_s)
                member_timing.add_metric([job.id, t.member_id, "collective"],
                                         t.collective_p50_s)
            times = recovery_times(events)
            buckets = [(str(b), sum(t <= b for t in times)) for b in RECOVERY_BUCKETS_S]
            recoveries.add_metric(label, buckets + [("+Inf", len(times))], sum(times))
        yield from gauges.values()
        yield from counters.values()
        yield step_times
        yield member_timing
        yield recoveries
