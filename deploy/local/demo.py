"""The full local demo: a Springback cluster on one machine, training through a
node crash and a join.

Starts etcd, two coordinator replicas and three node agents, each running one
rank of examples/tinylm (a character-level transformer LM on the Python
standard library's docstrings). A quarter of the way in, one worker is killed
with SIGKILL; half way, a new worker joins. A live view shows progress;
a closing summary shows steps, generations, recovery times, lost steps,
goodput and the exactly-once audit of the training samples.

    deploy/local/demo.sh              # sets up the venv first, then runs this
    .venv/bin/python deploy/local/demo.py [--max-steps N] [--state-dir DIR]
    deploy/local/demo.sh --sharded    # FSDP2/HSDP: two agents of two ranks (train_fsdp.py)
    deploy/local/demo.sh --3d         # pipeline x tensor parallel x FSDP2 (train_3d.py)
    deploy/local/demo.sh --moe        # a top-2 mixture of experts, experts over ep (train_moe.py)
    deploy/local/demo.sh --slurm      # the agents as sbatch jobs on a local Slurm of three
                                      # nodes: one preempted, one crashed (docs/slurm.md)

Safe to run twice: each run starts from an empty state directory, and
processes left over by an interrupted earlier run (recorded in its pid file;
with --slurm, whatever is left in its Slurm cluster's cgroups) are stopped
first. Every process this demo starts is stopped when it ends, on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tinylm"
PY = sys.executable
TTY = sys.stdout.isatty()


def say(msg: str) -> None:
    clear = "\r\033[K" if TTY else ""
    print(f"{clear}{time.strftime('%H:%M:%S')}  {msg}", flush=True)


MODES = {
    # mode: (script, job spec, ranks per agent, agents started first)
    "ddp": ("train.py", "job.yaml", "1", (1, 2, 3)),
    "sharded": ("train_fsdp.py", "job_fsdp.yaml", "2", (1, 2)),
    "3d": ("train_3d.py", "job_3d.yaml", "2", (1, 2)),
    "moe": ("train_moe.py", "job_moe.yaml", "2", (1, 2)),
    "slurm": ("train.py", "job.yaml", "1", ()),
}
"""In every mode but slurm, worker-2 is SIGKILLed a quarter of the way in and
worker-4 joins half way. With slurm, the agents are one sbatch job per
Slurm node (`SlurmDemo`): node3 is preempted a quarter of the way in, node2
crashes half way, and both come back as requeued jobs."""

DRAINED_EXIT = 143
"""The agents' ``--drained-exit-code`` under Slurm: their script requeues its job."""


class SlurmDemo:
    """Three local Slurm nodes (deploy/local/slurm_cluster.py, the one the
    Slurm tests start) whose agents are one requeueable ``sbatch`` job per
    node, each ``srun``ning ``springback run`` (docs/slurm.md). The faults:
    a job of partition ``high`` preempts node3 (its agent drains, its script
    requeues the job, which runs again when the high job has ended), and
    node2 crashes as a whole (every process in its slurmd's cgroup
    SIGKILLed; Slurm sets it DOWN ``SlurmdTimeout`` + seconds later and
    requeues its job; the demo then starts its slurmd again, as a reboot
    would). Without the cgroup freezer, node2 is set DOWN by the admin instead,
    and resumed."""

    def __init__(self, state: Path) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import slurm_cluster

        self.module = slurm_cluster
        self.cluster = slurm_cluster.SlurmCluster(state / "slurm", slurmd_timeout_s=5)
        self.crashed: str | None = None

    def stop_leftovers(self) -> None:
        killed = self.cluster.kill_leftovers()
        if killed:
            say(f"stopped {len(killed)} processes an earlier --slurm run left")

    def start(self) -> None:
        why = self.module.missing()
        if why:
            raise RuntimeError(f"--slurm: {why}")
        self.cluster.start()
        say(f"slurm         slurmctld and slurmd {', '.join(self.cluster.nodes)} "
            f"(SLURM_CONF={self.cluster.conf})")

    def submit_agents(self, job_id: str, coordinators: str, env: dict, state: Path) -> None:
        env = dict(env, **self.cluster.env)
        for node in self.cluster.nodes:
            agent = (f"srun --no-kill -N1 --ntasks-per-node=1 --open-mode=append "
                     f"--output={state}/agent-{node}.log {PY} -m springback.cli run "
                     f"--job {job_id} --coordinator {coordinators} --drain-timeout-s "
                     f"{self.module.PREEMPT_GRACE_S} --drained-exit-code {DRAINED_EXIT} -- "
                     f"{PY} {EXAMPLE / 'train.py'}; rc=$?; "
                     f'if [ "$rc" -eq {DRAINED_EXIT} ]; then scontrol requeue "$SLURM_JOB_ID"; fi; '
                     'exit "$rc"')
            out = subprocess.run(["sbatch", "--parsable", "--requeue", "-ptest", "-N1", f"-w{node}",
                                  "--job-name=springback-agent", "--open-mode=append",
                                  f"--output={state}/batch-{node}.log", f"--wrap={agent}"],
                                 env=env, capture_output=True, text=True, timeout=30, check=True)
            say(f"sbatch        Slurm job {out.stdout.strip()} on {node}: srun springback run "
                f"--job {job_id} -- python train.py")

    def preempt(self, node: str, state: Path) -> None:
        self.cluster.run("sbatch", "--parsable", "-phigh", "-N1", f"-w{node}",
                         "--job-name=high-priority", "--wrap=sleep 5", f"--output={state}/high.log")
        say(f"PREEMPT {node}: a 5 s job of partition high (its agent drains within GraceTime "
            f"{self.module.PREEMPT_GRACE_S} s, then its job requeues)")

    def crash(self, node: str) -> None:
        self.crashed = node
        if self.cluster.cgroup is None:
            self.cluster.set_down(node, reason="demo")
            say(f"DOWN {node}: scontrol update state=down (its tasks get SIGKILL)")
            return
        killed = self.cluster.crash(node)
        say(f"CRASH {node}: {len(killed)} processes of its cgroup SIGKILLed (slurmd, slurmstepd, "
            "agent, rank); Slurm sets it DOWN after SlurmdTimeout")

    def tick(self) -> None:
        """Brings the crashed node back once Slurm has set it DOWN."""
        if self.crashed is None:
            return
        state = self.cluster.node_states().get(self.crashed, "")
        if state.startswith("down"):
            if self.cluster.cgroup is None:
                self.cluster.run("scontrol", "update", f"nodename={self.crashed}", "state=resume")
            else:
                self.cluster.restart(self.crashed)
            say(f"{self.crashed} is DOWN in Slurm; {'resumed' if self.cluster.cgroup is None else 'its slurmd restarted (a reboot)'}: its requeued job runs there again")
            self.crashed = None

    def stop(self) -> None:
        self.cluster.stop()


class Processes:
    """Every process the demo starts, recorded in a pid file for the next run."""

    def __init__(self, pidfile: Path) -> None:
        self.pidfile = pidfile
        self.procs: dict[str, subprocess.Popen] = {}

    def stop_leftovers(self) -> None:
        if not self.pidfile.exists():
            return
        for line in self.pidfile.read_text().split():
            pid = int(line)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except FileNotFoundError:
                continue
            if b"springback" in cmdline or b"etcd" in cmdline:  # still ours
                os.killpg(pid, signal.SIGKILL)
        self.pidfile.unlink()

    def start(self, name: str, argv: list[str], log: Path, **kw) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=kw.pop("stdout", open(log, "ab")),  # noqa: SIM115
                                stderr=open(log, "ab"), start_new_session=True, **kw)
        self.procs[name] = proc
        self.record(proc)
        return proc

    def record(self, proc: subprocess.Popen | None) -> None:
        """Records a process started elsewhere (the demo's etcd, which
        `EtcdServer` starts and stops) for `stop_leftovers`."""
        if proc is not None:
            with open(self.pidfile, "a") as f:
                f.write(f"{proc.pid}\n")

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop_all(self) -> None:
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM if name.startswith("etcd") else signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        if self.pidfile.exists():
            self.pidfile.unlink()


def read_events(path: Path) -> list[dict]:
    from springback.worker.eventlog import read
    return read(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=600)
    p.add_argument("--state-dir", default=os.path.join(tempfile.gettempdir(),
                                                        f"springback-demo-{os.getuid()}"))
    p.add_argument("--liveness-timeout-s", type=float, default=None,
                   help="also the ranks' collective timeout (default 5 s, the coordinator's "
                        "own; 6 s with --sharded, --3d and --moe: a freshly built sharded "
                        "model's first steps on a loaded 2-core machine took longer than 5 s). "
                        "The SIGKILLed node is detected by its peers whatever this is; at 2 s "
                        "every agent's lease "
                        "expired while the ranks started on a slow 2-core machine")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--sharded", dest="mode", action="store_const", const="sharded",
                       help="the FSDP2/HSDP variant (examples/tinylm/train_fsdp.py) on two nodes "
                            "of two ranks; the kill and the join reshard the state in memory")
    modes.add_argument("--3d", dest="mode", action="store_const", const="3d",
                       help="the 3-D variant (examples/tinylm/train_3d.py, job_3d.yaml): pipeline "
                            "stages over two nodes x tensor parallel over each node's two ranks "
                            "x FSDP2; the kill re-partitions to one stage (from the lost "
                            "stage's peer copy), the join grows it back to two")
    modes.add_argument("--moe", dest="mode", action="store_const", const="moe",
                       help="the mixture-of-experts variant (examples/tinylm/train_moe.py): "
                            "top-2 routing, experts sharded over ep on two nodes of two ranks")
    modes.add_argument("--slurm", dest="mode", action="store_const", const="slurm",
                       help="the example over three nodes of a local Slurm (slurmctld and three "
                            "slurmd -N, as root): one sbatch agent job per node; node3 is "
                            "preempted by a higher-priority partition's job, node2 crashes "
                            "(its cgroup killed); both requeued jobs rejoin (docs/slurm.md)")
    p.set_defaults(mode="ddp")
    args = p.parse_args()
    if args.liveness_timeout_s is None:
        args.liveness_timeout_s = 5.0 if args.mode == "ddp" else 6.0
    script, spec_file, nproc, first_workers = MODES[args.mode]

    from springback.client.api import Client
    from springback.cli.etcd_credentials import local_credentials
    from springback.cli.local import EtcdServer
    from springback.client.spec import load_spec_file
    from springback.v1 import types_pb2 as pb
    from springback.worker.train.audit import check_exactly_once

    state = Path(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    procs = Processes(state / "pids")
    procs.stop_leftovers()
    slurm = SlurmDemo(state) if args.mode == "slurm" else None
    if slurm is not None:
        slurm.stop_leftovers()
    for child in state.iterdir():
        if child.name != "pids":
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    metrics, audit = state / "metrics.jsonl", state / "audit"
    interrupted = False
    etcd = None

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        # -- the cluster ------------------------------------------------------
        if slurm is not None:
            slurm.start()
        # etcd as `springback up` starts it: loopback, TLS with client
        # certificates and etcd's auth (the coordinators as a user limited to
        # /springback/), credentials made in a 0700 directory of the state
        etcd = EtcdServer(str(state / "etcd"),
                          tls=local_credentials(str(state / "etcd-credentials")))
        etcd.start()  # an interrupt meanwhile: the finally stops it
        procs.record(etcd.process)
        say(f"etcd          {etcd.endpoint} (TLS, client certificates, auth; "
            f"credentials in {state / 'etcd-credentials'})")
        addresses = []
        for i in (1, 2):
            proc = procs.start(f"coordinator-{i}", [
                PY, "-m", "springback.cli", "--json", "coordinator", "--etcd", etcd.endpoint,
                *etcd.coordinator_flags(), "--listen", "127.0.0.1:0",
                "--liveness-timeout-s", str(args.liveness_timeout_s)],
                state / f"coordinator-{i}.log", stdout=subprocess.PIPE)
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"coordinator-{i} did not start: see {state}/coordinator-{i}.log")
            addresses.append(json.loads(line)["address"])
            say(f"coordinator-{i} {addresses[-1]}")
        coordinators = ",".join(addresses)
        client = Client(addresses)
        spec = load_spec_file(str(EXAMPLE / spec_file))
        spec.max_steps = args.max_steps
        spec.checkpoint.uri = f"file://{state}/checkpoints"
        deadline = time.monotonic() + 30
        while True:
            try:
                job = client.create_job(spec)
                break
            except Exception:  # noqa: BLE001 - the replicas are still electing a leader
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        say(f"job {job.id} submitted: {spec.name}, {spec.max_steps} steps, global batch "
            f"{spec.data.global_batch_size}, {spec.min_workers}-{spec.max_workers} workers")

        env = dict(os.environ, SPRINGBACK_METRICS_FILE=str(metrics),
                   SPRINGBACK_AUDIT_DIR=str(audit), PYTHONUNBUFFERED="1",
                   TINYLM_MAX_STEPS=str(args.max_steps))

        def start_worker(name: str) -> None:
            procs.start(name, [PY, "-m", "springback.cli", "run", "--job", job.id,
                               "--coordinator", coordinators, "--nproc-per-node", nproc, "--",
                               PY, str(EXAMPLE / script)], state / f"{name}.log", env=env)
            say(f"{name} started (springback run --job {job.id} --nproc-per-node {nproc} -- "
                f"python {script})")

        for i in first_workers:
            start_worker(f"worker-{i}")
        if slurm is not None:
            slurm.submit_agents(job.id, coordinators, env, state)

        # -- the live view and the faults -------------------------------------
        kill_at, join_at = args.max_steps // 4, args.max_steps // 2
        faults: list[tuple[str, float]] = []
        joined = False
        seen_generations: set[int] = set()
        t_start = time.time()
        while True:
            events = read_events(metrics)
            steps = [e for e in events if e["event"] == "step"]
            for e in events:
                if e["event"] == "generation" and e["generation"] not in seen_generations:
                    seen_generations.add(e["generation"])
                    src = "memory" if e["source_rank"] < 0 else f"rank {e['source_rank']}"
                    say(f"generation {e['generation']}: world size {e['world_size']}, resumes "
                        f"after step {e['step']}, state from {src}  ({e['reason']})")
            step = steps[-1]["step"] if steps else 0
            if not faults and step >= kill_at:
                faults.append(("node3 preempted" if slurm else "worker-2 SIGKILL", time.time()))
                if slurm is not None:
                    slurm.preempt("node3", state)
                else:
                    procs.kill("worker-2")
                    say(f"SIGKILL worker-2 at step {step} (agent and its ranks)")
            if not joined and step >= join_at:
                joined = True
                if slurm is not None:
                    faults.append(("node2 crash", time.time()))
                    slurm.crash("node2")
                else:
                    start_worker("worker-4")
            if slurm is not None:
                slurm.tick()
            job = client.get_job(job.id)
            if job.status.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED,
                                    pb.JOB_STATE_CANCELLED):
                break
            if steps:
                recent = [s for s in steps if s["t"] > time.time() - 5]
                rate = len(recent) / 5
                bar_w = 30
                done = int(bar_w * step / args.max_steps)
                line = (f"[{'#' * done}{'.' * (bar_w - done)}] step {step}/{args.max_steps} "
                        f"loss {steps[-1]['loss']:.3f}  gen {steps[-1]['generation']} "
                        f"world {steps[-1]['world_size']}  {rate:.1f} steps/s  "
                        f"coordinator: step {job.status.step}")
                if TTY:
                    print(f"\r\033[K{line}", end="", flush=True)
                elif int(time.time() - t_start) % 5 == 0:
                    say(line)
            if time.time() - t_start > 1800:
                raise TimeoutError("the demo job did not finish within 30 minutes")
            time.sleep(0.5)
        if TTY:
            print()
        say(f"job {job.id}: {pb.JobState.Name(job.status.state)} at step {job.status.step}")
        for name in [n for n in procs.procs if n.startswith("worker")]:
            try:
                procs.procs[name].wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if slurm is not None:  # the agents' jobs end: their ranks wrote their audit
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(
                    s.split()[1] == "R" for s in slurm.cluster.run(
                        "squeue", "-h", "-o", "%i %t").splitlines() if s.strip()):
                time.sleep(0.5)

        # -- the closing summary ----------------------------------------------
        events = read_events(metrics)
        departures = None
        if slurm is not None:
            _, generations = client.list_job_events(job.id)
            departures = [(g.generation, g.DESCRIPTOR.fields_by_name["kind"].enum_type
                           .values_by_number[g.kind].name.split("KIND_", 1)[-1].lower(),
                           g.world_size, g.reason) for g in generations]
        summarize(events, audit, spec, faults, job, check_exactly_once, departures)
        return 0 if job.status.state == pb.JOB_STATE_SUCCEEDED else 1
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted")
        return 130
    finally:
        if slurm is not None:
            slurm.stop()
        procs.stop_all()
        if etcd is not None:
            etcd.stop()
        say(f"all demo processes stopped{' (interrupted)' if interrupted else ''}; "
            f"logs in {state}")


def summarize(events, audit, spec, faults, job, check_exactly_once,  # noqa: ANN001
              changes=None) -> None:  # noqa: ANN001
    """The closing summary; `faults`: (what, when) of each injected fault;
    `changes`: the job's generations (number, kind, world, reason) from its
    events, printed with their kinds (the Slurm demo: preempted, node_lost)."""
    steps = [e for e in events if e["event"] == "step"]
    gens = [e for e in events if e["event"] == "generation"]
    print()
    print("=" * 72)
    print("Springback demo summary")
    print("=" * 72)
    print(f"steps completed      {job.status.step} / {spec.max_steps}   "
          f"(loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f})")
    print(f"generations          {len(gens)}")
    for g in gens:
        print(f"  gen {g['generation']:>3}  world {g['world_size']}  from step {g['step']:>4}  "
              f"{g['reason']}")
    if changes:
        print("job events           (springback job events: the kind of each change)")
        for number, kind, world, reason in changes:
            print(f"  gen {number:>3}  {kind:<11} world {world}  {reason[:60]}")
    # recovery: time from a fault to the first step of a later generation
    recoveries = []
    for what, t in faults:
        gen_at = max((s["generation"] for s in steps if s["t"] <= t), default=-1)
        after = [s for s in steps if s["t"] > t and s["generation"] > gen_at]
        if after:
            recoveries.append((what, after[0]["t"] - t))
    for g in gens[1:]:
        before = [s for s in steps if s["t"] < g["t"]]
        after = [s for s in steps if s["t"] > g["t"]]
        if before and after and g["reason"].startswith(("joined", "admitted")):
            recoveries.append((f"gen {g['generation']} (join)", after[0]["t"] - before[-1]["t"]))
    for what, seconds in recoveries:
        print(f"recovery             {what}: training again after {seconds:.2f} s")
    # lost steps: steps run more than once (a generation broke mid-step)
    counts: dict[int, int] = {}
    for s in steps:
        counts[s["step"]] = counts.get(s["step"], 0) + 1
    finished = {s["step"] for s in steps}
    redone = sum(1 for g in gens if g["step"] < max((s["step"] for s in steps
                                                     if s["t"] < g["t"]), default=0))
    print(f"lost steps           {redone} (survivors kept every finished step in memory)"
          if redone == 0 else f"lost steps           {redone}")
    durations = [b["t"] - a["t"] for a, b in zip(steps, steps[1:])
                 if b["generation"] == a["generation"]]
    typical = statistics.median(durations) if durations else 0.0
    wall = steps[-1]["t"] - steps[0]["t"] + typical
    goodput = min(1.0, len(finished) * typical / wall) if wall > 0 else 0.0
    print(f"goodput              {goodput:.1%}  ({len(finished)} steps x {typical * 1000:.0f} ms "
          f"median step / {wall:.1f} s of training wall time)")
    ck = job.status.last_checkpoint
    if ck.uri:
        print(f"last checkpoint      step {ck.step} ({ck.size_bytes / 1e6:.1f} MB) at {ck.uri}")
    report = check_exactly_once(str(audit), num_samples=spec.data.num_samples,
                                global_batch_size=spec.data.global_batch_size,
                                last_step=job.status.step)
    verdict = ("every sample consumed exactly once" if report.ok else
               f"PROBLEM: {len(report.duplicates)} samples trained twice, {len(report.missing)} "
               f"never, steps not fully recorded: {report.missing_steps[:10]}"
               f"{' ...' if len(report.missing_steps) > 10 else ''}")
    print(f"data audit           {report.samples} samples over {report.steps} steps: {verdict}")
    print("=" * 72)


if __name__ == "__main__":
    sys.exit(main())
