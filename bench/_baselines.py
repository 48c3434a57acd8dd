"""The goodput benchmark's baselines (bench/goodput.py): torchft 0.2.0 and
torchrun elastic + DCP, on the same model, data, step and trace as
Springback, plus a plain single-process step of the same model.

Both baselines are optional: `bench/setup.sh` installs them into .bench-venv
(CPU torch 2.13.0, torchft 0.2.0 on it, python-etcd for the etcd-v2
rendezvous); run the bench with that venv's python.

* torchft: a Lighthouse (``torchft_lighthouse``; quorum tick 100 ms and join
  timeout 10 s, the fast-recovery settings of torchft's examples; heartbeat
  timeout as given, 5 s by default, as torchft's own default and Springback's
  liveness timeout), one replica group per node (bench/_torchft_train.py).
  Victims: any node (the Lighthouse is not a node).
* torchft HSDP (goodput.py --sharded): replica groups of --shard nodes, each
  a torchrun job (the torchrun side's etcd-v2 settings, one rendezvous id per
  group), a Lighthouse with min_replicas 1 (bench/_torchft_hsdp_train.py).
* torchrun: ``torchrun --nnodes=2:N`` per node with the etcd-v2 rendezvous
  (an etcd started with --enable-v2), ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  and keep-alive 1 s x 3, DCP save every --ckpt-every steps
  (bench/_torchrun_train.py). Victims: any node. ``--torchrun-rdzv c10d`` is
  the documented second option: the first node hosts the c10d store, so only
  non-host nodes are killed. Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the
  baseline never finishes with torch 2.13: a node with cached store info skips
  publishing the master address for the new round, the agents deadlock and
  the store host dies with DistStoreError.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def plain_step_s(num_ranks: int, steps: int = 60, sharded: bool = False) -> float:
    """Median step of the same model in one plain process (no torch.distributed)
    on one rank's share of the global batch: the per-step overhead baseline
    (`sharded`: the sharded bench's `Blocks` model with AdamW, whole)."""
    import _goodput_common as C

    if sharded:
        model = C.make_blocks()
        opt = C.make_adamw(model)
    else:
        model, opt = C.make_model()
    times = []
    for step in range(1, steps + 1):
        t = time.perf_counter()
        C.train_step(model, opt, C.step_indices(step, num_ranks, 0), num_ranks / C.GLOBAL_BATCH)
        times.append(time.perf_counter() - t)
    return statistics.median(times[5:])


def _free_port() -> int:
    from springback.cli.local import free_port
    return free_port()


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s") from None
            time.sleep(0.1)


def _lighthouse(args: Any, work: Path, min_replicas: int,
                heartbeat_ms: int) -> tuple[subprocess.Popen, int]:
    """A torchft Lighthouse on a free port (its log in `work`): (process, port)."""
    port = _free_port()
    proc = subprocess.Popen(
        [str(Path(args.python).parent / "torchft_lighthouse"),
         "--bind", f"127.0.0.1:{port}", "--min_replicas", str(min_replicas),
         "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
         "--heartbeat_timeout_ms", str(heartbeat_ms)],
        stdout=open(work / "lighthouse.log", "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    return proc, port


def _torchft_record(system: str, t0: float, kills: int, events: list[dict], nodes: Any,
                    args: Any) -> dict:
    """A torchft side's record from its events (committed steps keyed by world size)."""
    steps = [e for e in events if e["event"] == "step"]
    if not steps:
        raise RuntimeError(f"{system}: no step committed (node logs in {nodes.work})")
    end = _end(events, steps)
    useful = len({s["step"] for s in steps if s["step"] <= end["step"]})
    return {"system": system, "t0": t0, "end": end["t"],
            "useful": useful, "first": steps[0]["t"], "executed": len(steps),
            "generations": len({(s["world_size"]) for s in steps}), "kills": kills,
            "steps": steps, "key": "world_size", "kill_times": nodes.kill_times,
            "note": unfinished_note(nodes, args, useful) or (
                "no straggler policy: the slow node's pace" if getattr(args, "straggler", False)
                else "kills any node")}


def _trace_to_done(run_trace: Callable[..., tuple[float, int]], read: Callable[[Path], list[dict]],
                   nodes: Any, start_node: Callable[[str], None], events_path: Path, args: Any,
                   label: str) -> tuple[float, int]:
    """run_trace until a ``done`` event is in `events_path` (any node a victim);
    every node is stopped after it, also when it raises."""
    def done() -> bool:
        return any(e["event"] == "done" for e in read(events_path))

    try:
        return run_trace(nodes, start_node, done, lambda alive: list(alive), args, label)
    finally:
        nodes.stop_all()


def torchft_side(args: Any, work: Path, nodes: Any, run_trace: Callable[..., tuple[float, int]],
                 read: Callable[[Path], list[dict]], heartbeat_ms: int) -> dict:
    """Runs the trace on torchft; returns the side's record (see goodput.py)."""
    events_path = work / "events.jsonl"
    lighthouse, port = _lighthouse(args, work, 2, heartbeat_ms)
    env = dict(os.environ, GOODPUT_EVENTS=str(events_path),
               GOODPUT_STEP_SLEEP_S=str(args.step_sleep_s), GOODPUT_MAX_STEPS=str(args.max_steps),
               GOODPUT_TIMEOUT_S=str(args.liveness_timeout_s),
               TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", PYTHONPATH=str(BENCH))

    def start_node(name: str) -> None:
        nodes.start(name, [args.python, str(BENCH / "_torchft_train.py")],
                    dict(env, GOODPUT_NODE=name, **slow_env(args, name)))

    try:
        t0, kills = _trace_to_done(run_trace, read, nodes, start_node, events_path, args,
                                   f"torchft-hb{heartbeat_ms}")
    finally:
        lighthouse.kill()
        lighthouse.wait()
    return _torchft_record(f"torchft hb {heartbeat_ms / 1000:g}s", t0, kills,
                           read(events_path), nodes, args)


def torchft_hsdp_side(args: Any, work: Path, nodes: Any,
                      run_trace: Callable[..., tuple[float, int]],
                      read: Callable[[Path], list[dict]], heartbeat_ms: int) -> dict:
    """Runs the trace on torchft's fault tolerant HSDP (bench/_torchft_hsdp_train.py):
    replica groups of --shard nodes, each one torchrun job (etcd-v2
    rendezvous, one rendezvous id per group, ``--nnodes`` fixed at the group
    size, the torchrun side's settings); a Lighthouse with min_replicas 1
    (torchtitan's torchft docs). Nodes 0..shard-1 form group 0 and so on; a
    replacement joins the group that lost a node. Returns the side's record."""
    events_path = work / "events.jsonl"
    shard = args.shard
    lighthouse, port = _lighthouse(args, work, 1, heartbeat_ms)
    etcd, etcd_port = _etcd_v2(work)
    env = dict(os.environ, GOODPUT_EVENTS=str(events_path),
               GOODPUT_STEP_SLEEP_S=str(args.step_sleep_s), GOODPUT_MAX_STEPS=str(args.max_steps),
               GOODPUT_TIMEOUT_S=str(args.liveness_timeout_s),
               GOODPUT_GLOO_TIMEOUT_S=str(args.gloo_timeout_s),
               TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(BENCH), LOGLEVEL=os.environ.get("LOGLEVEL", "INFO"))
    group_of: dict[str, int] = {}

    def start_node(name: str) -> None:
        members = [sum(1 for n in nodes.alive if group_of.get(n) == g)
                   for g in range(args.nodes // shard)]
        group = members.index(min(members))
        group_of[name] = group
        conf = f"join_timeout=60,last_call_timeout=1,close_timeout=5,{args.rdzv_conf}"
        nodes.start(name, [args.python, "-m", "torch.distributed.run", f"--nnodes={shard}",
                           "--nproc-per-node=1", "--rdzv-backend=etcd-v2",
                           f"--rdzv-endpoint=127.0.0.1:{etcd_port}",
                           f"--rdzv-id=goodput-hsdp-group{group}", f"--rdzv-conf={conf}",
                           "--max-restarts=100", "--monitor-interval=0.5",
                           "--local-addr=127.0.0.1", str(BENCH / "_torchft_hsdp_train.py")],
                    dict(env, GOODPUT_GROUP=str(group)))

    try:
        t0, kills = _trace_to_done(run_trace, read, nodes, start_node, events_path, args,
                                   f"torchft-hsdp-hb{heartbeat_ms}")
    finally:
        for proc in (lighthouse, etcd):
            proc.kill()
            proc.wait()
    return _torchft_record(f"torchft hsdp hb {heartbeat_ms / 1000:g}s", t0, kills,
                           read(events_path), nodes, args)


def _etcd_v2(work: Path) -> tuple[subprocess.Popen, int]:
    from springback.cli.local import etcd_binary

    client, peer = _free_port(), _free_port()
    proc = subprocess.Popen(
        [etcd_binary(), "--enable-v2", "--data-dir", str(work / "etcd-v2"),
         "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
        stdout=open(work / "etcd-v2.log", "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    _wait_http(f"http://127.0.0.1:{client}/v2/keys", 20, proc)
    return proc, client


def torchrun_side(args: Any, work: Path, nodes: Any, run_trace: Callable[..., tuple[float, int]],
                  read: Callable[[Path], list[dict]]) -> dict:
    """Runs the trace on torchrun elastic + DCP; returns the side's record."""
    events_path, ckpt = work / "events.jsonl", work / "ckpt"
    ckpt.mkdir()
    etcd = None
    host = "torchrun-node0"
    if args.torchrun_rdzv == "etcd-v2":
        etcd, port = _etcd_v2(work)
    else:
        port = _free_port()
    env = dict(os.environ, GOODPUT_EVENTS=str(events_path), GOODPUT_CKPT_DIR=str(ckpt),
               GOODPUT_CKPT_EVERY=str(args.ckpt_every), GOODPUT_STEP_SLEEP_S=str(args.step_sleep_s),
               GOODPUT_MAX_STEPS=str(args.max_steps),
               GOODPUT_GLOO_TIMEOUT_S=str(args.gloo_timeout_s),
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(BENCH), LOGLEVEL=os.environ.get("LOGLEVEL", "INFO"))

    def start_node(name: str) -> None:
        conf = f"join_timeout=60,last_call_timeout=1,close_timeout=5,{args.rdzv_conf}"
        if args.torchrun_rdzv == "c10d":
            conf += f",is_host={'true' if name == host else 'false'}"
        nodes.start(name, [args.python, "-m", "torch.distributed.run", f"--nnodes=2:{args.nodes}",
                           "--nproc-per-node=1", f"--rdzv-backend={args.torchrun_rdzv}",
                           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=goodput-bench",
                           f"--rdzv-conf={conf}", "--max-restarts=100", "--monitor-interval=0.5",
                           "--local-addr=127.0.0.1", str(BENCH / "_torchrun_train.py")], env)

    def done() -> bool:
        return any(e["event"] == "done" for e in read(events_path))

    def victims(alive: list[str]) -> list[str]:
        return [n for n in alive if args.torchrun_rdzv != "c10d" or n != host]

    try:
        t0, kills = run_trace(nodes, start_node, done, victims, args, "torchrun")
    finally:
        nodes.stop_all()
        if etcd is not None:
            etcd.kill()
            etcd.wait()
    events = read(events_path)
    steps = [e for e in events if e["event"] == "step"]
    starts = [e for e in events if e["event"] == "start"]
    end = _end(events, steps)
    # the final lineage covers steps 1..max_steps; a step redone after a restart counts once
    useful = len({s["step"] for s in steps if s["step"] <= end["step"]})
    return {"system": f"torchrun {args.torchrun_rdzv}", "t0": t0, "end": end["t"],
            "useful": useful, "first": steps[0]["t"], "executed": len(steps),
            "generations": len(starts), "kills": kills, "steps": steps, "key": "run",
            "kill_times": nodes.kill_times,
            "note": unfinished_note(nodes, args, useful) or (
                "kills any node" if args.torchrun_rdzv != "c10d" else "kills non-host nodes only")}


def _end(events: list[dict], steps: list[dict]) -> dict:
    """The run's "done" event; for a run stopped at --timeout-s, its last step
    (the final lineage then ends there)."""
    return next((e for e in events if e["event"] == "done"), steps[-1])


def slow_env(args: Any, name: str) -> dict[str, str]:
    """The straggler trace's slowdown (goodput.py --straggler) for node `name`:
    only the --slow-node'th of the first nodes gets it."""
    if not getattr(args, "straggler", False) or not name.endswith(f"-node{args.slow_node}"):
        return {}
    return {"GOODPUT_COMPUTE_SLEEP_S": str(args.slow_sleep_s),
            "GOODPUT_COMPUTE_SLEEP_FROM_STEP": str(args.slow_from_step)}


def unfinished_note(nodes: Any, args: Any, useful: int) -> str:
    """A row's note for a side stopped at --timeout-s ("" when it finished):
    its goodput is then that of the window, over the steps it got through."""
    if not nodes.timed_out:
        return ""
    return f"did not finish in {args.timeout_s:.0f} s: {useful} of {args.max_steps} steps"
