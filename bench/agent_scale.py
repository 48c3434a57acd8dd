"""Agents at scale: N simulated agents in several client processes against etcd + 2 replicas.

Each client process drives N/P members (`tests/agentsim.SimFleet`: JoinJob,
a WatchPlans stream, heartbeats at the interval the coordinator names) on
one asyncio loop. By default they connect as a cluster's agents do: the
replicas run with an operator token, and every simulated agent opens its own
TCP connection, checks the job and joins with the job's join credential,
then heartbeats and streams its plans on a connection of its own with its
member credential (`--shared-channels`: the old kinder mode, four shared
channels per client process, no credentials). Once every member holds one plan placing all N, a steady
window of at least three liveness timeouts is measured (with `--leader-kill`,
the leader replica is SIGKILLed halfway through it). Prints, for each N:

* time from the LAST join to one plan holding all N, and join p50/p99;
* heartbeat p50/p99 and false expiries in the window, generations made in
  the window (0 expected) and during the join storm;
* plan bytes per agent per generation (what WatchPlans sent each member);
* coordinator CPU s (both replicas, whole run and window) and MB per 1k agents;
* etcd writes/s (raft index delta) and lease renewals/s (etcd's own
  `etcd_debugging_lease_renewed_total`) in the window;
* the simulator's CPU s in the window, per heartbeat, and its share of the
  CPU used in the window (simulator / simulator + coordinators + etcd) and of
  one core per client process, to show the client side was not the limit;
* the simulator's and the replicas' memory and the replicas' open file
  descriptors per 1k agents (what a connection costs on each side);
* the load average (other work on the machine shows there).

Usage: python bench/agent_scale.py [--agents 1000,3000] [--clients 4]
    [--liveness-timeout-s 10] [--join-rate-per-s 0 (= all at once)] [--steady-s 0 (= 3 liveness timeouts)]
    [--leader-kill] [--repeat 1] [--coordinator-arg=--some-flag=value ...] [--coordinator-logs DIR]
    [--shared-channels]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from agentsim import SimFleet, kill_leader, start_replicas  # noqa: E402
from sbtest import CoordinatorProcess  # noqa: E402
from springback.client.api import Client  # noqa: E402
from springback.cli.local import EtcdServer  # noqa: E402
from springback.service.etcd.store import Store  # noqa: E402



def _client(addresses: list[str], job_id: str, n: int, total: int, settle_s: float,
            join_rate_per_s: float | None, join_credential: str | None, window: mp.Event,
            over: mp.Event, out: mp.Queue) -> None:
    fleet = SimFleet(addresses, job_id, n, join_rate_per_s=join_rate_per_s,
                     join_credential=join_credential).start()
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline and fleet.num_holding(total) < n:
        time.sleep(0.05)
    held_at = time.monotonic() if fleet.num_holding(total) == n else None
    out.put({"held_at": held_at, "last_join_at": fleet.last_join_at, "join_s": list(fleet.join_s),
             "storm_cpu_s": fleet.cpu_s(), "num_joined": fleet.num_joined,
             "num_holding": fleet.num_holding(total), "storm_failures": dict(fleet.failures),
             "rss_mb": _rss_mb(os.getpid())})
    window.wait()
    beats, cpu0, expired0 = len(fleet.heartbeat_s), fleet.cpu_s(), len(fleet.expired)
    failures0 = dict(fleet.failures)
    over.wait()
    failures = {k: v - failures0.get(k, 0) for k, v in fleet.failures.items() if v > failures0.get(k, 0)}
    out.put({"heartbeat_s": fleet.heartbeat_s[beats:], "window_cpu_s": fleet.cpu_s() - cpu0,
             "expired": len(fleet.expired) - expired0, "failures": failures,
             "bytes_per_generation": fleet.bytes_per_generation(), "cpu_s": fleet.cpu_s()})
    fleet.close()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else float("nan")


def _etcd_metric(etcd: EtcdServer, name: str) -> float:
    url = etcd.endpoint.replace("https://", "http://") + "/metrics"
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def run(n: int, args: argparse.Namespace) -> None:
    liveness = args.liveness_timeout_s
    steady_s = max(args.steady_s, 3 * liveness)
    with tempfile.TemporaryDirectory() as state:
        etcd = EtcdServer(state)
        etcd.start()
        store = Store(etcd.endpoint)
        replicas: list[CoordinatorProcess] = []
        token = None if args.shared_channels else secrets.token_urlsafe(24)
        auth = () if token is None else ("--token", token)
        try:
            logs = iter(range(1000))
            replicas = start_replicas(
                lambda *extra: CoordinatorProcess(
                    etcd.endpoint, *extra, log_path=(
                        os.path.join(args.coordinator_logs, f"N{n}-{os.getpid()}-{next(logs)}.log")
                        if args.coordinator_logs else None)), store,
                "--liveness-timeout-s", f"{liveness:g}", "--drain-s", "0", *auth,
                *args.coordinator_arg)
            addresses = [r.address for r in replicas]
            with Client(addresses, token=token) as client:
                job = client.create_job({"name": "scale", "min_workers": 1, "max_workers": n,
                                         "data": {"num_samples": 10**9, "global_batch_size": n},
                                         "max_steps": 10**9})
                g0 = client.get_job(job.id).status.generation
                pids = [r.process.pid for r in replicas]
                cpu0 = {pid: _cpu_s(pid) for pid in pids}
                rss0 = sum(_rss_mb(pid) for pid in pids)  # idle replicas: the baseline
                fds0 = sum(_fds(pid) for pid in pids)
                credential = None if token is None else client.issue_join_credential(job.id)
                out: mp.Queue = mp.Queue()
                window, over = mp.Event(), mp.Event()
                rate = args.join_rate_per_s / args.clients if args.join_rate_per_s else None
                per = [n // args.clients + (i < n % args.clients) for i in range(args.clients)]
                procs = [mp.Process(target=_client, args=(addresses, job.id, k, n, args.settle_s,
                                                          rate, credential, window, over, out))
                         for k in per]
                for p in procs:
                    p.start()
                settled = [out.get(timeout=args.settle_s + 60) for _ in procs]
                g1 = client.get_job(job.id).status.generation
                rss = sum(_rss_mb(pid) for pid in pids) - rss0
                fds = sum(_fds(pid) for pid in pids) - fds0
                cpu_at_kill: dict[int, float] = {}  # a killed replica's CPU, read before the kill

                def cpu_now(pid: int) -> float:
                    return cpu_at_kill.get(pid) or _cpu_s(pid)

                live = {pid: _cpu_s(pid) for pid in pids}
                etcd0, r0 = _cpu_s(etcd.process.pid), store._client.status().raft_index
                renewed0, t0 = _etcd_metric(etcd, "etcd_debugging_lease_renewed_total"), time.monotonic()
                window.set()
                killed = None
                if args.leader_kill:
                    time.sleep(steady_s / 2)  # the measured window's first half
                    for r in replicas:  # read before the kill; the killed one's stays
                        cpu_at_kill[r.process.pid] = _cpu_s(r.process.pid)
                    killed = kill_leader(replicas, store)
                    survivor = next(r for r in replicas if r.address != killed)
                    del cpu_at_kill[survivor.process.pid]
                time.sleep(max(0.0, t0 + steady_s - time.monotonic()))  # the rest of the window
                elapsed = time.monotonic() - t0
                writes_per_s = (store._client.status().raft_index - r0) / elapsed
                renewals_per_s = (_etcd_metric(etcd, "etcd_debugging_lease_renewed_total")
                                  - renewed0) / elapsed
                etcd_cpu = _cpu_s(etcd.process.pid) - etcd0
                window_cpu = sum(cpu_now(pid) - c for pid, c in live.items())
                g2 = client.get_job(job.id).status.generation
                over.set()
                results = [out.get(timeout=120) for _ in procs]
                cpu = sum(cpu_now(pid) - c for pid, c in cpu0.items())
                for p in procs:
                    p.join(30)
            _report(n, args, settled, results, g1 - g0, g2 - g1, killed, cpu, window_cpu, rss,
                    fds, writes_per_s, renewals_per_s, etcd_cpu, elapsed)
        finally:
            store.close()
            for r in replicas:
                r.stop()
            etcd.stop()


def _report(n: int, args: argparse.Namespace, settled: list[dict], results: list[dict],
            storm_generations: int, window_generations: int, killed: str | None, cpu: float,
            window_cpu: float, rss: float, fds: int, writes_per_s: float, renewals_per_s: float,
            etcd_cpu: float, elapsed: float) -> None:
    held = [s["held_at"] for s in settled]
    held_s = (f"{max(held) - max(s['last_join_at'] for s in settled):.1f} s"
              if None not in held else
              f"never within {args.settle_s:g} s ({sum(s['num_joined'] for s in settled)} joined, "
              f"{sum(s['num_holding'] for s in settled)} holding a plan of all, storm failures "
              f"{[s['storm_failures'] for s in settled if s['storm_failures']]})")
    joins = [x for s in settled for x in s["join_s"]]
    beats = [x for r in results for x in r["heartbeat_s"]]
    sim_cpu = sum(r["window_cpu_s"] for r in results)
    expired = sum(r["expired"] for r in results)
    share = sim_cpu / (sim_cpu + window_cpu + etcd_cpu) if sim_cpu + window_cpu + etcd_cpu else 0.0
    bytes_per = statistics.mean(r["bytes_per_generation"] for r in results)
    kill = (f"; leader killed mid-window: {'no expiry' if not expired else f'{expired} EXPIRED'}, "
            f"generation {'unchanged' if not window_generations else f'+{window_generations} CHANGED'}"
            if killed else "")
    joining = f"{args.join_rate_per_s:g} joins/s" if args.join_rate_per_s else "joins at once"
    connecting = ("4 shared channels per client, no credentials" if args.shared_channels else
                  "one connection per agent, join and member credentials")
    sim_rss = sum(s["rss_mb"] for s in settled)
    print(f"N={n} liveness {args.liveness_timeout_s:g} s, {joining}, {connecting} "
          f"{' '.join(args.coordinator_arg)}: "
          f"one plan holding all {held_s} after the last join; "
          f"join p50 {_pct(joins, 50):.2f} s p99 {_pct(joins, 99):.2f} s; "
          f"window {elapsed:.0f} s: {len(beats)} heartbeats ({len(beats) / elapsed:.0f}/s) "
          f"p50 {_pct(beats, 50) * 1000:.0f} ms p99 {_pct(beats, 99) * 1000:.0f} ms, "
          f"false expiries {expired}, generations {window_generations} "
          f"(storm {storm_generations}); plan {bytes_per:.0f} B per agent per generation; "
          f"coordinators (both) {cpu / n * 1000:.1f} CPU s per 1k agents whole run, "
          f"{window_cpu:.1f} CPU s in window ({window_cpu / max(len(beats), 1) * 1e6:.0f} us per "
          f"heartbeat), {rss / n * 1000:.0f} MB and {fds / n * 1000:.0f} fds per 1k agents above "
          f"idle; simulator {sim_rss / n * 1000:.0f} MB per 1k agents; "
          f"etcd {writes_per_s:.1f} writes/s {renewals_per_s:.0f} lease renewals/s "
          f"{etcd_cpu:.1f} CPU s in window; simulator {sim_cpu:.1f} CPU s in window "
          f"({sim_cpu / max(len(beats), 1) * 1e6:.0f} us per heartbeat, {share:.0%} of the window's "
          f"CPU, {sim_cpu / elapsed / len(results):.0%} of a core per client process), "
          f"storm {sum(s['storm_cpu_s'] for s in settled):.0f} CPU s; "
          f"failures {[r['failures'] for r in results if r['failures']]}{kill}; "
          f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    if killed and (expired or window_generations):
        raise SystemExit(f"N={n}: the leader kill cost members or a generation")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", default="1000,3000")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--settle-s", type=float, default=300.0,
                        help="longest wait for one plan holding all N")
    parser.add_argument("--join-rate-per-s", type=float, default=0.0,
                        help="agents joining per second, all clients together (0: all at once)")
    parser.add_argument("--liveness-timeout-s", type=float, default=10.0)
    parser.add_argument("--steady-s", type=float, default=0.0,
                        help="steady window; at least 3 liveness timeouts")
    parser.add_argument("--leader-kill", action="store_true",
                        help="SIGKILL the leader replica halfway through the steady window")
    parser.add_argument("--repeat", type=int, default=1, help="runs per N")
    parser.add_argument("--shared-channels", action="store_true",
                        help="4 shared channels per client process and no credentials (the "
                             "simulator before issue 48), instead of one connection per agent")
    parser.add_argument("--coordinator-logs", default="",
                        help="directory for the replicas' logs (default: none kept)")
    parser.add_argument("--coordinator-arg", action="append", default=[],
                        help="extra flag for both coordinators, e.g. --coordinator-arg=--flag=value")
    args = parser.parse_args()
    for n in [int(x) for x in args.agents.split(",")]:
        for _ in range(args.repeat):
            run(n, args)


if __name__ == "__main__":
    main()
