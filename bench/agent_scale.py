"""Agents at scale: N simulated agents in several client processes against etcd + 2 replicas.

Each client process drives N/P members (`tests/agentsim.SimFleet`: JoinJob,
a WatchPlans stream, heartbeats every liveness/4) on one asyncio loop. Prints,
for each N: time from the first join to one plan holding all N, join p50/p99,
heartbeat p50/p99, false expiries, generations made during the storm,
coordinator CPU seconds and memory per 1k agents, etcd writes per second in
steady state (raft index delta), and the load average. The client processes
share the machine with the coordinators: their CPU is reported apart.

Usage: python bench/agent_scale.py [--agents 1000,3000,10000] [--clients 4] [--steady-s 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from agentsim import SimFleet  # noqa: E402
from sbtest import CoordinatorProcess  # noqa: E402
from springback.client.api import Client  # noqa: E402
from springback.cli.local import EtcdServer  # noqa: E402
from springback.service.store import Store  # noqa: E402


def _client(addresses: list[str], job_id: str, n: int, total: int, settle_s: float,
            steady_s: float, out: mp.Queue) -> None:
    fleet = SimFleet(addresses, job_id, n).start()
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline and fleet.num_holding(total) < n:
        time.sleep(0.1)
    held_at = time.monotonic() - fleet.first_join_at if fleet.num_holding(total) == n else None
    beats = len(fleet.heartbeat_s)
    out.put("settled")
    time.sleep(steady_s)  # the steady-state window being measured
    out.put({"held_s": held_at, "join_s": list(fleet.join_s), "heartbeat_s": fleet.heartbeat_s[beats:],
             "expired": len(fleet.expired), "failures": dict(fleet.failures),
             "cpu_s": time.process_time()})
    fleet.close()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else float("nan")


def run(n: int, clients: int, steady_s: float) -> None:
    with tempfile.TemporaryDirectory() as state:
        etcd = EtcdServer(state)
        etcd.start()
        replicas = [CoordinatorProcess(etcd.endpoint, "--liveness-timeout-s", "10", "--drain-s", "0")
                    for _ in range(2)]
        store = Store(etcd.endpoint)
        try:
            addresses = [r.address for r in replicas]
            time.sleep(3)  # leader election (2-3 s), not a synchronisation of results
            with Client(addresses) as client:
                job = client.create_job({"name": "scale", "min_workers": 1, "max_workers": n,
                                         "data": {"num_samples": 10**9, "global_batch_size": n},
                                         "max_steps": 10**9})
                g0 = client.get_job(job.id).status.generation
                cpu0 = {r.process.pid: _cpu_s(r.process.pid) for r in replicas}
                rss0 = sum(_rss_mb(pid) for pid in cpu0)  # idle replicas: the baseline
                out: mp.Queue = mp.Queue()
                per = [n // clients + (i < n % clients) for i in range(clients)]
                procs = [mp.Process(target=_client, args=(addresses, job.id, k, n, 120, steady_s, out))
                         for k in per]
                for p in procs:
                    p.start()
                for _ in procs:
                    assert out.get(timeout=600) == "settled"
                r0, t0 = store._client.status().raft_index, time.monotonic()
                results = [out.get(timeout=600) for _ in procs]
                writes_per_s = (store._client.status().raft_index - r0) / (time.monotonic() - t0)
                generations = client.get_job(job.id).status.generation - g0
                cpu = sum(_cpu_s(pid) - c for pid, c in cpu0.items())
                rss = sum(_rss_mb(pid) for pid in cpu0) - rss0
                for p in procs:
                    p.join(30)
            _report(n, results, generations, cpu, rss, writes_per_s)
        finally:
            store.close()
            for r in replicas:
                r.stop()
            etcd.stop()


def _report(n: int, results: list[dict], generations: int, cpu: float, rss: float,
            writes_per_s: float) -> None:
    held = [r["held_s"] for r in results]
    joins = [x for r in results for x in r["join_s"]]
    beats = [x for r in results for x in r["heartbeat_s"]]
    print(f"N={n}: one plan holding all: {max(held) if None not in held else 'never'} s; "
          f"join p50 {_pct(joins, 50):.2f} s p99 {_pct(joins, 99):.2f} s; "
          f"heartbeat p50 {_pct(beats, 50) * 1000:.0f} ms p99 {_pct(beats, 99) * 1000:.0f} ms; "
          f"false expiries {sum(r['expired'] for r in results)}; generations {generations}; "
          f"coordinators (both) {cpu / n * 1000:.1f} CPU s and {rss / n * 1000:.0f} MB above idle "
          f"per 1k agents; "
          f"etcd {writes_per_s:.1f} writes/s steady; clients {sum(r['cpu_s'] for r in results):.0f} CPU s; "
          f"failures {[r['failures'] for r in results if r['failures']]}; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", default="1000,3000,10000")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--steady-s", type=float, default=10.0)
    args = parser.parse_args()
    for n in [int(x) for x in args.agents.split(",")]:
        run(n, args.clients, args.steady_s)


if __name__ == "__main__":
    main()
