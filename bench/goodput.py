"""Goodput under a preemption trace: Springback vs torchft vs torchrun elastic +
DCP, side by side, same training logic, same trace, one run.

Every system trains bench/_goodput_common.py's model (a small MLP; each step
sleeps --step-sleep-s to stand in for compute) for the same --max-steps on
--nodes local "nodes" (one rank each, gloo, loopback only). The trace: every
--kill-every-s seconds one node (agent and ranks) is SIGKILLed, and a
replacement node starts --replace-after-s seconds later, until the job ends.

* Springback: etcd + an in-process coordinator (liveness timeout
  --liveness-timeout-s, 5 s: the default) + one ``python -m
  springback.worker.agent`` per node running bench/_springback_train.py.
  Victims rotate over all nodes (oldest first).
* torchft 0.2.0 and torchrun elastic + DCP (etcd-v2; c10d as a second
  option): see bench/_baselines.py for their settings and why.

Install the baselines first (``bash bench/setup.sh``: its own venv,
.bench-venv, CPU torch 2.13.0) and run the bench with that venv's python:

    .bench-venv/bin/python bench/goodput.py [--max-steps 1500] [--kill-every-s 20]
        [--replace-after-s 5] [--only springback,torchft,torchrun]
        [--torchft-heartbeat-ms 5000,2000] [--plot timeline.png] [--json runs.jsonl]

``--sharded`` runs the same trace on an HSDP job instead, Springback against
torchft's fault tolerant HSDP (no torchrun side), on --nodes 4 one-rank nodes,
replicate 2 x shard --shard 2, bench/_goodput_common.py's `Blocks` model
(6 x Linear(1024), 72 MiB of parameters and AdamW state; the same data,
global batch and --step-sleep-s as the DDP form):

    .bench-venv/bin/python bench/goodput.py --sharded --max-steps 300 --kill-every-s 20
        --torchft-heartbeat-ms 5000 [--plot timeline.png]

* Springback: the Session's sharded form (bench/_springback_sharded_train.py:
  ``Session(build=build)``, FSDP2 over ``mesh["replicate", "shard"]``), the job's
  layout ``shard: 2``: 4 nodes train replicate 2 x shard 2; after a kill the
  planner runs replicate 1 x shard 2 on two of the three survivors (the third
  a spare), and 2 x 2 again when the replacement joins. The two are the
  first in old node-rank order: when they are the same shard coordinate of
  both replicas the other shard's holder is the spare, no source, and the
  ranks roll back to peer copies (from scratch before any exist); otherwise
  the state is resharded in memory (docs/benchmarks.md, the sharded paragraph).
* torchft: bench/_torchft_hsdp_train.py (torchtitan's integration: FSDP2
  inside a replica group, the reduce-scattered gradients averaged across
  groups by an all-reduce hook over the Manager's ManagedProcessGroup); one
  replica group = one torchrun job over two nodes (etcd-v2 rendezvous per
  group), a Lighthouse with min_replicas 1. A kill takes its whole replica
  group down; torchrun restarts it when the replacement joins, and it heals
  from the live group over torchft's HTTP transport.

``--straggler`` runs a slow-node trace instead (no kills): --nodes 4 one-rank
nodes, one of them (--slow-node, the last) made slower from step
--slow-from-step on by --slow-sleep-s more compute per step (a sleep before
its forward pass: about 2x its step; _goodput_common.slow_compute, the same
injection as tests/worker/tiny_train.py's TINY_COMPUTE_SLEEP_S), on three
systems one after the other:

    .bench-venv/bin/python bench/goodput.py --straggler [--max-steps 600]
        [--slow-from-step 150] [--slow-sleep-s 0.07] [--straggler-window-steps 30]
        [--straggler-change-cost-s 5]

* Springback with ``controls.straggler`` on (window --straggler-window-steps,
  factor 1.5 and cool-down 600 s, the defaults; change_cost_s
  --straggler-change-cost-s: the policy's prior before any change was
  measured is 30 s, more than this short job's saving; a change measured by
  the kill traces costs under 0.5 s): the slow node is set aside and the job
  goes on at world 3 (no spare); the same job with the policy off; and
  torchft (heartbeat: the first of --torchft-heartbeat-ms), which has no
  straggler policy: its quorum trains at the slow node's pace to the end.

Reported per system: goodput = useful steps x the side's median step before
the slowdown (the fast nodes' pace) / wall time (from the nodes' start to the
last step); the step rate (steps/s) before the slowdown, while slowed (to the
eviction step of the "on" run) and after it (from 10 steps past it), the same
step windows on every side; the eviction's step and the policy's message; and
the goodput ratios on / off and on / torchft.

Reported per system (kill traces): goodput = useful steps x median undisturbed step / wall
time (wall time from the moment the nodes are started to the job's last step,
so start-up counts); time to the first step; lost seconds per kill = (wall -
time to the first step - useful x median step) / kills; steps redone
(Springback: the coordinator's count; the baselines: logged steps beyond the
distinct ones); per-step overhead = the system's median undisturbed step minus
a plain single-process step of the same model on one rank's batch, measured
in the same run; and the ratios Springback / each baseline. Useful steps are
the steps of the final lineage: Springback's committed final step; for the
baselines the distinct steps logged up to the final one. The load average is
printed with the numbers: the machine is shared, and absolute goodput falls
with its load (every system equally exposed, one after the other).

After each Springback run of a kill trace: one row per kill and per join,
the survivors' lost time split into detection, wait, reforming, build, fill,
the first step beyond the median step and steps redone (client/badput.py's
change_costs, from the job's generation events), with the total and the mean
per kind (docs/benchmarks.md, "Where a kill's and a join's time goes").
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
        self.kill_times: list[float] = []
        self.timed_out = False
        """The trace reached --timeout-s before the job ended."""

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
        self.kill_times.append(time.time())
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
    """Starts the nodes, runs the kill/replace trace until done() or --timeout-s
    (then `nodes.timed_out` is set: the side reports how far it got); returns
    (t0, kills)."""
    t0 = time.time()
    for i in range(args.nodes):
        start_node(f"{label}-node{i}")
    next_kill, replacements, kills, serial = t0 + args.kill_every_s, [], 0, args.nodes
    deadline = t0 + args.timeout_s
    while not done():
        now = time.time()
        if now > deadline:
            print(f"  [{label}] not done after {args.timeout_s:.0f} s: stopped", flush=True)
            nodes.timed_out = True
            break
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


def median_step(steps: list[dict], key: str, below: int | None = None) -> float:
    """The median of consecutive steps' intervals in one generation (`below`:
    of steps before that one only)."""
    d = [b["t"] - a["t"] for a, b in zip(steps, steps[1:])
         if b[key] == a[key] and b["step"] == a["step"] + 1
         and (below is None or b["step"] < below)]
    return statistics.median(d) if d else float("nan")


def straggler_spec(args) -> dict:  # noqa: ANN001
    """The job's `controls` for the straggler trace's "on" side."""
    return {"straggler": {"enabled": True, "window_steps": args.straggler_window_steps,
                          "change_cost_s": args.straggler_change_cost_s}}


def springback_side(args, work: Path, checkpoint: str = "",  # noqa: ANN001
                    straggler: bool | None = None) -> dict:
    """`checkpoint`: the job's checkpoint.every_steps ("auto" or a count; "":
    no checkpoints, the survivors' memory only). `straggler`: the straggler
    trace, with the policy on (True) or off (False)."""
    from _baselines import slow_env, unfinished_note
    from _local_coordinator import local_coordinator
    from springback.client.api import Client
    from springback.client.badput import change_costs
    from springback.v1 import types_pb2 as pb
    from springback.v1.job_service_pb2 import CHANGE_KIND_CONTROL

    metrics = work / "metrics.jsonl"
    nodes = Nodes(work)
    with local_coordinator(work / "etcd", liveness_timeout_s=args.liveness_timeout_s,
                           leader_ttl_s=2, progress_flush_s=1.0) as server:
        try:
            client = Client(server.address)
            job = client.create_job({
                "name": "bench-goodput", "min_workers": 2, "max_workers": args.nodes,
                **({"layout": {"shard": args.shard}} if args.sharded else {}),
                "data": {"num_samples": 4096, "global_batch_size": 24, "seed": 0},
                "max_steps": args.max_steps,
                **({"controls": straggler_spec(args)} if straggler else {}),
                **({"checkpoint": {"uri": f"file://{work}/ckpt", "every_steps": (
                    checkpoint if checkpoint == "auto" else int(checkpoint))}}
                   if checkpoint else {})})
            env = dict(os.environ, SPRINGBACK_METRICS_FILE=str(metrics), PYTHONUNBUFFERED="1",
                       GOODPUT_STEP_SLEEP_S=str(args.step_sleep_s),
                       GOODPUT_MAX_STEPS=str(args.max_steps), OMP_NUM_THREADS="1")

            def start_node(name: str) -> None:
                nodes.start(name, [PY, "-m", "springback.worker.agent", "--job", job.id,
                                   "--coordinator", server.address, "--max-restarts", "100", "--",
                                   PY, str(BENCH / ("_springback_sharded_train.py"
                                                    if args.sharded else
                                                    "_springback_train.py"))],
                            dict(env, **slow_env(args, name)))

            final = {}

            asked = [0.0]  # when done() last asked the coordinator

            def done() -> bool:
                # twice a second, as a user's `springback watch` would see it:
                # the harness must not load the coordinator the baselines lack
                if time.monotonic() - asked[0] < 0.5:
                    return False
                asked[0] = time.monotonic()
                status = client.get_job(job.id).status
                state, final["step"] = status.state, status.step
                final["redone"] = status.steps_redone
                if state in (pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED):
                    raise RuntimeError(f"springback job ended {pb.JobState.Name(state)}")
                return state == pb.JOB_STATE_SUCCEEDED

            t0, kills = run_trace(nodes, start_node, done, lambda alive: list(alive), args,
                                  "springback")
            record, generations = client.list_job_events(job.id)
            final["changes"] = change_costs(record, generations, now=time.time())
            evicted = next((e for e in generations if e.kind == CHANGE_KIND_CONTROL), None)
            if evicted is not None:  # the step its generation started at
                final["evicted_at"] = next(e.start_step for e in generations
                                           if e.generation == evicted.generation)
                final["evicted_reason"] = evicted.reason
        finally:
            nodes.stop_all()
    events = _read(metrics)
    steps = [e for e in events if e["event"] == "step"]
    gens = [e for e in events if e["event"] == "generation"]
    # the job's committed final step: survivors keep every finished step, nothing is redone
    useful = final["step"]
    label = f"springback{' hsdp' if args.sharded else ''} lt {args.liveness_timeout_s:g}s" + (
        f" ckpt {checkpoint}" if checkpoint else "")
    if straggler is not None:
        label = f"springback policy {'on' if straggler else 'off'}"
    return {"system": label, "t0": t0,
            "end": steps[-1]["t"], "useful": useful, "first": steps[0]["t"],
            "executed": len(steps), "generations": len(gens), "kills": kills,
            "redone": final.get("redone", 0), "steps": steps, "key": "generation",
            "kill_times": nodes.kill_times, "changes": final.get("changes", []),
            "evicted_at": final.get("evicted_at"), "evicted_reason": final.get("evicted_reason"),
            "note": unfinished_note(nodes, args, useful) or (
                "kills any node" if straggler is None else
                f"set aside at step {final['evicted_at']}" if "evicted_at" in final else
                "nobody set aside")}


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, help="default 3; 4 with --sharded or --straggler")
    p.add_argument("--sharded", action="store_true",
                   help="HSDP (replicate x shard) on both sides: Springback's sharded Session "
                   "vs torchft's fault tolerant HSDP; the Blocks model")
    p.add_argument("--shard", type=int, default=2, help="--sharded: the shard degree "
                   "(torchft: the nodes of one replica group)")
    p.add_argument("--straggler", action="store_true",
                   help="a slow-node trace instead of kills: Springback with controls.straggler "
                   "on, off, and torchft, on one node made slower mid-run")
    p.add_argument("--slow-node", type=int, default=None,
                   help="--straggler: the node made slow (default the last)")
    p.add_argument("--slow-from-step", type=int, default=150,
                   help="--straggler: the step its slowdown starts at")
    p.add_argument("--slow-sleep-s", type=float, default=0.07,
                   help="--straggler: its extra compute per step (about 2x its step)")
    p.add_argument("--straggler-window-steps", type=int, default=30,
                   help="--straggler: controls.straggler.window_steps (30: the default)")
    p.add_argument("--straggler-change-cost-s", type=float, default=5.0,
                   help="--straggler: controls.straggler.change_cost_s (the policy's prior, "
                   "30 s, is above this short job's saving)")
    p.add_argument("--max-steps", type=int, help="default 1500; 600 with --straggler")
    p.add_argument("--step-sleep-s", type=float, default=0.06)
    p.add_argument("--kill-every-s", type=float, default=20.0)
    p.add_argument("--replace-after-s", type=float, default=5.0)
    p.add_argument("--ckpt-every", type=int, default=20,
                   help="torchrun side: DCP save every K steps")
    p.add_argument("--liveness-timeout-s", type=float, default=5.0,
                   help="springback's liveness timeout; torchft's manager timeout")
    p.add_argument("--torchft-heartbeat-ms", default="5000,2000",
                   help="torchft Lighthouse heartbeat timeouts, one side each")
    p.add_argument("--torchrun-rdzv", choices=["etcd-v2", "c10d"], default="etcd-v2")
    p.add_argument("--rdzv-conf", default="keep_alive_interval=1,keep_alive_max_attempt=3",
                   help="torchrun side: more --rdzv-conf")
    p.add_argument("--gloo-timeout-s", type=float, default=10.0, help="torchrun side")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up on a side after this")
    p.add_argument("--springback-checkpoints", default="",
                   help="also run Springback with these checkpoint.every_steps, e.g. "
                   "auto,10,50,200 (auto: Young-Daly with the default prior); the "
                   "goodput ratios of auto to each are printed")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every side this many times, in interleaved rounds; the "
                   "ratios are of each system's median")
    p.add_argument("--only", help="comma-separated sides to run (default "
                   "springback,torchft,torchrun; springback,torchft with --sharded)")
    p.add_argument("--work-dir", help="logs and state (default: a new temp dir)")
    p.add_argument("--plot", help="write a PNG timeline (steps over time, kills marked) here")
    p.add_argument("--json", help="append the summary as one JSON line to this file")
    args = p.parse_args(argv)
    args.nodes = args.nodes or (4 if args.sharded or args.straggler else 3)
    args.max_steps = args.max_steps or (600 if args.straggler else 1500)
    args.only = args.only or ("springback,torchft" if args.sharded or args.straggler else
                              "springback,torchft,torchrun")
    if args.straggler:
        if args.sharded or "torchrun" in args.only.split(",") or args.springback_checkpoints \
                or args.repeat > 1:
            p.error("--straggler runs Springback (policy on and off) and torchft only (no "
                    "--sharded, torchrun, --springback-checkpoints or --repeat)")
        args.slow_node = args.nodes - 1 if args.slow_node is None else args.slow_node
        if not 0 <= args.slow_node < args.nodes:
            p.error(f"--slow-node {args.slow_node} is not one of the {args.nodes} nodes")
        if not 10 < args.slow_from_step < args.max_steps:
            p.error(f"--slow-from-step {args.slow_from_step} must be between 10 and "
                    f"--max-steps {args.max_steps}")
        args.kill_every_s = float("inf")  # no kills: the slow node is the only fault
    if args.sharded:
        if args.shard < 2 or args.nodes % args.shard:
            p.error(f"--shard {args.shard} must be at least 2 and divide --nodes {args.nodes}")
        if "torchrun" in args.only.split(",") or args.springback_checkpoints:
            p.error("--sharded runs Springback and torchft only (no torchrun, no "
                    "--springback-checkpoints)")
    return args


def _sides(args: argparse.Namespace, work: Path) -> list[tuple[str, Callable[[], dict]]]:
    import _baselines as B
    wanted = set(args.only.split(","))
    sides: list[tuple[str, Callable[[], dict]]] = []
    if "springback" in wanted and args.straggler:  # on first: its eviction step is the windows'
        sides += [(f"springback-policy-{x}", lambda x=x: springback_side(
            args, work / f"springback-policy-{x}", straggler=x == "on")) for x in ("on", "off")]
    elif "springback" in wanted:
        sides.append(("springback", lambda: springback_side(args, work / "springback")))
    for every in (x for x in args.springback_checkpoints.split(",") if x):
        d = work / f"springback-ckpt-{every}"
        sides.append((f"springback-ckpt-{every}",
                      lambda d=d, every=every: springback_side(args, d, every)))
    if "torchft" in wanted:
        side = B.torchft_hsdp_side if args.sharded else B.torchft_side
        beats = [int(x) for x in args.torchft_heartbeat_ms.split(",") if x]
        for hb in beats[:1] if args.straggler else beats:  # no kills: one is enough
            d = work / f"torchft-hb{hb}"
            sides.append((f"torchft-hb{hb}", lambda d=d, hb=hb: side(
                args, d, Nodes(d), run_trace, _read, hb)))
    if "torchrun" in wanted:
        d = work / "torchrun"
        sides.append(("torchrun", lambda: B.torchrun_side(args, d, Nodes(d), run_trace, _read)))
    return sides


def _summary(r: dict, plain_s: float) -> dict:
    """One side's numbers: goodput, start-up, lost seconds per kill, overhead."""
    med = median_step(r["steps"], r["key"])
    wall = r["end"] - r["t0"]
    first = r["first"] - r["t0"]
    lost = wall - first - r["useful"] * med
    return {"system": r["system"], "wall_s": wall, "first_step_s": first, "useful": r["useful"],
            "executed": r["executed"], "kills": r["kills"],
            "redone": r.get("redone", max(0, r["executed"] - r["useful"])),
            "step_ms": med * 1000, "overhead_ms": (med - plain_s) * 1000,
            "lost_per_kill_s": lost / r["kills"] if r["kills"] else float("nan"),
            "goodput": r["useful"] * med / wall, "note": r["note"]}


def _rate(steps: list[dict], first: int, last: int) -> float:
    """Steps per second from step `first` to step `last` (the first records at
    or after them); nan when the run did not reach them."""
    a = next((s for s in steps if s["step"] >= first), None)
    b = next((s for s in steps if s["step"] >= last), None)
    if a is None or b is None or b["t"] <= a["t"]:
        return float("nan")
    return (b["step"] - a["step"]) / (b["t"] - a["t"])


def _straggler_rows(results: list[dict], args: argparse.Namespace) -> list[dict]:
    """The straggler trace's numbers per side: goodput against the side's own
    pace before the slowdown, and its step rate in the same step windows on
    every side (before the slowdown; while slowed, to the "on" run's eviction;
    from 10 steps after it to the end)."""
    slow, end = args.slow_from_step, args.max_steps
    evicted = next((r["evicted_at"] for r in results if r.get("evicted_at")), None)
    windows = {"before": (10, slow - 2),
               "during": (slow + 2, evicted - 2 if evicted else end),
               "after": (evicted + 10, end) if evicted else None}
    rows = []
    for r in results:
        med = median_step(r["steps"], r["key"], below=slow)
        wall = r["end"] - r["t0"]
        rows.append({"system": r["system"], "wall_s": wall, "first_step_s": r["first"] - r["t0"],
                     "useful": r["useful"], "executed": r["executed"],
                     "evicted_at": r.get("evicted_at"), "fast_step_ms": med * 1000,
                     **{f"rate_{k}": _rate(r["steps"], *w) if w else float("nan")
                        for k, w in windows.items()},
                     "goodput": r["useful"] * med / wall, "note": r["note"],
                     "reason": r.get("evicted_reason")})
    return rows


def _print_straggler(rows: list[dict], args: argparse.Namespace,
                     failures: dict[str, str]) -> None:
    print(f"\nstraggler trace: {args.nodes} nodes, node {args.slow_node} +"
          f"{args.slow_sleep_s * 1000:.0f} ms of compute per step from step "
          f"{args.slow_from_step}, {args.max_steps} steps; load average "
          f"{[round(x, 2) for x in os.getloadavg()]}")
    print("goodput = useful steps x the side's median step before the slowdown / wall; "
          "rates in steps/s over the same step windows on every side")
    print(f"{'system':<24}{'wall s':>8}{'1st step s':>11}{'useful':>8}{'fast ms':>9}"
          f"{'evicted@':>9}{'before':>8}{'during':>8}{'after':>8}{'goodput':>9}  note")
    for r in rows:
        at = "-" if r["evicted_at"] is None else str(r["evicted_at"])
        print(f"{r['system']:<24}{r['wall_s']:>8.1f}{r['first_step_s']:>11.1f}{r['useful']:>8}"
              f"{r['fast_step_ms']:>9.1f}{at:>9}{r['rate_before']:>8.2f}{r['rate_during']:>8.2f}"
              f"{r['rate_after']:>8.2f}{r['goodput']:>9.1%}  {r['note']}")
    for name, why in failures.items():
        print(f"{name:<24}FAILED: {why}")
    on = next((r for r in rows if r["system"] == "springback policy on"), None)
    if on is not None and on["reason"]:
        print(f"policy on: {on['reason']}")
    for r in rows:
        if on is not None and r is not on:
            print(f"{on['system']} / {r['system']}: goodput {on['goodput'] / r['goodput']:.2f}x, "
                  f"wall {on['wall_s']:.1f} vs {r['wall_s']:.1f} s")
    if any(r["system"].startswith("torchft") for r in rows):
        print("torchft has no straggler policy: its quorum waits for the slow node every "
              "step to the end")


def _medians(rows: list[dict]) -> list[dict]:
    """One row per system: with --repeat, the median of its runs' numbers
    (goodput, redone, overhead), printed with the runs' goodput range; the
    ratios below are of these medians."""
    by_system: dict[str, list[dict]] = {}
    for r in rows:
        by_system.setdefault(r["system"], []).append(r)
    if all(len(runs) == 1 for runs in by_system.values()):
        return rows
    print(f"\nmedians of {max(len(v) for v in by_system.values())} runs per system "
          "(interleaved rounds):")
    out = []
    for system, runs in by_system.items():
        med = {k: statistics.median(r[k] for r in runs)
               for k in ("goodput", "redone", "overhead_ms", "lost_per_kill_s", "first_step_s")}
        print(f"{system:<28} goodput {med['goodput']:.1%} (runs "
              + ", ".join(f"{r['goodput']:.1%}" for r in runs)
              + f"), 1st step {med['first_step_s']:.1f} s, lost {med['lost_per_kill_s']:.2f} "
              f"s/kill, redone {med['redone']:g}")
        out.append({"system": system, **med})
    return out


def _print_table(rows: list[dict], plain_s: float, failures: dict[str, str]) -> None:
    print(f"\nplain single process: {plain_s * 1000:.1f} ms per step (same model, one "
          f"rank's batch); load average {[round(x, 2) for x in os.getloadavg()]}")
    print(f"{'system':<20}{'wall s':>8}{'1st step s':>11}{'useful':>8}{'exec':>6}{'kills':>6}"
          f"{'redone':>7}{'lost s/kill':>12}{'step ms':>9}{'ovh ms':>8}{'goodput':>9}  note")
    for r in rows:
        print(f"{r['system']:<20}{r['wall_s']:>8.1f}{r['first_step_s']:>11.1f}{r['useful']:>8}"
              f"{r['executed']:>6}{r['kills']:>6}{r['redone']:>7}{r['lost_per_kill_s']:>12.2f}"
              f"{r['step_ms']:>9.1f}{r['overhead_ms']:>+8.1f}{r['goodput']:>9.1%}  {r['note']}")
    for name, why in failures.items():
        print(f"{name:<20}FAILED: {why}")
    rows = _medians(rows)
    auto = next((r for r in rows if r["system"].endswith("ckpt auto")), None)
    for r in rows:
        if auto is not None and r is not auto and " ckpt " in r["system"]:
            print(f"{auto['system']} / {r['system']}: goodput "
                  f"{auto['goodput'] / r['goodput']:.3f}x, redone {auto['redone']} vs "
                  f"{r['redone']}")
    sb = next((r for r in rows if r["system"].startswith("springback")), None)
    for r in rows:
        if sb is not None and not r["system"].startswith("springback"):  # the baselines
            print(f"springback / {r['system']}: goodput {sb['goodput'] / r['goodput']:.2f}x, "
                  f"per-step overhead {sb['overhead_ms']:+.1f} vs {r['overhead_ms']:+.1f} ms")


def _fmt(v: float | None, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.2f}"


def _print_changes(system: str, costs: list) -> None:
    """Where each kill's and each join's time went (client/badput.py's
    change_costs, from the job's generation events): one row per change, then
    the total and the mean per kind."""
    from springback.client.badput import CHANGE_COLUMNS, change_summary

    print(f"\n{system}: where a kill's and a join's time goes (seconds the survivors lost, "
          "from the job's generation events)")
    heads = ("detect", "wait", "reform", "build", "fill", "1st step", "redone")
    head = "".join(f"{h:>9}" for h in heads)
    print(f"{'change':<18}{'at s':>7}{head}{'total':>9}{'steps redone':>14}{'gap s':>8}"
          f"{'x step':>8}")
    for c in costs:
        cells = "".join(_fmt(getattr(c, k), 9) for k in CHANGE_COLUMNS)
        name = f"{c.kind} g{c.generation}" + (" (waits)" if c.waits else "" if c.started
                                              else " (replaced)")
        print(f"{name:<18}{c.at_s:>7.1f}{cells}{c.total:>9.2f}{c.steps_redone:>14}"
              f"{_fmt(c.step_gap_s, 8)}{_fmt(c.gap_ratio, 8)}")
    for kind, s in change_summary(costs).items():
        for what in ("total", "mean"):
            cells = "".join(_fmt(s[what][k], 9) for k in CHANGE_COLUMNS)
            redone = s["steps_redone"] if what == "total" else s["steps_redone"] / s["count"]
            label = f"{kind} {what} ({s['count']})" if what == "total" else f"{kind} {what}"
            print(f"{label:<18}{'':>7}{cells}{_fmt(s[what]['total'], 9)}{redone:>14.1f}")
        if s["first_step_measured"] < s["count"]:
            print(f"  {kind}: first step measured for {s['first_step_measured']} of "
                  f"{s['count']} (not for one that waited or was replaced before its first step, "
                  "nor without a start report or a step time); totals count it where measured")
    for kind in ("kill", "join"):
        ratios = [r for c in costs if c.kind == kind and (r := c.gap_ratio) is not None]
        if ratios:
            print(f"{kind}: the survivors' longest pause {max(ratios):.1f} x their median step "
                  f"(median of the changes {statistics.median(ratios):.1f} x; issue 47's "
                  "target for a join: 1.5 x)")
    print("detect: last step report to the change; wait: too few members left, waiting for a "
          "join (the next row); reform: rendezvous + plan reaching the "
          "ranks (a joiner's start while rank 0 waits for it); build: rank 0's process start "
          "and model build; fill: state transfer; 1st step: the first step beyond the median "
          "step; redone: steps trained again x the step time; gap: the last step report "
          "before the change to the first after it, and that in median steps of the "
          "generation before")


def _change_json(results: list[dict]) -> list[dict]:
    from dataclasses import asdict

    from springback.client.badput import change_summary
    return [{"system": r["system"], "rows": [dict(asdict(c), total=c.total) for c in r["changes"]],
             "summary": change_summary(r["changes"])} for r in results if r.get("changes")]


def main() -> int:
    args = _parse()
    args.python = PY

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="springback-goodput-"))
    if args.straggler:
        print(f"trace: {args.nodes} nodes, node {args.slow_node} slower by "
              f"{args.slow_sleep_s * 1000:.0f} ms of compute per step from step "
              f"{args.slow_from_step}, no kills; max_steps {args.max_steps}; logs in {work}; "
              f"load average {[round(x, 2) for x in os.getloadavg()]}", flush=True)
    else:
        print(f"trace: {args.nodes} nodes{f' (HSDP, shard {args.shard})' if args.sharded else ''}"
              f", SIGKILL one node every {args.kill_every_s:.0f} s, "
              f"replacement {args.replace_after_s:.0f} s later; max_steps {args.max_steps}; "
              f"logs in {work}; load average {[round(x, 2) for x in os.getloadavg()]}",
              flush=True)
    import _baselines as B
    plain_s = B.plain_step_s(args.nodes, sharded=args.sharded)
    results, failures = [], {}
    rounds = [(f"round{i + 1}/" if args.repeat > 1 else "", side) for i in range(args.repeat)
              for side in _sides(args, work / (f"round{i + 1}" if args.repeat > 1 else ""))]
    for prefix, (name, fn) in rounds:
        name = prefix + name
        (work / name).mkdir(parents=True, exist_ok=True)
        print(f"-- {name}", flush=True)
        try:
            results.append(fn())
        except KeyboardInterrupt:
            print("interrupted; every process stopped")
            return 130
        except Exception as exc:  # noqa: BLE001 - report the failed side, keep the others
            failures[name] = f"{type(exc).__name__}: {exc}"
            print(f"  [{name}] FAILED: {failures[name]} (logs in {work / name})", flush=True)
    if args.straggler:
        rows = _straggler_rows(results, args)
        _print_straggler(rows, args, failures)
    else:
        rows = [_summary(r, plain_s) for r in results]
        _print_table(rows, plain_s, failures)
    for r in results:
        if r.get("changes"):
            _print_changes(r["system"], r["changes"])
    if args.plot and results:
        from _goodput_plot import timeline
        timeline(results, args, args.plot)
        print(f"timeline: {args.plot}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"trace": {"kill_every_s": args.kill_every_s,
                                          "max_steps": args.max_steps,
                                          "sharded": args.sharded,
                                          **({"slow_node": args.slow_node,
                                              "slow_from_step": args.slow_from_step,
                                              "slow_sleep_s": args.slow_sleep_s}
                                             if args.straggler else {})},
                                "load_average": os.getloadavg(), "plain_ms": plain_s * 1000,
                                "rows": rows, "changes": _change_json(results),
                                "failures": failures}) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
