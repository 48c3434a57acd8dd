"""Goodput under a preemption trace: Springback vs torchrun elastic + DCP
checkpoint-restart, side by side, same training logic, same trace, one run.

Both systems train bench/_goodput_common.py's model (a small MLP; each step
sleeps --step-sleep-s to stand in for compute) for the same --max-steps on
--nodes local "nodes" (one rank each, gloo, loopback only). The trace: every
--kill-every-s seconds one node (agent and ranks) is SIGKILLed, and a
replacement node starts --replace-after-s seconds later, until the job ends.

* Springback: etcd + an in-process coordinator + one
  ``python -m springback.worker.agent`` per node running
  bench/_springback_train.py. Victims rotate over all nodes (oldest first).
* torchrun (baseline): one ``torchrun --nnodes=2:N --rdzv-backend=c10d`` per
  node running bench/_torchrun_train.py (DDP; DCP save every --ckpt-every steps,
  load of the latest at start). The first node hosts the c10d rendezvous store,
  and killing it ends the rendezvous for everyone, so with c10d the trace kills
  only NON-HOST nodes (oldest first). Settings chosen so the baseline is not
  unfairly slow: --monitor-interval 0.5, rdzv-conf join_timeout=60,
  last_call_timeout=1, close_timeout=5, keep-alive at torch's defaults
  (interval 5 s x 3, --rdzv-conf), gloo timeout --gloo-timeout-s (10 s; a rank
  whose peer died can hang in its collective until then), max-restarts 100.

  Observed on a 2-core machine with torch 2.13: after the first kill and
  replacement the baseline's re-rendezvous did not complete; the host agent
  crashed with DistStoreError waiting for a participant's role info (60 s
  read_timeout), ending the job. Seen with 20 s and with 40 s between kills and
  with keep-alive 1 s x 3; compare pytorch/pytorch#147064. The bench then reports
  the baseline as failed and why.

Goodput = useful steps x median undisturbed step time / wall time, wall time
from the moment the nodes are started to the job's last step (so start-up, the
imports and the first rendezvous, counts for both). Useful steps are the steps
of the final lineage: Springback's committed final step (survivors keep every
finished step, nothing is redone); for torchrun the distinct steps logged up to
its final step (a step redone after a restart counts once). The median
undisturbed step time is each system's own median interval between consecutive
steps of one generation (torchrun: of one worker-group start). "executed" counts
the step records logged (Springback: rank 0 logs each step after its final
all-reduce, so a step finished just as rank 0's node was killed has no record
and executed can fall a step or two short of useful; torchrun: every logged
step, redone ones included).

    python bench/goodput.py [--max-steps 1500] [--kill-every-s 20] [--replace-after-s 5]
                            [--nodes 3] [--ckpt-every 20] [--only springback|torchrun]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PY = sys.executable


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


class Nodes:
    """Node process groups; every one is SIGKILLed at the end."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: dict[str, subprocess.Popen] = {}
        self.alive: list[str] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=ROOT)
        self.alive.append(name)

    @staticmethod
    def _kill_tree(pid: int) -> None:
        """SIGKILLs the node: the agent's process group and the process group of
        every descendant (both agents start their ranks in new sessions; torchrun's
        workers would otherwise outlive their agent)."""
        groups, todo = [pid], [pid]
        while todo:
            p = todo.pop()
            try:
                for task in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{task}/children") as f:
                        kids = [int(x) for x in f.read().split()]
                    groups += kids
                    todo += kids
            except (FileNotFoundError, ProcessLookupError):
                pass
        for p in groups:
            try:
                os.killpg(os.getpgid(p), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            self._kill_tree(proc.pid)
        proc.wait()
        self.alive.remove(name)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                self._kill_tree(proc.pid)
        for proc in self.procs.values():
            proc.wait()
        self.alive.clear()


def run_trace(nodes: Nodes, start_node: Callable[[str], None], done: Callable[[], bool],
              victims: Callable[[list[str]], list[str]], args,  # noqa: ANN001
              label: str) -> tuple[float, int]:
    """Starts the nodes, runs the kill/replace trace until done(); returns (t0, kills)."""
    t0 = time.time()
    for i in range(args.nodes):
        start_node(f"{label}-node{i}")
    next_kill, replacements, kills, serial = t0 + args.kill_every_s, [], 0, args.nodes
    deadline = t0 + args.timeout_s
    while not done():
        now = time.time()
        if now > deadline:
            raise TimeoutError(f"{label}: job not done after {args.timeout_s:.0f} s")
        if now >= next_kill:
            candidates = victims(nodes.alive)
            if candidates:
                nodes.kill(candidates[0])
                kills += 1
                print(f"  [{label}] t={now - t0:6.1f}s SIGKILL {candidates[0]}", flush=True)
                replacements.append(now + args.replace_after_s)
            next_kill += args.kill_every_s
        for t in [t for t in replacements if now >= t]:
            replacements.remove(t)
            name = f"{label}-node{serial}"
            serial += 1
            start_node(name)
            print(f"  [{label}] t={now - t0:6.1f}s start {name} (replacement)", flush=True)
        time.sleep(0.1)
    return t0, kills


def median_step(steps: list[dict], key: str) -> float:
    d = [b["t"] - a["t"] for a, b in zip(steps, steps[1:])
         if b[key] == a[key] and b["step"] == a["step"] + 1]
    return statistics.median(d) if d else float("nan")


def springback_side(args, work: Path) -> dict:  # noqa: ANN001
    from _local_coordinator import local_coordinator
    from springback.client.api import Client
    from springback.v1 import types_pb2 as pb

    metrics = work / "metrics.jsonl"
    nodes = Nodes(work)
    with local_coordinator(work / "etcd", liveness_timeout_s=args.liveness_timeout_s,
                           leader_ttl_s=2, progress_flush_s=1.0) as server:
        try:
            client = Client(server.address)
            job = client.create_job({
                "name": "bench-goodput", "min_workers": 2, "max_workers": args.nodes,
                "data": {"num_samples": 4096, "global_batch_size": 24, "seed": 0},
                "max_steps": args.max_steps})
            env = dict(os.environ, SPRINGBACK_METRICS_FILE=str(metrics), PYTHONUNBUFFERED="1",
                       GOODPUT_STEP_SLEEP_S=str(args.step_sleep_s),
                       GOODPUT_MAX_STEPS=str(args.max_steps), OMP_NUM_THREADS="1")

            def start_node(name: str) -> None:
                nodes.start(name, [PY, "-m", "springback.worker.agent", "--job", job.id,
                                   "--coordinator", server.address, "--max-restarts", "100", "--",
                                   PY, str(BENCH / "_springback_train.py")], env)

            final = {}

            def done() -> bool:
                status = client.get_job(job.id).status
                state, final["step"] = status.state, status.step
                if state in (pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED):
                    raise RuntimeError(f"springback job ended {pb.JobState.Name(state)}")
                return state == pb.JOB_STATE_SUCCEEDED

            t0, kills = run_trace(nodes, start_node, done, lambda alive: list(alive), args,
                                  "springback")
        finally:
            nodes.stop_all()
    events = _read(metrics)
    steps = [e for e in events if e["event"] == "step"]
    gens = [e for e in events if e["event"] == "generation"]
    # the job's committed final step: survivors keep every finished step, nothing is redone
    useful = final["step"]
    return {"system": "springback", "t0": t0, "end": steps[-1]["t"], "useful": useful,
            "first": steps[0]["t"],
            "executed": len(steps), "generations": len(gens), "kills": kills,
            "median_step": median_step(steps, "generation"), "note": "kills any node"}


def torchrun_side(args, work: Path) -> dict:  # noqa: ANN001
    from springback.cli.local import free_port

    events_path, ckpt = work / "events.jsonl", work / "ckpt"
    ckpt.mkdir()
    port = free_port()
    nodes = Nodes(work)
    host = "torchrun-node0"
    env = dict(os.environ, GOODPUT_EVENTS=str(events_path), GOODPUT_CKPT_DIR=str(ckpt),
               GOODPUT_CKPT_EVERY=str(args.ckpt_every), GOODPUT_STEP_SLEEP_S=str(args.step_sleep_s),
               GOODPUT_MAX_STEPS=str(args.max_steps),
               GOODPUT_GLOO_TIMEOUT_S=str(args.gloo_timeout_s),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               LOGLEVEL=os.environ.get("LOGLEVEL", "INFO"))

    def start_node(name: str) -> None:
        conf = (f"join_timeout=60,last_call_timeout=1,close_timeout=5,{args.rdzv_conf},"
                f"is_host={'true' if name == host else 'false'}")
        nodes.start(name, [PY, "-m", "torch.distributed.run", f"--nnodes=2:{args.nodes}",
                           "--nproc-per-node=1", "--rdzv-backend=c10d",
                           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=goodput-bench",
                           f"--rdzv-conf={conf}", "--max-restarts=100", "--monitor-interval=0.5",
                           "--local-addr=127.0.0.1", str(BENCH / "_torchrun_train.py")], env)

    def done() -> bool:
        if nodes.procs[host].poll() not in (None, 0):
            log = (work / f"{host}.log").read_text(errors="replace")
            why = ""
            if "DistStoreError" in log and "role_info" in log:
                why = (": its agent crashed (DistStoreError) waiting for the role info of a "
                       "rendezvous participant that was killed or never started its worker "
                       "group; torchrun does not recover from this")
            raise RuntimeError(f"torchrun host node exited {nodes.procs[host].returncode}{why}")
        return any(e["event"] == "done" for e in _read(events_path))

    try:
        t0, kills = run_trace(nodes, start_node, done,
                              lambda alive: [n for n in alive if n != host], args, "torchrun")
    finally:
        nodes.stop_all()
    events = _read(events_path)
    steps = [e for e in events if e["event"] == "step"]
    starts = [e for e in events if e["event"] == "start"]
    end = next(e for e in events if e["event"] == "done")
    # the final lineage covers steps 1..max_steps; a step redone after a restart counts once
    useful = len({s["step"] for s in steps if s["step"] <= end["step"]})
    return {"system": "torchrun+DCP", "t0": t0, "end": end["t"], "useful": useful,
            "first": steps[0]["t"],
            "executed": len(steps), "generations": len(starts), "kills": kills,
            "median_step": median_step(steps, "run"), "note": "kills non-host nodes only"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=1500)
    p.add_argument("--step-sleep-s", type=float, default=0.06)
    p.add_argument("--kill-every-s", type=float, default=20.0)
    p.add_argument("--replace-after-s", type=float, default=5.0)
    p.add_argument("--ckpt-every", type=int, default=20,
                   help="torchrun side: DCP save every K steps")
    p.add_argument("--liveness-timeout-s", type=float, default=2.0, help="springback side")
    p.add_argument("--rdzv-conf", default="keep_alive_interval=5,keep_alive_max_attempt=3",
                   help="torchrun side: more --rdzv-conf (default: torch's keep-alive defaults)")
    p.add_argument("--gloo-timeout-s", type=float, default=10.0, help="torchrun side")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up on a side after this")
    p.add_argument("--only", choices=["springback", "torchrun"])
    p.add_argument("--work-dir", help="logs and state (default: a new temp dir)")
    args = p.parse_args()

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="springback-goodput-"))
    print(f"trace: {args.nodes} nodes, SIGKILL one node every {args.kill_every_s:.0f} s, "
          f"replacement {args.replace_after_s:.0f} s later; max_steps {args.max_steps}; "
          f"logs in {work}", flush=True)
    results, failures = [], {}
    sides = [("springback", springback_side), ("torchrun", torchrun_side)]
    for name, fn in sides:
        if args.only and args.only != name:
            continue
        (work / name).mkdir(parents=True, exist_ok=True)
        print(f"-- {name}", flush=True)
        try:
            results.append(fn(args, work / name))
        except KeyboardInterrupt:
            print("interrupted; every process stopped")
            return 130
        except Exception as exc:  # noqa: BLE001 - report the failed side, keep the other
            failures[name] = f"{type(exc).__name__}: {exc}"
            print(f"  [{name}] FAILED: {failures[name]} (logs in {work / name})", flush=True)
    print()
    print(f"{'system':<14}{'wall s':>8}{'1st step s':>11}{'useful':>8}{'executed':>10}"
          f"{'kills':>7}{'gens':>6}{'step ms':>9}{'goodput':>9}  note")
    goodput = {}
    for r in results:
        wall = r["end"] - r["t0"]
        g = r["useful"] * r["median_step"] / wall
        goodput[r["system"]] = g
        print(f"{r['system']:<14}{wall:>8.1f}{r['first'] - r['t0']:>11.1f}{r['useful']:>8}"
              f"{r['executed']:>10}{r['kills']:>7}{r['generations']:>6}"
              f"{r['median_step'] * 1000:>9.1f}{g:>9.1%}  {r['note']}")
    for name, why in failures.items():
        print(f"{name:<14}FAILED: {why}")
    if len(goodput) == 2:
        print(f"\ngoodput ratio springback / torchrun = "
              f"{goodput['springback'] / goodput['torchrun+DCP']:.2f}x")
    elif "torchrun" in failures and "springback" in goodput:
        print("\ngoodput ratio springback / torchrun: n/a (the torchrun baseline failed)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
