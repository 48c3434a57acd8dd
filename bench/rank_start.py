"""Starting a node's ranks: forked by the fork server vs exec'd (cold), in one run.

An agent starts its ranks with `rankprocess.RankStarter`: forked from the
node's warm fork server (worker/agent/forkserver.py) where it can, else
exec'd. This bench starts ``--ranks`` processes of a script that imports what
a library-mode rank imports (torch, torch.distributed, the training library)
both ways, ``--reps`` times, and prints for each way the median wall time
from the first start to the last rank's imports done, and the CPU seconds the
starts took (the children's user + system time, the fork server's included).
The forked figure is given twice: with the server's own start-up (an agent's
first ranks) and warm (a crashed rank's replacement, restart mode's next
generation). Ratios are cold / forked (higher is better); the load average
is printed too (two shared cores make every figure noisy).

    .venv/bin/python bench/rank_start.py [--ranks 3] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from springback.worker.agent.rankprocess import RankStarter

RANK = """\
import json, os, resource, sys
import torch, torch.distributed
import springback.worker.train.session
usage = resource.getrusage(resource.RUSAGE_SELF)  # a forked child's starts at its fork
with open(os.environ["READY_FILE"], "w") as f:
    json.dump({"cpu": usage.ru_utime + usage.ru_stime, "parent": os.getppid()}, f)
"""


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (its own, not its children's)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_ranks(starter: RankStarter, ranks: int, folder: str) -> tuple[float, list[dict]]:
    """Starts `ranks` processes, waits for all to finish; the wall time and
    each one's report (its CPU, its parent)."""
    began = time.monotonic()
    procs, files = [], []
    for i in range(ranks):
        files.append(os.path.join(folder, f"ready-{i}"))
        procs.append(starter.start({**os.environ, "READY_FILE": files[-1]},
                                   stdout=subprocess.DEVNULL))
    for p in procs:
        if p.wait(timeout=300) != 0:
            raise SystemExit(f"a rank exited with status {p.returncode}")
    wall = time.monotonic() - began
    reports = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            reports.append(json.load(f))
    return wall, reports


def measure(fork: bool, ranks: int, script: str, folder: str, warm: bool) -> tuple[float, float]:
    """(wall s, CPU s) of starting `ranks` ranks: the ranks' CPU, and the
    fork server's unless `warm` (then it is up before the clock starts)."""
    starter = RankStarter([sys.executable, script], fork=fork)
    try:
        if warm:
            start_ranks(starter, 1, folder)
        wall, reports = start_ranks(starter, ranks, folder)
        cpu = sum(r["cpu"] for r in reports)
        if fork and not warm:
            cpu += _process_cpu(reports[0]["parent"])  # the server: its imports
        return wall, cpu
    finally:
        starter.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=3, help="processes per start (default 3: "
                   "two ranks and the spare)")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "rank.py")
        with open(script, "w") as f:
            f.write(RANK)
        ways = {"cold (exec)": (False, False), "forked, server start included": (True, False),
                "forked, server warm": (True, True)}
        results: dict[str, tuple[float, float]] = {}
        for name, (fork, warm) in ways.items():
            runs = [measure(fork, args.ranks, script, folder, warm) for _ in range(args.reps)]
            results[name] = (statistics.median(r[0] for r in runs),
                             statistics.median(r[1] for r in runs))
    print(f"starting {args.ranks} ranks, median of {args.reps} "
          f"(load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs)")
    cold_wall, cold_cpu = results["cold (exec)"]
    for name, (wall, cpu) in results.items():
        print(f"  {name:32s} wall {wall:5.2f} s ({cold_wall / wall:4.1f}x)   "
              f"CPU {cpu:5.2f} s ({cold_cpu / cpu:4.1f}x)")


if __name__ == "__main__":
    main()
