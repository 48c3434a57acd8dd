"""Recovery benchmark: how long until training runs again after a failure.

Runs a real local cluster (etcd, one coordinator, three node agents, each with
one rank of examples/tinylm) and injects, one after the other:

* a crashed local rank (SIGKILL of one rank process; its agent stays alive,
  reports the failure at once and puts its warm standby in the rank's place;
  the bench waits until that standby has finished its set-up): target <= 3 s;
* a lost node (SIGKILL of one agent with its ranks): detected by its peers
  (they see its connections reset and its agent's plan stream ends:
  service/core/evidence.py), independent of the liveness timeout; target <= 1 s
  with the default liveness timeout (5 s).

Recovery time = first completed step of the new generation - the kill. Lost
work = steps whose results the survivors did not keep (0 when the survivors'
in-memory state covers every finished step).

    python bench/recovery.py [--repeats 3] [--liveness-timeout-s 5] [--json]

The load average (os.getloadavg) is printed with the numbers: the machine is
shared, and a loaded machine stretches every recovery.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "tinylm" / "train.py"


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _standby_files(agent_pid: int) -> dict[int, str]:
    """Each child of the agent with its SPRINGBACK_STANDBY_FILE ("" if none)."""
    out = {}
    for pid in _children(agent_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except FileNotFoundError:
            continue
        out[pid] = env.get(b"SPRINGBACK_STANDBY_FILE", b"").decode()
    return out


def _active_ranks(agent_pid: int) -> list[int]:
    """The agent's rank processes, leaving out its warm standby (a standby is
    active once the agent wrote its activation file)."""
    return [pid for pid, path in _standby_files(agent_pid).items()
            if not path or os.path.exists(path)]


def _standby_ready(agent_pid: int) -> bool:
    """The agent has a warm standby that finished its set-up and is unused."""
    return any(path and not os.path.exists(path) and os.path.exists(path + ".ready")
               for path in _standby_files(agent_pid).values())


def _events(path: Path) -> list[dict]:
    from springback.worker.eventlog import read
    return read(path)


def _wait(pred, timeout_s: float, what: str):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


def _recovered_after(metrics: Path, t_kill: float, generation: int) -> tuple[float, dict]:
    """Seconds from the kill to the first step of a generation newer than `generation`."""
    def first_step():
        for e in _events(metrics):
            if e["event"] == "step" and e["generation"] > generation and e["t"] > t_kill:
                return e
        return None
    step = _wait(first_step, 60, "training to resume")
    return step["t"] - t_kill, step


def _last_step(metrics: Path) -> dict:
    return [e for e in _events(metrics) if e["event"] == "step"][-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--liveness-timeout-s", type=float, default=5.0)
    p.add_argument("--gap-s", type=float, default=6.0, help="seconds between faults")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from _local_coordinator import local_coordinator
    from springback.client.api import Client

    work = Path(tempfile.mkdtemp(prefix="springback-bench-"))
    metrics = work / "metrics.jsonl"
    agents: list[subprocess.Popen] = []
    results: dict[str, list[float]] = {"rank_crash_s": [], "node_loss_s": []}
    lost_steps: list[int] = []
    with local_coordinator(work / "etcd", liveness_timeout_s=args.liveness_timeout_s,
                           leader_ttl_s=2, progress_flush_s=1.0) as server:
        try:
            client = Client(server.address)
            job = client.create_job({
                "name": "bench-recovery", "min_workers": 2, "max_workers": 3,
                "data": {"num_samples": 5547, "global_batch_size": 24, "seed": 0},
                "max_steps": 1_000_000})
            env = dict(os.environ, SPRINGBACK_METRICS_FILE=str(metrics),
                       TINYLM_MAX_STEPS="1000000", PYTHONUNBUFFERED="1")

            def start_agent(name: str) -> subprocess.Popen:
                log = open(work / f"agent-{name}.log", "ab")  # noqa: SIM115
                proc = subprocess.Popen(
                    [sys.executable, "-m", "springback.worker.agent", "--job", job.id,
                     "--coordinator", server.address, "--max-restarts", "100", "--",
                     sys.executable, str(TRAIN)],
                    env=env, stdout=log, stderr=subprocess.STDOUT)
                agents.append(proc)
                return proc

            for name in ("a", "b", "c"):
                start_agent(name)
            _wait(lambda: any(e["event"] == "step" and e["world_size"] == 3
                              for e in _events(metrics)), 120, "three workers training")
            for i in range(args.repeats):
                # faults a few seconds apart: the standby started after a crash must be
                # warm (imports done) before the next crash on that node
                time.sleep(args.gap_s)
                victim = agents[1 + i % 2]
                # measure the warm path: the node's standby has finished its set-up
                # (on a loaded machine that can take longer than the gap)
                _wait(lambda: _standby_ready(victim.pid), 120, "a warm standby")
                before = _last_step(metrics)
                ranks = _active_ranks(victim.pid)
                t_kill = time.time()
                for pid in ranks:
                    os.kill(pid, signal.SIGKILL)
                seconds, first = _recovered_after(metrics, t_kill, before["generation"])
                results["rank_crash_s"].append(seconds)
                lost_steps.append(max(0, _last_step_before(metrics, t_kill) + 1 - first["step"]))
            for i in range(args.repeats):
                time.sleep(1.0)
                before = _last_step(metrics)
                victim = agents[-1]
                t_kill = time.time()
                victim.kill()  # the agent; its ranks die with it (parent-death signal)
                seconds, first = _recovered_after(metrics, t_kill, before["generation"])
                results["node_loss_s"].append(seconds)
                lost_steps.append(max(0, _last_step_before(metrics, t_kill) + 1 - first["step"]))
                start_agent(f"r{i}")  # a replacement joins for the next round
                # a generation after the recovered one: a world-3 step of the old
                # generation can still be logged just after the kill
                _wait(lambda: any(e["event"] == "step" and e["world_size"] == 3
                                  and e["generation"] > first["generation"]
                                  for e in _events(metrics)),
                      120, "the replacement to join")
        finally:
            for proc in agents:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    summary = {
        "liveness_timeout_s": args.liveness_timeout_s,
        "rank_crash_s": [round(x, 3) for x in results["rank_crash_s"]],
        "node_loss_s": [round(x, 3) for x in results["node_loss_s"]],
        "rank_crash_median_s": round(sorted(results["rank_crash_s"])[len(results["rank_crash_s"]) // 2], 3),
        "node_loss_median_s": round(sorted(results["node_loss_s"])[len(results["node_loss_s"]) // 2], 3),
        "max_lost_steps": max(lost_steps),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "work_dir": str(work),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        lt = args.liveness_timeout_s
        print(f"crashed local rank -> training again: median {summary['rank_crash_median_s']:.2f} s "
              f"(runs {summary['rank_crash_s']}; target 3 s; a timeout-based detector would "
              f"need >= {lt:.1f} s just to notice)")
        print(f"lost node          -> training again: median {summary['node_loss_median_s']:.2f} s "
              f"(runs {summary['node_loss_s']}; target 1 s, liveness timeout {lt:.1f} s)")
        print(f"lost work: at most {summary['max_lost_steps']} step(s) per failure")
        print(f"load average (1, 5, 15 min): {summary['load_average']}")
    return 0


def _last_step_before(metrics: Path, t: float) -> int:
    steps = [e["step"] for e in _events(metrics) if e["event"] == "step" and e["t"] <= t]
    return max(steps) if steps else 0


if __name__ == "__main__":
    sys.exit(main())
