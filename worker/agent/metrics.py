"""The node agent's Prometheus endpoint: its plan, failures and the ranks'
statistics (`node_registry`), and the ranks' recovery histograms.

The ranks count their own recoveries in their statistics files
(`rankstats.py`: cumulative bucket counts, sum and count); this collector turns
them into one ``springback_rank_recovery_duration_seconds`` histogram per
local rank at scrape time. A rank process that was replaced starts counting
from zero again (its counters reset, as Prometheus expects of a restart).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from springback.client.metrics import Registry
from springback.v1 import types_pb2 as pb
from springback.worker.control import PlanPublisher
from springback.worker.rankstats import RECOVERY_BUCKETS_S
from springback.worker.rankstats import read_all as read_rank_stats


RANK_METRICS = [
    ("generation", "springback_rank_generation", "gauge", "Generation the rank trains in."),
    ("step", "springback_rank_step", "gauge", "Last step the rank completed."),
    ("steps_total", "springback_rank_steps_total", "counter",
     "Steps this rank process completed."),
    ("step_seconds_total", "springback_rank_step_seconds_total", "counter",
     "Time those steps took (first step of each generation not counted)."),
    ("last_step_seconds", "springback_rank_last_step_seconds", "gauge",
     "Duration of the latest step."),
    ("recovery_seconds", "springback_rank_recovery_seconds", "gauge",
     "From the rank's last step in an earlier generation to the start of the current one."),
    ("checkpoint_stall_seconds", "springback_rank_checkpoint_stall_seconds", "gauge",
     "How long the latest checkpoint blocked training."),
    ("goodput", "springback_rank_goodput_ratio", "gauge",
     "Time in steps over time since the rank's Session started."),
]
"""The per-rank series of the node's endpoint: (rankstats key, metric, kind, help)."""


class RankRecoveries(Collector):
    def __init__(self, read_stats: Callable[[], dict[int, dict[str, Any]]]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "springback_rank_recovery_duration_seconds",
            "Recoveries this rank lived through: from its last step in one generation "
            "to the start of the next.", labels=["local_rank"])
        for local_rank, stats in sorted(self._read_stats().items()):
            counts = stats.get("recovery_buckets")
            if not counts or len(counts) != len(RECOVERY_BUCKETS_S):
                continue  # written by a rank of another version
            buckets = [(str(b), n) for b, n in zip(RECOVERY_BUCKETS_S, counts)]
            buckets.append(("+Inf", stats["recoveries_total"]))
            family.add_metric([str(local_rank)], buckets, stats["recovery_seconds_sum"])
        yield family


def node_registry(plan_of: Callable[[], pb.Plan | None], failures_of: Callable[[], int],
                  publisher_of: Callable[[], PlanPublisher | None]) -> Registry:
    """This node's view: its newest plan, its rank failures, and the
    statistics each local rank wrote last (labelled by local_rank)."""
    registry = Registry()

    def plan_field(name: str) -> float:
        plan = plan_of()
        return getattr(plan, name) if plan is not None else 0

    registry.add("springback_agent_generation", "gauge",
                 "Generation of the newest plan this node received.",
                 lambda: plan_field("generation"))
    registry.add("springback_agent_world_size", "gauge", "World size of that plan.",
                 lambda: plan_field("world_size"))
    registry.add("springback_agent_rank_failures_total", "counter",
                 "Local ranks that exited with an error.", failures_of)

    def per_rank(key: str) -> Callable[[], list]:
        def collect() -> list:
            stats = stats_now()
            return [({"local_rank": str(lr)}, float(v[key]))
                    for lr, v in sorted(stats.items()) if key in v]
        return collect

    def stats_now() -> dict[int, dict[str, Any]]:
        publisher = publisher_of()
        return read_rank_stats(publisher.directory) if publisher is not None else {}

    for key, name, kind, help_text in RANK_METRICS:
        registry.add(name, kind, help_text, per_rank(key))
    registry.add_collector(RankRecoveries(stats_now))
    return registry

