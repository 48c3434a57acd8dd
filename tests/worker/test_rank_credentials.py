"""What a training rank holds: its member's own credential, never the
operator token — also when the agent got the token from its environment, and
for a warm standby activated in a crashed rank 0's place (handed the
credential at activation). A real token-protected coordinator, a real agent,
real ranks; every rank process's environment is dumped at start-up
(tests/worker/envdump)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cluster import AgentProcess
from sbtest import wait_for
from springback.client import env as E
from springback.client.api import Client
from springback.service import credentials
from springback.v1 import types_pb2 as pb

pytestmark = pytest.mark.timeout(150)

TOKEN = "operator-token-not-for-ranks"
ENVDUMP = str(Path(__file__).parent / "envdump")


def test_ranks_train_and_commit_with_their_member_credential_never_the_operator_token(
        tmp_path, start_coordinator, make_spec):
    server = start_coordinator(token=TOKEN)
    wait_for(server.election.is_leader, 10, "leadership")
    dumps = tmp_path / "env"
    dumps.mkdir()
    with Client(server.address, token=TOKEN) as client:
        job = client.create_job(make_spec(
            max_workers=1, max_steps=20,
            checkpoint={"uri": f"file://{tmp_path}/ckpt", "every_steps": 5, "keep_last": 0}))
        agent = AgentProcess(tmp_path, "a", job.id, server.address, nproc=2, env={
            E.TOKEN: TOKEN,  # the agent's own: inherited by nothing it starts
            "PYTHONPATH": os.pathsep.join([ENVDUMP, os.environ.get("PYTHONPATH", "")]),
            "ENVDUMP_DIR": str(dumps), "TINY_CRASH_AT_STEP": "8", "TINY_CRASH_RANK": "0",
            "TINY_CRASH_MARKER": str(tmp_path / "crashed")})
        try:
            wait_for(lambda: client.get_job(job.id).status.state in (
                pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED), 120, "the job to end")
        finally:
            agent.stop()
        job = client.get_job(job.id)
        log = agent.log_path.read_text(errors="replace")
        assert job.status.state == pb.JOB_STATE_SUCCEEDED, (job.status.message, log[-3000:])
        assert job.status.step == 20 and (tmp_path / "crashed").exists()
        # the first rank 0 (a standby activated at the join, its credential
        # handed over then) committed step 5; its replacement the rest
        assert job.status.generation >= 3, job.status
        assert sorted(c.step for c in client.list_checkpoints(job.id)) == [5, 10, 15, 20]
    seen = [json.loads(p.read_text())["env"] for p in dumps.glob("env-*.json")]
    assert seen  # ranks started with a plan (standbys start without RANK: not dumped)
    for environ in seen:
        token = environ.get(E.TOKEN, "")
        assert token != TOKEN and TOKEN not in json.dumps(environ)
        job_id, member_id = credentials.member_of(TOKEN, token) or (None, None)
        assert (job_id, member_id) == (job.id, environ[E.MEMBER_ID]), token
