"""Histogram families of the node agent's Prometheus endpoint.

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

from springback.worker.rankstats import RECOVERY_BUCKETS_S


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
