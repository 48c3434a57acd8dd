"""A fenced node rejoins with a fresh member credential (issue 44), end to
end: real etcd, a coordinator with a token, real node agents and gloo ranks.
The stopped node's old credential is revoked by its fence; on waking, its
agent is refused UNAUTHENTICATED, takes that as the fence, joins again as a
new member with a new credential, and the job ends SUCCEEDED."""

from __future__ import annotations

import signal

import grpc
import pytest
from cluster import AgentProcess, steps
from sbtest import OPERATOR_TOKEN, ranks_of, wait_for
from springback.client.api import Client
from springback.client import env as E
from springback.client.channel import connect
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

pytestmark = pytest.mark.timeout(180)

TOKEN = OPERATOR_TOKEN
SPEC = {"name": "tiny", "min_workers": 2, "max_workers": 3,
        "data": {"num_samples": 240, "global_batch_size": 12, "seed": 3}, "max_steps": 60}


def _rank_credential(agent_pid: int) -> str:
    """The member credential the agent gave its ranks (a rank's environment)."""
    found = set()
    for pid in ranks_of(agent_pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        if E.TOKEN.encode() in pairs:
            found.add(pairs[E.TOKEN.encode()].decode())
    (credential,) = found
    return credential


def test_a_stopped_node_is_fenced_its_credential_refused_and_it_rejoins(
        tmp_path, start_coordinator):
    server = start_coordinator(token=TOKEN)
    wait_for(server.election.is_leader, 10, "leadership")
    env = {"SPRINGBACK_TOKEN": TOKEN, "TINY_STEP_SLEEP_S": "0.3"}
    with Client(server.address, token=TOKEN) as client:
        job = client.create_job(SPEC)
        agents = [AgentProcess(tmp_path, name, job.id, server.address, env=env,
                               fork_server=False)  # reads the ranks' environ
                  for name in ("a", "b", "c")]
        try:
            wait_for(lambda: any(r["world_size"] == 3 and r["step"] >= 5
                                 for r in steps(tmp_path)), 60, "world size 3")
            zombie = agents[2]
            first_id = zombie.log().split("as member ", 1)[1].split()[0]
            assert _rank_credential(zombie.pid).split(".")[2] == first_id
            zombie.signal_node(signal.SIGSTOP)
            stopped_at = max(r["step"] for r in steps(tmp_path))
            wait_for(lambda: any(r["world_size"] == 2 and r["step"] >= stopped_at + 3
                                 for r in steps(tmp_path)), 30, "the survivors going on")
            # the stopped member's credential, as its ranks hold it, opens nothing now
            credential = _rank_credential(zombie.pid)
            with connect([server.address], token=credential) as channel:
                with pytest.raises(grpc.RpcError) as e:
                    ws_grpc.WorkerServiceStub(channel).Heartbeat(ws.HeartbeatRequest(
                        job_id=job.id, member_id=first_id), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
            assert "fenced" in e.value.details()
            zombie.signal_node(signal.SIGCONT)
            wait_for(lambda: zombie.log().count("as member ") == 2, 30,
                     "the zombie to join again")
            ended = wait_for(lambda: (j := client.get_job(job.id)).status.state in (
                pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED) and j, 120, "the job to end")
            assert ended.status.state == pb.JOB_STATE_SUCCEEDED, ended.status.message
            log = zombie.log()
            after = log.split("fenced:", 1)[1]
            assert "joined job" in after and f"as member {first_id}" not in after, log
        finally:
            for agent in agents:
                agent.stop()
