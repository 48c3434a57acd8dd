"""`springback run` under Slurm: the task an agent learns from ``SLURM_*``
(`worker/agent/slurm.py`), and a job over three nodes of a real Slurm
(tests/slurmcluster.py: slurmctld and three ``slurmd -N``) that loses one node
to an admin's ``scontrol update state=down`` (``node_lost`` in the job's
events), has one node's step signalled with SIGTERM (a cancel's or a
preemption's first signal, which reaches the ranks too: ``preempted``), or
has one node preempted by a job of a higher-priority partition
(``PreemptMode=REQUEUE``: ``preempted``), and still ends exactly once.

The real-Slurm test is marked ``slurm`` and left out of the default run
(``bash deploy/local/test.sh -m slurm`` runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from applied import check_applied
from cluster import steps
from draws import check_draws
from fakeplans import TINY_TRAIN
from sbtest import process_alive, wait_for
from slurmcluster import CRED_EXPIRE_S, FREEZER_ROOT, PREEMPT_GRACE_S, SlurmCluster, missing
from springback.cli.slurm import KeeperConfig
from springback.client.api import Client
from springback.client import env as E
from springback.service.core.membership import _member_id
from springback.v1 import types_pb2 as pb
from springback.worker.agent import slurm
from springback.worker.train.audit import check_exactly_once

NUM_SAMPLES, BATCH, MAX_STEPS = 256, 12, 60
SPEC = {"name": "tiny-slurm", "min_workers": 2, "max_workers": 3,
        "data": {"num_samples": NUM_SAMPLES, "global_batch_size": BATCH, "seed": 1},
        "max_steps": MAX_STEPS}
ENDED = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)
OPERATOR_TOKEN = "slurm-keeper-operator-token-" + "x" * 43  # 128 bits and more
SLURMD_TIMEOUT_S = 5
"""The shared cluster's ``SlurmdTimeout``: how long slurmctld waits for a
silent slurmd before it sets the node DOWN."""


class TestSlurmTaskDetection:
    def test_a_task_is_named_by_its_job_step_node_requeues_and_local_id(self):
        task = slurm.detect({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0",
                             "SLURMD_NODENAME": "gpu-7", "SLURM_RESTART_COUNT": "2",
                             "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1"})
        assert task is not None
        assert task.join_token(0) == "slurm/42.0/gpu-7/r2/t0/j0"
        assert task.join_token(1) == "slurm/42.0/gpu-7/r2/t0/j1"  # a rejoin after a fence

    def test_a_requeued_job_is_a_new_member_and_a_restarted_task_the_same(self):
        env = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "gpu-7"}
        first, again = slurm.detect(env), slurm.detect(dict(env))
        requeued = slurm.detect({**env, "SLURM_RESTART_COUNT": "1"})
        assert first and again and requeued
        assert first.join_token(0) == again.join_token(0)
        assert requeued.join_token(0) != first.join_token(0)

    def test_outside_a_job_step_there_is_no_task(self):
        assert slurm.detect({}) is None
        assert slurm.detect({"SLURM_JOB_ID": "42"}) is None  # an salloc shell on a login node

    def test_the_batch_step_and_bad_counters_still_name_a_task(self):
        task = slurm.detect({"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n1",
                             "SLURM_RESTART_COUNT": "x"})
        assert task is not None and task.join_token(0) == "slurm/42.batch/n1/r0/t0/j0"

    def test_a_long_or_odd_node_name_still_makes_a_valid_distinct_token(self):
        names = ["n" * 200 + "a", "n" * 200 + "b", "nöde"]
        tokens = {slurm.SlurmTask(job_id="1", step_id="0", node_name=n).join_token(0)
                  for n in names}
        assert len(tokens) == 3
        assert all(len(t) <= slurm.MAX_JOIN_TOKEN and t.isascii() and t.isprintable()
                   for t in tokens)

    def test_a_node_name_that_does_not_resolve_leaves_the_host_to_the_default(self):
        task = slurm.SlurmTask(job_id="1", step_id="0", node_name="no-such-node.invalid")
        assert slurm.node_address(task) is None


class TestKeeperConfig:
    def test_the_agent_command_or_a_script_is_required_not_both(self):
        with pytest.raises(ValueError, match="--script"):
            KeeperConfig(job="j", partition="spot")
        with pytest.raises(ValueError, match="not both"):
            KeeperConfig(job="j", partition="spot", agent_command=("springback", "run"),
                         script="agent.sbatch")
        assert KeeperConfig(job="j", partition="spot", script="agent.sbatch").target is None

    def test_bad_sizes_and_intervals_are_refused_naming_the_flag(self):
        command = ("springback", "run")
        for bad, flag in (({"target": 0}, "--target"), ({"poll_s": 0}, "--poll-s"),
                          ({"backoff_s": 60, "max_backoff_s": 30}, "--max-backoff-s"),
                          ({"max_submissions": -1}, "--max-submissions"),
                          ({"partition": ""}, "--partition")):
            with pytest.raises(ValueError, match=flag):
                KeeperConfig(**{"job": "j", "partition": "spot", "agent_command": command,
                                **bad})


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    """One Slurm for the module's tests (it starts in about a second)."""
    why = missing()
    if why:
        pytest.skip(why)
    # A crashed node goes DOWN ~13 s after its crash (measured), not ~28 s (10).
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), slurmd_timeout_s=SLURMD_TIMEOUT_S)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _srun_agents(slurm_cluster: SlurmCluster, root: Path, job_id: str, coordinator: str,
                 node: str | None = None) -> subprocess.Popen:
    """One agent per Slurm node, as a user's sbatch script runs them: a lost
    node (``--no-kill``) does not take the step down. With `node`, one Slurm
    job of one step on that node only (so it can be signalled alone)."""
    env = dict(slurm_cluster.env, **{
        E.AUDIT_DIR: str(root / "audit"), E.METRICS_FILE: str(root / "metrics.jsonl"),
        "TINY_STEP_SLEEP_S": "0.1", "PYTHONUNBUFFERED": "1"})
    env.pop("SPRINGBACK_HOST", None)
    where = [f"-N{len(slurm_cluster.nodes)}"] if node is None else ["-N1", f"-w{node}"]
    return subprocess.Popen(
        ["srun", "--no-kill", *where, "--ntasks-per-node=1",
         "--job-name=springback-agents", f"--output={root}/agent-{node or '%t'}.log",
         sys.executable, "-m", "springback.worker.agent", "--job", job_id,
         "--coordinator", coordinator, "--drain-timeout-s", "30",
         "--", sys.executable, TINY_TRAIN],
        env=env, cwd=root, stdout=open(root / f"srun-{node or 'all'}.log", "ab"),  # noqa: SIM115
        stderr=subprocess.STDOUT)


def _departure(coordinator: str, job_id: str, member: str,
               *options: str) -> tuple[str, str]:
    """The kind and reason of the generation that left `member` out after it
    had trained, as ``springback job events --json`` prints them (`options`:
    more global options, e.g. ``--token-file``)."""
    out = subprocess.run([sys.executable, "-m", "springback.cli", "--coordinator", coordinator,
                          *options, "--json", "job", "events", job_id],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    generations = json.loads(out.stdout)["generations"]
    was_in = next(i for i, g in enumerate(generations) if member in g["members"])
    left = next(g for g in generations[was_in:] if member not in g["members"])
    return left["kind"], left["reason"]


DRAINED_EXIT = 143
"""The agents' ``--drained-exit-code`` in the requeueing script (`REQUEUE_ON_DRAIN`)."""

REQUEUE_ON_DRAIN = (f'; rc=$?; if [ "$rc" -eq {DRAINED_EXIT} ]; then '
                    'scontrol requeue "$SLURM_JOB_ID"; fi; exit "$rc"')
"""What follows the agent's ``srun`` in a batch script that comes back after a
preemption (docs/slurm.md): Slurm requeues a preempted job only when it
outlives the grace, and a drained agent ends it inside the grace, so the
script requeues its own job when the agent says it drained."""


def _sbatch_agent(slurm_cluster: SlurmCluster, root: Path, job_id: str, coordinator: str,
                  node: str, token: str | None = None, *, requeue: bool = False,
                  slurm_requeue: bool = True) -> str:
    """A requeueable batch job on `node` in partition ``test`` whose script
    runs one agent by ``srun``, as a user's sbatch script does (`token`: the
    agent's ``$SPRINGBACK_TOKEN``); its Slurm job id. With `requeue`, the
    script requeues its job after a drain (`REQUEUE_ON_DRAIN`) and each run
    appends to ``agent-NODE.log``. Without `slurm_requeue` the job is
    ``--no-requeue``: a node failure ends it (NODE_FAIL) instead of requeueing
    it (Slurm's default, ``JobRequeue=1``)."""
    env = dict(slurm_cluster.env, **{
        E.AUDIT_DIR: str(root / "audit"), E.METRICS_FILE: str(root / "metrics.jsonl"),
        "TINY_STEP_SLEEP_S": "0.1", "PYTHONUNBUFFERED": "1"})
    env.pop("SPRINGBACK_HOST", None)
    env.pop(E.TOKEN, None)
    if token:
        env[E.TOKEN] = token
    agent = (f"srun --no-kill -N1 --ntasks-per-node=1 --output={root}/agent-{node}.log "
             + ("--open-mode=append " if requeue else "")
             + f"{sys.executable} -m springback.worker.agent --job {job_id} "
             f"--coordinator {coordinator} --drain-timeout-s {PREEMPT_GRACE_S} "
             + (f"--drained-exit-code {DRAINED_EXIT} " if requeue else "")
             + f"-- {sys.executable} {TINY_TRAIN}" + (REQUEUE_ON_DRAIN if requeue else ""))
    out = subprocess.run(["sbatch", "--parsable",
                          "--requeue" if slurm_requeue else "--no-requeue", "-ptest", "-N1", f"-w{node}",
                          "--job-name=springback-agents", f"--output={root}/batch-{node}.log",
                          "--open-mode=append", f"--wrap={agent}"],
                         env=env, cwd=root, capture_output=True, text=True, timeout=10, check=True)
    return out.stdout.strip().split(";")[0]


def _audit(root: Path, last_step: int = MAX_STEPS) -> None:
    """The exactly-once audits of a job that ran `last_step` steps."""
    applied = check_applied(root / "audit", num_samples=NUM_SAMPLES, global_batch_size=BATCH,
                            seed=SPEC["data"]["seed"], last_step=last_step)
    assert applied.ok, applied
    draws = check_draws(root / "audit")
    assert draws.ok, draws
    report = check_exactly_once(str(root / "audit"), num_samples=NUM_SAMPLES,
                                global_batch_size=BATCH, last_step=last_step)
    assert report.ok, report


class TestRanksUnderSlurm:
    @pytest.mark.timeout(60)
    def test_a_rank_ignores_sigterm_yet_dies_with_its_agent(self):
        """Slurm's SIGTERM reaches every process of the step: a rank started
        with ``ignore_sigterm`` survives it, and still dies by the parent-death
        SIGKILL when its agent is SIGKILLed (never an orphan)."""
        rank = ("import os,signal,sys; os.kill(os.getpid(), signal.SIGTERM); "
                "print('survived', flush=True); sys.stdin.read()")
        agent = subprocess.Popen(
            [sys.executable, "-c",
             "import subprocess,sys; from springback.worker.agent.rankprocess import with_parent_death;"
             f"c = subprocess.Popen(with_parent_death([sys.executable, '-c', {rank!r}],"
             " ignore_sigterm=True)); print(c.pid, flush=True); c.wait()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert agent.stdout is not None
            lines = {agent.stdout.readline().strip() for _ in range(2)}
            assert "survived" in lines, lines  # a SIGTERM did not end it
            rank_pid = int(next(line for line in lines if line.isdigit()))
            agent.kill()
            agent.wait(timeout=10)
            wait_for(lambda: not process_alive(rank_pid), 20, "the orphaned rank to die")
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait(timeout=10)


def _agent_log(root: Path, node: str) -> str:
    """The log of the agent that ran on Slurm node `node` (it names its node)."""
    for path in root.glob("agent-*.log"):
        text = path.read_text(errors="replace")
        if f" on node {node} " in text:
            return text
    raise AssertionError(f"no agent log names node {node}")


@pytest.mark.slurm
class TestUnderSlurm:
    @pytest.mark.timeout(240)
    def test_a_node_set_down_by_the_admin_leaves_the_others_to_finish_exactly_once(
            self, slurm_cluster, client, coordinator_address, tmp_path):
        created = client.create_job(SPEC)
        srun = _srun_agents(slurm_cluster, tmp_path, created.id, coordinator_address)
        try:
            slurm_job = wait_for(lambda: slurm_cluster.jobs()[:1], 20, "the Slurm job")[0]
            # Every agent joined under its Slurm task's name.
            expected = {_member_id(created.id, slurm.SlurmTask(
                job_id=slurm_job, step_id="0", node_name=n).join_token(0))
                for n in slurm_cluster.nodes}
            wait_for(lambda: any(r["world_size"] == 3 and r["step"] >= 10
                                 for r in steps(tmp_path)), 90, "world size 3 at step 10")
            assert set(client.get_job(created.id).status.members) == expected
            lost = _member_id(created.id, slurm.SlurmTask(
                job_id=slurm_job, step_id="0", node_name="node3").join_token(0))
            logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("agent-*.log"))
            assert logs.count("running under Slurm") == 3, logs
            before = max(r["step"] for r in steps(tmp_path))

            slurm_cluster.set_down("node3")  # its task gets SIGKILL at once

            job = wait_for(lambda: (j := client.get_job(created.id)).status.state in ENDED
                           and j, 120, "the job to end")
            assert job.status.state == pb.JOB_STATE_SUCCEEDED, job.status.message
            assert job.status.step == MAX_STEPS
            kind, reason = _departure(coordinator_address, created.id, lost)
            assert kind == "node_lost", (kind, reason)  # a failure, not a preemption
            srun.wait(timeout=60)  # every agent ended: the ranks wrote their audit
            for node in ("node1", "node2"):  # the survivors ended as agents do
                assert "all local ranks finished" in _agent_log(tmp_path, node)
            after = [r for r in steps(tmp_path) if r["world_size"] == 2 and r["step"] > before]
            assert after, "no step ran with the two survivors"
            _audit(tmp_path)
        finally:
            if srun.poll() is None:
                srun.kill()
                srun.wait(timeout=10)
            try:  # the next test of the module gets three idle nodes again
                for job in slurm_cluster.jobs():
                    slurm_cluster.run("scancel", job)
                if slurm_cluster.node_states().get("node3", "").startswith("down"):
                    slurm_cluster.run("scontrol", "update", "nodename=node3", "state=resume")
            except subprocess.SubprocessError as e:
                print(f"Slurm not reset after the test: {e}")

    @pytest.mark.timeout(240)
    def test_a_node_whose_step_slurm_signals_drains_and_the_others_finish_exactly_once(
            self, slurm_cluster, client, coordinator_address, tmp_path):
        """``scancel --signal=TERM JOB.STEP`` (what a preemption or a cancel
        sends first) reaches the agent and its ranks alike: the agent drains
        (its reason names Slurm, the step, the node and the signal; the job's
        events record the departure as ``preempted``), its ranks
        leave at a step boundary instead of dying of the SIGTERM (no failure
        reported), and the other two nodes finish the job exactly once."""
        created = client.create_job(SPEC)
        sruns = {n: _srun_agents(slurm_cluster, tmp_path, created.id, coordinator_address, n)
                 for n in slurm_cluster.nodes}
        try:
            wait_for(lambda: any(r["world_size"] == 3 and r["step"] >= 10
                                 for r in steps(tmp_path)), 90, "world size 3 at step 10")
            on_node = dict(reversed(line.split()) for line in slurm_cluster.run(
                "squeue", "-h", "-o", "%i %N").splitlines() if line.strip())
            before = max(r["step"] for r in steps(tmp_path))

            slurm_cluster.run("scancel", "--signal=TERM", f"{on_node['node3']}.0")

            job = wait_for(lambda: (j := client.get_job(created.id)).status.state in ENDED
                           and j, 120, "the job to end")
            assert job.status.state == pb.JOB_STATE_SUCCEEDED, job.status.message
            assert job.status.step == MAX_STEPS
            assert job.status.num_failures == 0  # the drained ranks did not crash
            _, events = client.list_job_events(created.id)
            reason = (f"draining: Slurm sent SIGTERM to job {on_node['node3']} step 0 "
                      "on node node3")
            assert any(reason in e.reason for e in events), [e.reason for e in events]
            drained_member = _member_id(created.id, slurm.SlurmTask(
                job_id=on_node["node3"], step_id="0", node_name="node3").join_token(0))
            kind, why = _departure(coordinator_address, created.id, drained_member)
            assert kind == "preempted" and reason in why, (kind, why)
            for srun in sruns.values():  # every agent ended: the ranks wrote their audit
                srun.wait(timeout=60)
            assert sruns["node3"].returncode == 0  # a drain, not a failure
            drained = _agent_log(tmp_path, "node3")
            assert "every local rank left at a step boundary" in drained, drained
            for node in ("node1", "node2"):
                assert "all local ranks finished" in _agent_log(tmp_path, node)
            after = [r for r in steps(tmp_path) if r["world_size"] == 2 and r["step"] > before]
            assert after, "no step ran with the two survivors"
            _audit(tmp_path)
        finally:
            for srun in sruns.values():
                if srun.poll() is None:
                    srun.kill()
                    srun.wait(timeout=10)
            try:  # the next test of the module gets three idle nodes again
                for slurm_job in slurm_cluster.jobs():
                    slurm_cluster.run("scancel", slurm_job)
            except subprocess.SubprocessError as e:
                print(f"Slurm not reset after the test: {e}")

    @pytest.mark.timeout(120)
    def test_a_node_preempted_by_a_higher_priority_partition_drains_and_the_others_finish(
            self, slurm_cluster, client, coordinator_address, tmp_path):
        """A real preemption: the agents run as one requeueable batch job per
        node in partition ``test``; a job submitted to partition ``high`` on
        node3 makes Slurm preempt that node's job (``PreemptMode=REQUEUE``,
        SIGTERM, then SIGKILL after ``GraceTime``). Its agent drains within
        the grace (its ranks leave at a step boundary), the job's events
        record ``preempted``, Slurm gives node3 to the ``high`` job (the
        preempted batch job ended with its drain, inside the grace), and the
        other two nodes finish the job exactly once."""
        last_step = 120  # long enough that Slurm's preemption lands mid-job
        created = client.create_job({**SPEC, "max_steps": last_step})
        on_node = {n: _sbatch_agent(slurm_cluster, tmp_path, created.id, coordinator_address, n)
                   for n in slurm_cluster.nodes}
        try:
            wait_for(lambda: any(r["world_size"] == 3 and r["step"] >= 10
                                 for r in steps(tmp_path)), 60, "world size 3 at step 10")
            before = max(r["step"] for r in steps(tmp_path))

            high = slurm_cluster.run("sbatch", "--parsable", "-phigh", "-N1", "-wnode3",
                                     "--job-name=high-priority", "--wrap=sleep 300",
                                     f"--output={tmp_path}/high.log").strip().split(";")[0]

            job = wait_for(lambda: (j := client.get_job(created.id)).status.state in ENDED
                           and j, 90, "the job to end")
            assert job.status.state == pb.JOB_STATE_SUCCEEDED, job.status.message
            assert job.status.step == last_step
            assert job.status.num_failures == 0  # a preemption is no failure
            preempted = _member_id(created.id, slurm.SlurmTask(
                job_id=on_node["node3"], step_id="0", node_name="node3").join_token(0))
            kind, why = _departure(coordinator_address, created.id, preempted)
            assert kind == "preempted", (kind, why)
            assert f"Slurm sent SIGTERM to job {on_node['node3']} step 0 on node node3" in why
            drained = _agent_log(tmp_path, "node3")
            assert "every local rank left at a step boundary" in drained, drained
            # Slurm gave the node to the higher-priority job.
            wait_for(lambda: slurm_cluster.run("squeue", "-h", "-j", high, "-o", "%T").strip()
                     == "RUNNING", 30, "the high-priority job to run on node3")
            for node in ("node1", "node2"):
                wait_for(lambda n=node: "all local ranks finished" in _agent_log(tmp_path, n),
                         30, f"the agent on {node} to finish")
            wait_for(lambda: not {on_node["node1"], on_node["node2"]} & set(slurm_cluster.jobs()),
                     30, "the survivors' Slurm jobs to end")  # their ranks wrote their audit
            after = [r for r in steps(tmp_path) if r["world_size"] == 2 and r["step"] > before]
            assert after, "no step ran with the two survivors"
            _audit(tmp_path, last_step)
        finally:
            try:  # the next test of the module gets three idle nodes again
                for slurm_job in slurm_cluster.jobs():
                    slurm_cluster.run("scancel", slurm_job)
                wait_for(lambda: not slurm_cluster.jobs(), 30, "Slurm's jobs to end")
            except (AssertionError, subprocess.SubprocessError) as e:
                print(f"Slurm not reset after the test: {e}")


def _member(job_id: str, slurm_job: str, node: str, restarts: int = 0) -> str:
    """The member id of the agent of Slurm job `slurm_job` (step 0) on `node`
    in its run after `restarts` requeues."""
    return _member_id(job_id, slurm.SlurmTask(job_id=slurm_job, step_id="0", node_name=node,
                                              restart_count=restarts).join_token(0))


def _reset(slurm_cluster: SlurmCluster) -> None:
    """Cancels what the test left in Slurm, so the next test gets idle nodes."""
    try:
        for slurm_job in slurm_cluster.jobs():
            slurm_cluster.run("scancel", slurm_job)
        wait_for(lambda: not slurm_cluster.jobs(), 30, "Slurm's jobs to end")
    except (AssertionError, subprocess.SubprocessError) as e:
        print(f"Slurm not reset after the test: {e}")


@pytest.mark.slurm
class TestRequeuedAfterPreemption:
    """Agents whose batch script requeues its job after a drain
    (`REQUEUE_ON_DRAIN`): a preempted node's job runs again (Slurm holds it
    ``cred_expire``, `CRED_EXPIRE_S` here) once the node frees, with
    ``SLURM_RESTART_COUNT`` 1, and its agent joins as a new member."""

    @pytest.mark.timeout(180)
    def test_a_preempted_node_s_requeued_job_rejoins_as_a_new_member_when_the_node_frees(
            self, slurm_cluster, client, coordinator_address, tmp_path):
        wait_for(lambda: slurm_cluster.idle_nodes() == set(slurm_cluster.nodes), 30,
                 "three idle Slurm nodes")
        last_step = 800  # the requeued agent joins ~30 s after the preemption (~250 steps)
        created = client.create_job({**SPEC, "max_steps": last_step})
        on_node = {n: _sbatch_agent(slurm_cluster, tmp_path, created.id, coordinator_address, n,
                                    requeue=True)
                   for n in slurm_cluster.nodes}
        try:
            wait_for(lambda: any(r["world_size"] == 3 and r["step"] >= 10
                                 for r in steps(tmp_path)), 60, "world size 3 at step 10")
            preempted = _member(created.id, on_node["node3"], "node3")
            requeued = _member(created.id, on_node["node3"], "node3", restarts=1)
            # A short high-priority job: node3 frees again when it ends.
            slurm_cluster.run("sbatch", "--parsable", "-phigh", "-N1", "-wnode3",
                              "--job-name=high-priority", "--wrap=sleep 3",
                              f"--output={tmp_path}/high.log")
            wait_for(lambda: requeued in client.get_job(created.id).status.members, 90,
                     "the requeued job's agent to join")
            rejoined_at = max(r["step"] for r in steps(tmp_path))

            job = wait_for(lambda: (j := client.get_job(created.id)).status.state in ENDED
                           and j, 120, "the job to end")
            assert job.status.state == pb.JOB_STATE_SUCCEEDED, job.status.message
            assert job.status.step == last_step
            assert job.status.num_failures == 0  # a preemption is no failure
            kind, why = _departure(coordinator_address, created.id, preempted)
            assert kind == "preempted", (kind, why)
            log = (tmp_path / "agent-node3.log").read_text(errors="replace")  # both runs
            assert "every local rank left at a step boundary" in log, log
            assert "on node node3 (requeued 1 times" in log, log
            _, events = client.list_job_events(created.id)
            joined = [e for e in events if requeued in e.members]
            assert joined and joined[0].world_size == 3, [
                (e.generation, e.kind, list(e.members)) for e in events]
            assert preempted not in joined[0].members  # a new member, not the old one
            trained = {r["step"] for r in steps(tmp_path)
                       if r["world_size"] == 3 and r["generation"] >= joined[0].generation}
            assert trained and max(trained) > rejoined_at, "the rejoined node did not train"
            wait_for(lambda: not set(on_node.values()) & set(slurm_cluster.jobs()), 30,
                     "the agents' Slurm jobs to end")  # their ranks wrote their audit
            _audit(tmp_path, last_step)
        finally:
            _reset(slurm_cluster)

    @pytest.mark.timeout(180)
    def test_every_node_preempted_at_once_drains_to_a_commit_and_resumes_from_it(
            self, slurm_cluster, client, coordinator_address, tmp_path):
        """One high-priority job takes all three nodes: every agent drains
        within the grace (its ranks leave at a step boundary, before Slurm's
        SIGKILL), the drain writes a checkpoint (the interval is longer than
        the job: the drain alone asked for it), every departure is
        ``preempted``, and the requeued jobs' agents, new members, restore
        that commit: the first step they train is the commit's step + 1,
        nothing redone, exactly once."""
        wait_for(lambda: slurm_cluster.idle_nodes() == set(slurm_cluster.nodes), 30,
                 "three idle Slurm nodes")
        last_step = 150
        created = client.create_job({
            **SPEC, "max_steps": last_step,
            "checkpoint": {"uri": f"file://{tmp_path}/ckpt", "every_steps": 1000}})
        on_node = {n: _sbatch_agent(slurm_cluster, tmp_path, created.id, coordinator_address, n,
                                    requeue=True)
                   for n in slurm_cluster.nodes}
        try:
            wait_for(lambda: any(r["world_size"] == 3 and r["step"] >= 10
                                 for r in steps(tmp_path)), 60, "world size 3 at step 10")
            preempted_at = time.monotonic()
            slurm_cluster.run("sbatch", "--parsable", "-phigh", f"-N{len(slurm_cluster.nodes)}",
                              "--job-name=high-priority", "--wrap=sleep 3",
                              f"--output={tmp_path}/high.log")
            commit = wait_for(lambda: client.list_checkpoints(created.id)[:1], 60,
                              "the drain checkpoint")[0]
            print(f"drain commit at step {commit.step} "
                  f"{time.monotonic() - preempted_at:.1f}s after the preemption's submission")
            requeued = {_member(created.id, on_node[n], n, restarts=1) for n in on_node}

            job = wait_for(lambda: (j := client.get_job(created.id)).status.state in ENDED
                           and j, 150, "the job to end")
            assert job.status.state == pb.JOB_STATE_SUCCEEDED, job.status.message
            assert job.status.step == last_step
            assert job.status.num_failures == 0  # a preemption is no failure
            for node, slurm_job in on_node.items():
                kind, why = _departure(coordinator_address, created.id,
                                       _member(created.id, slurm_job, node))
                assert kind == "preempted", (node, kind, why)
                log = (tmp_path / f"agent-{node}.log").read_text(errors="replace")  # both runs
                assert "every local rank left at a step boundary" in log, log  # in the grace
                assert f"on node {node} (requeued 1 times" in log, log
            _, events = client.list_job_events(created.id)
            resumed = next(e for e in events if requeued & set(e.members))
            assert resumed.restore == pb.RESTORE_KIND_CHECKPOINT, resumed
            # the ranks' own drain checkpoint (`commit`, at the first boundary
            # where they saw the drain) or, when they trained on, the last
            # holder's at the step it stopped: the newest, which is restored
            assert resumed.start_step >= commit.step and resumed.steps_redone == 0, resumed
            records = steps(tmp_path)
            before = [r["step"] for r in records if r["generation"] < resumed.generation]
            after = [r["step"] for r in records if r["generation"] >= resumed.generation]
            assert max(before) == resumed.start_step  # a drain committed the last step run
            assert min(after) == resumed.start_step + 1  # nothing redone, nothing skipped
            wait_for(lambda: not set(on_node.values()) & set(slurm_cluster.jobs()), 30,
                     "the agents' Slurm jobs to end")  # their ranks wrote their audit
            _audit(tmp_path, last_step)
        finally:
            _reset(slurm_cluster)


def _keeper(slurm_cluster: SlurmCluster, root: Path, job_id: str, coordinator: str,
            token_file: Path | None = None) -> subprocess.Popen:
    """``springback slurm keep`` for `job_id` with the operator's token file:
    replacement agents go to partition ``test`` as one-node batch jobs
    running the agent command of `_sbatch_agent` (their output in
    ``agent-keeper-JOB.log``; their token the job's join credential, which
    the keeper issues). A back-off longer than the test, so a second round
    would be a bug."""
    env = dict(slurm_cluster.env, **{
        E.AUDIT_DIR: str(root / "audit"), E.METRICS_FILE: str(root / "metrics.jsonl"),
        "TINY_STEP_SLEEP_S": "0.1", "PYTHONUNBUFFERED": "1"})
    env.pop("SPRINGBACK_HOST", None)
    env.pop(E.TOKEN, None)
    return subprocess.Popen(
        [sys.executable, "-m", "springback.cli", "--coordinator", coordinator,
         *(["--token-file", str(token_file)] if token_file else []), "slurm", "keep", "--job", job_id, "--partition", "test", "--poll-s", "0.5",
         "--backoff-s", "300", "--max-submissions", "2",
         f"--sbatch-arg=--output={root}/agent-keeper-%j.log",
         "--", sys.executable, "-m", "springback.worker.agent", "--job", job_id,
         "--coordinator", coordinator, "--drain-timeout-s", str(PREEMPT_GRACE_S),
         "--", sys.executable, TINY_TRAIN],
        env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slurm
class TestKeepingTheJobAtSize:
    @pytest.mark.timeout(150)
    def test_the_keeper_submits_a_replacement_for_a_killed_node_and_it_joins(
            self, slurm_cluster, start_coordinator, tmp_path):
        """Three one-node batch jobs run the agents; node3's is killed
        (``scancel --signal=KILL JOB.0``: agent and ranks gone at once, a
        crash's ``node_lost``; its batch script ends, so the node frees). ``springback slurm keep`` sees two live members of
        ``max_workers`` three, submits one agent job to partition ``test``
        (it runs on the freed node3), its agent joins as a new member and
        trains with the survivors, the job ends SUCCEEDED exactly once, and
        the keeper stops with it, having submitted exactly once. The
        coordinator has a token: the keeper reads the job with the operator's
        token file, and the agents join with the job's join credential."""
        server = start_coordinator(token=OPERATOR_TOKEN)
        wait_for(server.election.is_leader, 10, "the coordinator to become leader")
        coordinator_address = server.address
        token_file = tmp_path / "operator-token"
        token_file.write_text(OPERATOR_TOKEN + "\n")
        token_file.chmod(0o600)
        client = Client(server.address, token=OPERATOR_TOKEN)
        # A node the previous test freed may still be completing: Slurm's
        # builtin scheduler would start its job only at the next event.
        wait_for(lambda: slurm_cluster.idle_nodes() == set(slurm_cluster.nodes), 30,
                 "three idle Slurm nodes")
        last_step = 300  # the replacement joins ~15 s after the kill: room for a slow start
        created = client.create_job({**SPEC, "max_steps": last_step})
        credential = client.issue_join_credential(created.id)
        on_node = {n: _sbatch_agent(slurm_cluster, tmp_path, created.id, coordinator_address, n,
                                    token=credential)
                   for n in slurm_cluster.nodes}
        keeper = None
        try:
            wait_for(lambda: any(r["world_size"] == 3 and r["step"] >= 10
                                 for r in steps(tmp_path)), 60, "world size 3 at step 10")
            keeper = _keeper(slurm_cluster, tmp_path, created.id, coordinator_address,
                             token_file)
            lost = _member_id(created.id, slurm.SlurmTask(
                job_id=on_node["node3"], step_id="0", node_name="node3").join_token(0))

            before = max(r["step"] for r in steps(tmp_path))
            # The agent's step: its agent and ranks get SIGKILL (a crash, never a drain).
            slurm_cluster.run("scancel", "--signal=KILL", f"{on_node['node3']}.0")

            job = wait_for(lambda: (j := client.get_job(created.id)).status.state in ENDED
                           and j, 100, "the job to end")
            assert job.status.state == pb.JOB_STATE_SUCCEEDED, job.status.message
            assert job.status.step == last_step
            out, _ = keeper.communicate(timeout=30)  # it stops when the job ends
            print(out)  # its decisions
            assert keeper.returncode == 0, out
            submitted = [line.rsplit("submitted Slurm job ", 1)[1].split()[0]
                         for line in out.splitlines() if "submitted Slurm job " in line]
            assert len(submitted) == 1, out  # one node short, one submission
            assert "live 2/3" in out and "ended SUCCEEDED" in out, out
            kind, _ = _departure(coordinator_address, created.id, lost,
                                 "--token-file", str(token_file))
            assert kind == "node_lost", kind
            # The replacement ran on the freed node and joined as a new member.
            replacement = _member_id(created.id, slurm.SlurmTask(
                job_id=submitted[0], step_id="0", node_name="node3").join_token(0))
            _, events = client.list_job_events(created.id)
            joined = [e for e in events if replacement in e.members]
            assert joined and joined[0].world_size == 3, [
                (e.generation, list(e.members)) for e in events]
            assert lost not in joined[0].members
            after = [r["world_size"] for r in steps(tmp_path) if r["step"] > before]
            assert 2 in after, "the survivors did not train on while the job was short"
            assert 3 in after, "no step ran with the replacement"
            wait_for(lambda: not ({*submitted, on_node["node1"], on_node["node2"]}
                                  & set(slurm_cluster.jobs())), 30, "the agents' Slurm jobs to end")
            _audit(tmp_path, last_step)
        finally:
            if keeper is not None and keeper.poll() is None:
                keeper.kill()
                keeper.wait(timeout=10)
            client.close()
            try:  # the next test of the module gets three idle nodes again
                for slurm_job in slurm_cluster.jobs():
                    slurm_cluster.run("scancel", slurm_job)
                wait_for(lambda: not slurm_cluster.jobs(), 30, "Slurm's jobs to end")
            except (AssertionError, subprocess.SubprocessError) as e:
                print(f"Slurm not reset after the test: {e}")


def _comm_and_args(pid: int) -> str:
    """Process `pid`'s command line ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


@pytest.mark.slurm
class TestNodeCrash:
    @pytest.mark.timeout(180)
    def test_a_crashed_node_is_lost_the_others_train_on_and_the_keeper_s_replacement_joins(
            self, slurm_cluster, client, coordinator_address, tmp_path):
        """Node3 crashes as a whole: every process in its slurmd's cgroup
        (slurmd, slurmstepd, the batch script, srun, the agent, its rank)
        SIGKILLed at one instant (tests/slurmcluster.py `crash`). The
        survivors train on with the state in memory (no checkpoint is
        configured); the coordinator drops the member long before Slurm sets
        node3 DOWN (``SlurmdTimeout``); the departure is ``node_lost``. The
        keeper's replacement job waits PENDING (no free node) until node3's
        slurmd is started again (the node rebooted: ``ReturnToService=2``
        makes it idle), then runs there and joins as a new member; the job
        ends SUCCEEDED exactly once and the keeper submitted once. The agents'
        jobs are ``--no-requeue``, so the crashed node's job ends (NODE_FAIL)
        rather than coming back beside the replacement (docs/slurm.md, Limits)."""
        if slurm_cluster.cgroup is None:
            pytest.skip(f"no cgroup v1 freezer hierarchy at {FREEZER_ROOT} to crash a node in")
        wait_for(lambda: slurm_cluster.idle_nodes() == set(slurm_cluster.nodes), 30,
                 "three idle Slurm nodes")
        last_step = 600  # the replacement joins ~25-35 s after the crash
        created = client.create_job({**SPEC, "max_steps": last_step})
        on_node = {n: _sbatch_agent(slurm_cluster, tmp_path, created.id, coordinator_address, n,
                                    slurm_requeue=False)
                   for n in slurm_cluster.nodes}
        keeper = None
        try:
            wait_for(lambda: any(r["world_size"] == 3 and r["step"] >= 10
                                 for r in steps(tmp_path)), 60, "world size 3 at step 10")
            keeper = _keeper(slurm_cluster, tmp_path, created.id, coordinator_address)
            lost = _member(created.id, on_node["node3"], "node3")
            on_node3 = {pid: _comm_and_args(pid) for pid in slurm_cluster.group_pids("node3")}
            assert any("springback.worker.agent" in c for c in on_node3.values()), on_node3
            assert any(TINY_TRAIN in c and "springback.worker.agent" not in c
                       for c in on_node3.values()), on_node3  # its rank
            assert any(c.startswith("slurmd ") for c in on_node3.values()), on_node3
            before = max(r["step"] for r in steps(tmp_path))

            crashed_at = time.monotonic()
            killed = slurm_cluster.crash("node3")

            assert set(on_node3) <= set(killed), (on_node3, killed)
            wait_for(lambda: lost not in client.get_job(created.id).status.members, 30,
                     "the coordinator to drop the crashed node's member")
            dropped_s = time.monotonic() - crashed_at
            assert slurm_cluster.node_states()["node3"] != "down", "Slurm noticed first"
            wait_for(lambda: slurm_cluster.node_states()["node3"].startswith("down"), 60,
                     "Slurm to set node3 DOWN")
            down_s = time.monotonic() - crashed_at
            print(f"member dropped {dropped_s:.1f}s, node3 DOWN {down_s:.1f}s after the crash")
            job = client.get_job(created.id)
            assert job.status.state not in ENDED, "the job ended before node3 came back"
            slurm_cluster.restart("node3")  # the node rebooted

            job = wait_for(lambda: (j := client.get_job(created.id)).status.state in ENDED
                           and j, 120, "the job to end")
            assert job.status.state == pb.JOB_STATE_SUCCEEDED, job.status.message
            assert job.status.step == last_step
            out, _ = keeper.communicate(timeout=30)  # it stops when the job ends
            print(out)
            assert keeper.returncode == 0, out
            submitted = [line.rsplit("submitted Slurm job ", 1)[1].split()[0]
                         for line in out.splitlines() if "submitted Slurm job " in line]
            assert len(submitted) == 1, out
            assert "still PENDING" in out, out  # it waited for a free node
            kind, why = _departure(coordinator_address, created.id, lost)
            assert kind == "node_lost", (kind, why)
            replacement = _member(created.id, submitted[0], "node3")
            _, events = client.list_job_events(created.id)
            left = next(e for e in events if e.world_size == 2)
            assert left.restore == pb.RESTORE_KIND_PEERS, left  # the state from memory
            joined = [e for e in events if replacement in e.members]
            assert joined and joined[0].world_size == 3, [
                (e.generation, list(e.members)) for e in events]
            after = [r["world_size"] for r in steps(tmp_path) if r["step"] > before]
            assert 2 in after, "the survivors did not train on"
            assert 3 in after, "no step ran with the replacement"
            wait_for(lambda: not ({*submitted, on_node["node1"], on_node["node2"]}
                                  & set(slurm_cluster.jobs())), 30, "the agents' Slurm jobs to end")
            _audit(tmp_path, last_step)
        finally:
            if keeper is not None and keeper.poll() is None:
                keeper.kill()
                keeper.wait(timeout=10)
            try:  # the node up again, for the next test
                slurm_cluster.restart("node3")
            except AssertionError:
                pass  # it runs
            _reset(slurm_cluster)


@pytest.mark.slurm
class TestSlurmDemo:
    @pytest.mark.timeout(300)
    def test_demo_slurm_trains_through_a_preemption_and_a_crash_and_leaves_nothing(
            self, tmp_path):
        """``deploy/local/demo.py --slurm`` end to end (its own Slurm,
        etcd, coordinators and sbatch agents; 300 steps): node3 preempted,
        node2 crashed, the job SUCCEEDED with every sample exactly once, both
        kinds in its events, and nothing left in its cgroups afterwards."""
        why = missing()
        if why:
            pytest.skip(why)
        root = Path(__file__).resolve().parents[2]
        state = tmp_path / "demo"
        out = subprocess.run(
            [sys.executable, str(root / "deploy" / "local" / "demo.py"), "--slurm",
             "--max-steps", "300", "--state-dir", str(state)],
            capture_output=True, text=True, timeout=280, check=False)
        print(out.stdout[-6000:], out.stderr[-3000:])
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "JOB_STATE_SUCCEEDED at step 300" in out.stdout
        assert "PREEMPT node3" in out.stdout
        events = out.stdout.split("job events", 1)[1].split("recovery", 1)[0]
        assert " preempted " in events and " node_lost " in events, events
        assert "every sample consumed exactly once" in out.stdout
        left = SlurmCluster(state / "slurm")
        assert left.cgroup is None or not left.cgroup.exists(), "processes left in its cgroups"
