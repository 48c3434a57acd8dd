"""Storage credentials per job (issue 44): two jobs whose agents share this
host, each started with its own job's S3 credentials in a file
(`springback run --storage-credentials` / $SPRINGBACK_STORAGE_CREDENTIALS_FILE),
both in an environment that also holds a node-wide AWS key. Each rank's
environment, read from /proc while it trains, holds exactly its own job's
AWS_* variables: not the other job's, not the node-wide key, and no path to
either credentials file; both jobs commit their checkpoints to a real moto S3
server with them (botocore finds no other credential: without the hand-off
they could not). A real coordinator with a token, etcd, agents given their
job's join credential, real ranks. Bad files are refused naming the flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import AgentProcess
from sbtest import ranks_of
from s3faults import moto_bucket
from sbtest import OPERATOR_TOKEN, wait_for
from springback.client import env as E
from springback.client.api import Client
from springback.v1 import types_pb2 as pb
from springback.worker.agent import storagecreds

pytestmark = pytest.mark.timeout(240)

NODE_WIDE = {"AWS_ACCESS_KEY_ID": "AKIANODEWIDE0000000", "AWS_SECRET_ACCESS_KEY": "node-wide-secret",
             "AWS_PROFILE": "shared", "AWS_SHARED_CREDENTIALS_FILE": "/etc/springback/aws-all-jobs"}
"""What a shared worker.env or a node's profile could give every agent: dropped."""


def _credentials(name: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": f"AKIAJOB{name.upper()}00000000000",
            "AWS_SECRET_ACCESS_KEY": f"secret-of-job-{name}-0123456789",
            "AWS_DEFAULT_REGION": "us-east-1"}


def _write(path: Path, values: dict[str, str], mode: int = 0o600) -> Path:
    path.write_text("# this job's storage credentials\n\n"
                    + "".join(f"{k}={v}\n" for k, v in values.items()))
    os.chmod(path, mode)
    return path


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return {}
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def test_each_jobs_ranks_hold_only_their_own_jobs_storage_credentials(
        tmp_path, start_coordinator, make_spec):
    server = start_coordinator(token=OPERATOR_TOKEN)
    wait_for(server.election.is_leader, 10, "leadership")
    with moto_bucket("percreds") as (bucket, endpoint), \
            Client(server.address, token=OPERATOR_TOKEN) as client:
        jobs, files, agents = {}, {}, {}
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            jobs[name] = client.create_job(make_spec(
                name=f"creds-{name}", max_workers=1, max_steps=12,
                checkpoint={"uri": f"s3://{bucket}/ckpt", "every_steps": 4, "keep_last": 0})).id
            files[name] = _write(tmp_path / name / "storage.env", _credentials(name))
        try:
            for name, how in (("a", "env"), ("b", "flag")):
                env = {**NODE_WIDE, E.S3_ENDPOINT_URL: endpoint, "TINY_STEP_SLEEP_S": "0.2",
                       E.TOKEN: client.issue_join_credential(jobs[name])}
                extra: list[str] = []
                if how == "env":
                    env[E.STORAGE_CREDENTIALS_FILE] = str(files[name])
                else:
                    extra = ["--storage-credentials", str(files[name])]
                agents[name] = AgentProcess(tmp_path / name, name, jobs[name], server.address,
                                            *extra, env=env, nproc=2,
                                            fork_server=False)  # reads the ranks' environ
            for name in ("a", "b"):
                wait_for(lambda n=name: client.get_job(jobs[n]).status.step >= 2, 90,
                         f"job {name} training")
            for name, other in (("a", "b"), ("b", "a")):
                ranks = ranks_of(agents[name].pid)
                environs = [_environ(pid) for pid in ranks]
                assert len(ranks) >= 2 and all(environs), ranks
                for environ in environs:
                    aws = {k: v for k, v in environ.items() if k.startswith("AWS_")
                           and not storagecreds.SETTINGS.fullmatch(k)}  # e.g. AWS_CA_BUNDLE
                    assert aws == {k: v for k, v in _credentials(name).items()
                                   if not storagecreds.SETTINGS.fullmatch(k)}, (name, aws)
                    assert environ["AWS_DEFAULT_REGION"] == "us-east-1"
                    whole = "\0".join(f"{k}={v}" for k, v in environ.items())
                    for secret in (*_credentials(other).values(), NODE_WIDE["AWS_SECRET_ACCESS_KEY"]):
                        if secret != "us-east-1":
                            assert secret not in whole, (name, secret)
                    for path in files.values():  # no path to any job's credentials file
                        assert str(path) not in whole, (name, path)
                    assert E.STORAGE_CREDENTIALS_FILE not in environ
            for name in ("a", "b"):
                wait_for(lambda n=name: client.get_job(jobs[n]).status.state in (
                    pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED), 150, f"job {name} to end")
        finally:
            for agent in agents.values():
                agent.stop()
        for name in ("a", "b"):
            job = client.get_job(jobs[name])
            assert job.status.state == pb.JOB_STATE_SUCCEEDED, (
                job.status.message, agents[name].log()[-3000:])
            assert "storage credentials from" in agents[name].log()
            commits = client.list_checkpoints(jobs[name])
            # a periodic save due while the previous one uploads is skipped
            # (storage/checkpointer.py): seen [4, 12] and [8, 12] on a loaded host
            assert 12 in {c.step for c in commits}, [c.step for c in commits]
            assert all(c.uri.startswith(f"s3://{bucket}/ckpt/{jobs[name]}/") for c in commits)


def _run(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "springback.worker.agent", "--job", "j", "--coordinator",
         "127.0.0.1:1", "--mode", "library", *flags, "--", sys.executable, "train.py"],
        env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=60)


class TestBadFiles:
    def test_a_file_others_can_read_a_missing_one_and_a_bad_line_are_refused_naming_the_flag(
            self, tmp_path):
        readable = _write(tmp_path / "readable.env", _credentials("a"), mode=0o644)
        bad = tmp_path / "bad.env"
        bad.write_text("AWS_ACCESS_KEY_ID=x\nexport SECRET=hunter2\n")
        bad.chmod(0o600)
        empty = _write(tmp_path / "empty.env", {})
        for flags, env, message in (
                (["--storage-credentials", str(readable)], None, "has mode 644: others can read"),
                ([], {E.STORAGE_CREDENTIALS_FILE: str(readable)}, "has mode 644: others can read"),
                (["--storage-credentials", str(tmp_path / "missing")], None,
                 "cannot be read: No such file or directory"),
                (["--storage-credentials", str(bad)], None, "line 2 is not AWS_NAME=VALUE"),
                (["--storage-credentials", str(empty)], None, "holds no AWS_NAME=VALUE line")):
            done = _run(*flags, env=env)
            assert done.returncode == 2, done.stderr
            assert f"springback run: --storage-credentials (${E.STORAGE_CREDENTIALS_FILE}): " in (
                done.stderr) and message in done.stderr, done.stderr
            assert "hunter2" not in done.stderr

    def test_the_file_becomes_the_only_aws_environment_and_its_path_is_dropped(self, tmp_path):
        path = _write(tmp_path / "job.env", _credentials("a"), mode=0o400)
        environ = {**NODE_WIDE, "AWS_SESSION_TOKEN": "someone-elses", "HOME": "/home/x",
                   "AWS_ROLE_ARN": "arn:aws:iam::1:role/all-jobs", "AWS_CONFIG_FILE": "/x",
                   "AWS_CA_BUNDLE": "/etc/ssl/ca.pem", "AWS_DEFAULT_REGION": "eu-west-1",
                   E.STORAGE_CREDENTIALS_FILE: str(path)}
        assert storagecreds.apply(str(path), environ) == sorted(_credentials("a"))
        # the credentials are the file's alone; settings stay, the file's win
        assert environ == {"HOME": "/home/x", "AWS_CA_BUNDLE": "/etc/ssl/ca.pem",
                           **_credentials("a")}

    def test_another_users_file_or_a_directory_is_refused(self, tmp_path):
        with pytest.raises(ValueError, match="is not a regular file"):
            storagecreds.read(str(tmp_path))
        path = _write(tmp_path / "job.env", _credentials("a"))
        if os.getuid() == 0:
            os.chown(path, 65534, 65534)
            with pytest.raises(ValueError, match="belongs to uid 65534, not to this user"):
                storagecreds.read(str(path))
