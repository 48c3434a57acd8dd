"""A lost node is fenced on its peers' evidence (service/core/evidence.py), well
before its lease expires; a stopped node, whose sockets stay open, is not."""

from __future__ import annotations

import re
import signal
import time

import pytest
from cluster import AgentProcess, steps
from sbtest import wait_for
from springback.client.api import Client

SPEC = {"name": "peer-loss", "min_workers": 2, "max_workers": 3,
        "data": {"num_samples": 256, "global_batch_size": 12, "seed": 1},
        "max_steps": 100_000}

pytestmark = pytest.mark.timeout(150)


def _three_nodes(start_coordinator, tmp_path, liveness_timeout_s: float,
                 via_follower: bool = False):
    """Three one-rank agents training; with `via_follower`, two replicas and
    the agents told only the follower's address (their plan streams are
    served there, their other calls forwarded to the leader)."""
    servers = [start_coordinator(liveness_timeout_s=liveness_timeout_s)
               for _ in range(2 if via_follower else 1)]
    leader = wait_for(lambda: next((s for s in servers if s.election.is_leader()), None), 10,
                      "a coordinator to lead")
    server = next((s for s in servers if s is not leader), leader)
    client = Client(server.address)
    job = client.create_job(SPEC)
    agents = [AgentProcess(tmp_path, n, job.id, server.address) for n in ("a", "b", "c")]
    wait_for(lambda: any(r["world_size"] == 3 and r["step"] >= 3 for r in steps(tmp_path)),
             90, "three nodes training")
    return client, job.id, agents


def _world_two(client: Client, job_id: str):
    status = client.get_job(job_id).status
    return status if status.world_size == 2 else None


def _reason(client: Client, job_id: str, generation: int) -> str:
    """Why `generation` was made: its event's reason (the status message
    moves on as soon as the generation starts)."""
    _, events = client.list_job_events(job_id)
    return next(e.reason for e in events if e.generation == generation)


@pytest.mark.parametrize("via_follower", [False, True], ids=["streams-on-leader",
                                                          "streams-on-follower"])
def test_a_sigkilled_node_is_fenced_on_its_peers_word_long_before_its_lease_expires(
        start_coordinator, tmp_path, via_follower):
    client, job_id, agents = _three_nodes(start_coordinator, tmp_path, liveness_timeout_s=12,
                                          via_follower=via_follower)
    try:
        killed_at = time.monotonic()
        agents[2].signal_node(signal.SIGKILL)  # not node rank 0: the store survives
        status = wait_for(lambda: _world_two(client, job_id), 30, "a generation without it")
        fenced_s = time.monotonic() - killed_at
        assert fenced_s < 6, f"fenced after {fenced_s:.1f}s (liveness timeout 12 s)"
        why = _reason(client, job_id, status.generation)
        assert "peers:" in why and "connections reset" in why, why
        # the survivors train on at world size 2
        wait_for(lambda: any(r["world_size"] == 2 for r in steps(tmp_path)), 30,
                 "the survivors to train")
    finally:
        for agent in agents:
            agent.stop()


def test_a_peer_lost_first_on_a_subgroup_of_the_scripts_own_mesh_is_named_too(
        start_coordinator, tmp_path):
    """Two nodes of two ranks, tp=2: the script builds `gen.mesh` and ends
    each step with an all-reduce on its cross-node "replicate" subgroups, after
    a sleep. The kill lands in the sleep, so the survivors meet the reset on a
    subgroup's socket, whose address the ranks exchanged when the mesh was
    built: the node is fenced on their word, not at the liveness timeout."""
    server = start_coordinator(liveness_timeout_s=12)
    wait_for(server.election.is_leader, 10, "the coordinator to lead")
    client = Client(server.address)
    job = client.create_job({**SPEC, "min_workers": 1, "max_workers": 2, "layout": {"tp": 2}})
    env = {"TINY_MESH_REDUCE": "1", "TINY_STEP_SLEEP_S": "1.0"}
    agents = [AgentProcess(tmp_path, n, job.id, server.address, env=env, nproc=2)
              for n in ("a", "b")]
    try:
        wait_for(lambda: any(r["world_size"] == 4 and r["step"] >= 3 for r in steps(tmp_path)),
                 90, "two nodes training")
        def sleeping() -> int:  # the newest step node b's ranks announced their sleep in
            return max(map(int, re.findall(r"step (\d+) sleeping", agents[1].log())), default=0)

        announced = sleeping()
        wait_for(lambda: sleeping() > announced, 30, "node b's ranks to start a sleep")
        killed_at = time.monotonic()
        agents[1].signal_node(signal.SIGKILL)
        status = wait_for(lambda: (s := client.get_job(job.id).status).world_size == 2 and s,
                          30, "a generation without it")
        fenced_s = time.monotonic() - killed_at
        assert fenced_s < 6, f"fenced after {fenced_s:.1f}s (liveness timeout 12 s)"
        assert "peers:" in _reason(client, job.id, status.generation)
    finally:
        for agent in agents:
            agent.stop()


def test_a_stopped_node_is_not_fenced_before_its_liveness_timeout(start_coordinator, tmp_path):
    client, job_id, agents = _three_nodes(start_coordinator, tmp_path, liveness_timeout_s=4)
    try:
        stopped_at = time.monotonic()
        agents[2].signal_node(signal.SIGSTOP)  # alive, sockets open: peers only time out
        status = wait_for(lambda: _world_two(client, job_id), 40, "a generation without it")
        fenced_s = time.monotonic() - stopped_at
        assert fenced_s >= 3.5, f"a stopped node was fenced after {fenced_s:.1f}s"
        assert "liveness timeout" in _reason(client, job_id, status.generation), status
    finally:
        for agent in agents:
            agent.stop()


def test_a_crashed_rank_on_a_live_node_is_reported_by_its_peers_but_its_node_stays(
        start_coordinator, tmp_path):
    crash = {"TINY_CRASH_AT_STEP": "6", "TINY_CRASH_MARKER": str(tmp_path / "crashed")}
    server = start_coordinator(liveness_timeout_s=12)
    wait_for(server.election.is_leader, 10, "the coordinator to lead")
    client = Client(server.address)
    job = client.create_job(SPEC)
    agents = [AgentProcess(tmp_path, n, job.id, server.address, env=crash)
              for n in ("a", "b", "c")]
    try:
        members = wait_for(lambda: (s := client.get_job(job.id).status).world_size == 3
                           and set(s.members), 90, "three members")
        wait_for(lambda: (tmp_path / "crashed").exists(), 60, "the crash")
        # the crashed rank's peers saw its connection close and said so (taken,
        # or refused because the agent's own report already made a generation)...
        wait_for(lambda: any("reported lost peer" in a.log() or "report of lost peer" in a.log()
                             for a in agents), 30, "a peer's report")
        # ...but its agent is alive (plan stream open): its node keeps training
        wait_for(lambda: any(r["world_size"] == 3 and r["step"] >= 9 for r in steps(tmp_path)),
                 60, "three nodes training after the crash")
        assert set(client.get_job(job.id).status.members) == members
        assert not any("fenced" in a.log() for a in agents)
    finally:
        for agent in agents:
            agent.stop()
