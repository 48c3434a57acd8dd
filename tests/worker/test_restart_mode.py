"""Restart mode end to end: the unmodified torchrun example
(`examples/torchrun_ddp/train.py`) under `springback run` (real etcd, a real
coordinator, real agents through the CLI, gloo ranks), compared with what a
real `torchrun` gives the same script."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from sbtest import wait_for
from springback.cli.local import free_port
from springback.v1 import types_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "torchrun_ddp" / "train.py")
ENVDUMP = str(Path(__file__).parent / "envdump")
NOOP = str(Path(__file__).parent / "noop_rank.py")
STEPS, EVERY = 60, 10

# Same value for the same rank of the same world, whoever launched it.
SAME_VALUE = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE",
              "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
              "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
              "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS")
SPRINGBACK_ONLY = ("SPRINGBACK_", "GLOO_SOCKET_IFNAME")

pytestmark = pytest.mark.timeout(240)


def base_env(dump_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK"))}
    env.update(PYTHONPATH=os.pathsep.join([ENVDUMP, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               ENVDUMP_DIR=str(dump_dir), PYTHONUNBUFFERED="1")
    return env


def rank_envs(dump_dir: Path, base: dict[str, str]) -> list[dict]:
    """What each dumped rank process got on top of `base`, with its pid."""
    out = []
    for path in sorted(dump_dir.glob("env-*.json")):
        record = json.loads(path.read_text())
        added = {k: v for k, v in record["env"].items() if base.get(k) != v}
        out.append({"pid": record["pid"], "env": added})
    return out


def torchrun_reference(tmp_path: Path, run_id: str) -> list[dict]:
    """Environments real torchrun gives 2 nodes x 2 local ranks (c10d rendezvous)."""
    dump = tmp_path / "torchrun-env"
    dump.mkdir()
    env = base_env(dump)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
         "--max-restarts", "3", NOOP], env=env, stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / f"torchrun-{i}.log", "wb")) for i in range(2)]
    for node in nodes:
        assert node.wait(timeout=120) == 0, (tmp_path / "torchrun-0.log").read_text()
    envs = [r["env"] for r in rank_envs(dump, env)]
    assert sorted(e["RANK"] for e in envs) == ["0", "1", "2", "3"]
    return envs


def assert_same_as_torchrun(ours: list[dict], theirs: list[dict], restart: int) -> None:
    by_rank = {e["RANK"]: e for e in theirs}
    ports: dict[str, set[int]] = {}
    for env in ours:
        expected = dict(by_rank[env["RANK"]], TORCHELASTIC_RESTART_COUNT=str(restart))
        mine = {k: v for k, v in env.items() if not k.startswith(SPRINGBACK_ONLY)}
        assert sorted(mine) == sorted(expected), f"rank {env['RANK']}: key sets differ"
        for key in SAME_VALUE:  # absent from both when inherited unchanged (OMP_NUM_THREADS)
            assert mine.get(key) == expected.get(key), (key, mine.get(key), expected.get(key))
        assert socket.gethostbyname(mine["MASTER_ADDR"]).startswith("127.")
        ports.setdefault(mine["GROUP_RANK"], set()).add(int(mine["MASTER_PORT"]))
        assert mine["TORCHELASTIC_ERROR_FILE"].endswith(
            f"attempt_{restart}/{mine['LOCAL_RANK']}/error.json")
    # one way to the generation's store per node: its agent's forwarder to the
    # store's gate (worker/agent/storegate.py)
    assert sorted(ports) == ["0", "1"] and all(len(p) == 1 for p in ports.values()), ports


def ddp_job(client, tmp_path: Path, min_workers: int):
    return client.create_job({
        "name": "ddp", "min_workers": min_workers, "max_workers": 2,
        "data": {"num_samples": 64, "global_batch_size": 8},
        "checkpoint": {"uri": f"file://{tmp_path}/ckpt"}, "max_steps": STEPS})


def start_agent(tmp_path: Path, name: str, job_id: str, coordinator: str, env: dict[str, str],
                *extra: str) -> subprocess.Popen:
    """`springback run` of the unmodified example, its output in agent-<name>.log."""
    return subprocess.Popen(
        [sys.executable, "-m", "springback.cli", "run", "--job", job_id,
         "--coordinator", coordinator, *extra, "--", sys.executable, EXAMPLE,
         "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--step-sleep-s", "0.05"],
        env=env, stdout=open(tmp_path / f"agent-{name}.log", "wb"), stderr=subprocess.STDOUT)


class TestUnmodifiedTorchrunScript:
    @pytest.mark.parametrize("fork", [False, True], ids=["exec", "fork-server"])
    def test_runs_on_two_agents_survives_a_killed_rank_and_resumes_from_its_checkpoint(
            self, tmp_path, client, coordinator_address, fork):
        """With ``--fork-server`` every generation's ranks are forked warm:
        the same environment (each rank dumps its own), the same recovery."""
        job = ddp_job(client, tmp_path, min_workers=2)
        dump = tmp_path / "env"
        dump.mkdir()
        env = base_env(dump)
        agents = [start_agent(tmp_path, n, job.id, coordinator_address, env,
                              "--nproc-per-node", "2", "--max-restarts", "3",
                              "--fork-server" if fork else "--no-fork-server") for n in ("a", "b")]
        logs = lambda: "".join(p.read_text() for p in sorted(tmp_path.glob("agent-*.log")))  # noqa: E731
        try:
            wait_for(lambda: (s := client.get_job(job.id).status).last_checkpoint.step >= EVERY
                     and s.step >= EVERY + 5, 120, "a committed checkpoint and progress")
            first = rank_envs(dump, env)
            assert len(first) == 4
            step_at_kill = client.get_job(job.id).status.step
            victim = next(r for r in first if r["env"]["RANK"] == "3")
            os.kill(victim["pid"], signal.SIGKILL)
            done = wait_for(lambda: (j := client.get_job(job.id)).status.state
                            == pb.JOB_STATE_SUCCEEDED and j, 150, "the job to succeed")
            for agent in agents:
                assert agent.wait(60) == 0, logs()
        finally:
            for agent in agents:
                if agent.poll() is None:
                    agent.kill()
                    agent.wait()
        assert done.status.step == STEPS
        assert done.status.last_checkpoint.step == STEPS
        assert (logs().count("fork server") == 2) == fork, logs()  # one per agent, up once
        assert "start cold" not in logs()
        starts = [int(s) for s in re.findall(r"starting at step (\d+)", logs())]
        # rank 0 printed step 0 once (in either agent's log), then resumed from the
        # script's own checkpoint, not from scratch (commits land every EVERY steps)
        assert starts.count(0) == 1, logs()
        resumed = [s for s in starts if s > 0]
        assert resumed and all(EVERY <= r < STEPS and r % EVERY == 0 for r in resumed), (
            starts, step_at_kill)
        assert logs().count("reporting failure") >= 1
        # the job's status tells the truth: it restored a commit and redid steps
        assert done.status.num_restores >= 1, (done.status, logs())
        assert done.status.steps_redone >= step_at_kill - max(resumed), (done.status, logs())
        later = [r["env"] for r in rank_envs(dump, env) if r["pid"] not in {f["pid"] for f in first}]
        restarted = [e for e in later if e["TORCHELASTIC_RESTART_COUNT"] == "1"]
        assert sorted(e["RANK"] for e in restarted) == ["0", "1", "2", "3"]
        assert int(restarted[0]["SPRINGBACK_GENERATION"]) > int(first[0]["env"]["SPRINGBACK_GENERATION"])

        reference = torchrun_reference(tmp_path, run_id=job.id)
        assert_same_as_torchrun([r["env"] for r in first], reference, restart=0)
        assert_same_as_torchrun(restarted, reference, restart=1)


class TestRestartModeDrain:
    def test_a_drained_agent_leaves_and_the_other_restarts_its_ranks_from_the_checkpoint(
            self, tmp_path, client, coordinator_address):
        job = ddp_job(client, tmp_path, min_workers=1)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        agents = {n: start_agent(tmp_path, n, job.id, coordinator_address, env, "--mode",
                                 "restart", "--drain-timeout-s", "30") for n in ("a", "b")}
        log = lambda n: (tmp_path / f"agent-{n}.log").read_text()  # noqa: E731
        try:
            wait_for(lambda: (s := client.get_job(job.id).status).world_size == 2
                     and s.last_checkpoint.step >= EVERY and s.step >= EVERY + 5, 120,
                     "world 2 with a commit")
            agents["b"].send_signal(signal.SIGTERM)
            assert agents["b"].wait(60) == 0, log("b")
            done = wait_for(lambda: (j := client.get_job(job.id)).status.state
                            == pb.JOB_STATE_SUCCEEDED and j, 150, "the job to succeed")
            assert agents["a"].wait(60) == 0, log("a")
        finally:
            for agent in agents.values():
                if agent.poll() is None:
                    agent.kill()
                    agent.wait()
        assert "draining: signal SIGTERM" in log("b")
        assert done.status.step == STEPS and done.status.world_size in (0, 1)
        # whichever agent hosted rank 0 first printed step 0; a restarted alone at
        # world 1 from a commit
        assert "rank 0/2: starting at step 0" in log("a") + log("b")
        resumed = [int(s) for s in re.findall(r"rank 0/1: starting at step (\d+)", log("a"))]
        assert resumed and resumed[0] >= EVERY and resumed[0] % EVERY == 0, log("a")
