"""What a training rank holds: its member's own credential, never the
operator token — also when the agent got the token from its environment. The
ranks start as warm standbys before the join and are handed the credential
with their identity; with it they report and commit. A real token-protected
coordinator, a real agent, real ranks; each rank's environment is read from
/proc while it trains."""

from __future__ import annotations

import pytest
from cluster import AgentProcess
from sbtest import ranks_of
from sbtest import OPERATOR_TOKEN, wait_for
from springback.client import env as E
from springback.client.api import Client
from springback.v1 import types_pb2 as pb

pytestmark = pytest.mark.timeout(150)

TOKEN = OPERATOR_TOKEN


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def test_ranks_train_and_commit_with_their_member_credential_never_the_operator_token(
        tmp_path, start_coordinator, make_spec):
    server = start_coordinator(token=TOKEN)
    wait_for(server.election.is_leader, 10, "leadership")
    with Client(server.address, token=TOKEN) as client:
        job = client.create_job(make_spec(
            max_workers=1, max_steps=20,
            checkpoint={"uri": f"file://{tmp_path}/ckpt", "every_steps": 5, "keep_last": 0}))
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        agent = AgentProcess(  # exec'd ranks: the test reads their environ
            tmp_path, "a", job.id, server.address, nproc=2, fork_server=False, env={
            E.TOKEN: TOKEN,  # the agent's own: inherited by nothing it starts
            E.TOKEN_FILE: str(token_file),  # nor where a file of it lies
            "TINY_STEP_SLEEP_S": "0.2"})
        try:
            wait_for(lambda: client.get_job(job.id).status.step >= 2, 60, "training")
            ranks = ranks_of(agent.pid)
            environs = [_environ(pid) for pid in ranks]
            assert len(ranks) >= 2 and all(environs), ranks
            for environ in environs:
                assert TOKEN.encode() not in environ
                assert str(token_file).encode() not in environ
            wait_for(lambda: client.get_job(job.id).status.state in (
                pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED), 120, "the job to end")
        finally:
            agent.stop()
        job = client.get_job(job.id)
        log = agent.log_path.read_text(errors="replace")
        assert job.status.state == pb.JOB_STATE_SUCCEEDED, (job.status.message, log[-3000:])
        assert job.status.step == 20
        # rank 0, a standby given the credential with its identity, reported
        # every step and recorded every commit with it
        assert sorted(c.step for c in client.list_checkpoints(job.id)) == [5, 10, 15, 20]


def test_an_agent_given_only_its_jobs_join_credential_trains_the_job(
        tmp_path, start_coordinator, make_spec):
    # The node holds nothing that reaches another job: the agent joins with
    # the job's join credential, then calls as its member.
    server = start_coordinator(token=TOKEN)
    wait_for(server.election.is_leader, 10, "leadership")
    with Client(server.address, token=TOKEN) as client:
        job = client.create_job(make_spec(
            max_workers=1, max_steps=10,
            checkpoint={"uri": f"file://{tmp_path}/ckpt", "every_steps": 5, "keep_last": 0}))
        agent = AgentProcess(  # exec'd ranks: the test reads their environ
            tmp_path, "a", job.id, server.address, nproc=2, fork_server=False, env={
            E.TOKEN: client.issue_join_credential(job.id), "TINY_STEP_SLEEP_S": "0.1"})
        try:
            wait_for(lambda: client.get_job(job.id).status.step >= 2, 60, "training")
            for pid in (agent.pid, *ranks_of(agent.pid)):
                assert TOKEN.encode() not in _environ(pid)
            wait_for(lambda: client.get_job(job.id).status.state in (
                pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED), 120, "the job to end")
        finally:
            agent.stop()
        job = client.get_job(job.id)
        log = agent.log_path.read_text(errors="replace")
        assert job.status.state == pb.JOB_STATE_SUCCEEDED, (job.status.message, log[-3000:])
        assert sorted(c.step for c in client.list_checkpoints(job.id)) == [5, 10]
