"""`springback run` through the real CLI against a real coordinator: start-up
checks (fail fast, say why), torchrun's flags, and library mode's LOCAL_RANK."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sbtest import OPERATOR_TOKEN, wait_for
from springback.cli.local import free_port
from springback.worker.agent.launch import choose_mode, parse_nnodes, parse_streams, uses_session

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
EXAMPLE = str(ROOT / "examples" / "torchrun_ddp" / "train.py")
MARKER_TRAIN = str(HERE / "marker_train.py")


def springback(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "springback.cli", *args],
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"still running after {timeout_s}s:\n{out}") from None
    return proc.returncode, out, time.monotonic() - t0


def marker_run(tmp_path: Path, *args: str) -> tuple[int, str, float, bool]:
    marker = tmp_path / "started"
    code, out, took = finish(springback(*args, "--", sys.executable, MARKER_TRAIN,
                                        env={"MARKER_FILE": str(marker)}), 60)
    return code, out, took, marker.exists()


class TestAgentStartUp:
    def test_an_unknown_job_is_refused_before_any_rank_starts(self, tmp_path,
                                                              coordinator_address):
        code, out, _, started = marker_run(tmp_path, "run", "--job", "no-such-job",
                                           "--coordinator", coordinator_address)
        assert code == 1, out
        assert "no-such-job" in out and "NOT_FOUND" in out
        assert not started, "the script ran although the job does not exist"

    def test_a_wrong_token_is_refused_before_any_rank_starts(self, tmp_path, start_coordinator,
                                                             make_spec):
        from springback.client.api import Client

        server = start_coordinator(token=OPERATOR_TOKEN)
        wait_for(server.election.is_leader, 10, "leadership")
        with Client(server.address, token=OPERATOR_TOKEN) as c:
            job = c.create_job(make_spec())
        code, out, _, started = marker_run(tmp_path, "run", "--job", job.id, "--coordinator",
                                           server.address, "--token", "wrong")
        assert code == 1, out
        assert "UNAUTHENTICATED" in out
        assert not started

    def test_an_unreachable_coordinator_fails_within_the_connect_timeout_saying_so(
            self, tmp_path):
        address = f"127.0.0.1:{free_port()}"  # nothing listens there
        code, out, took, started = marker_run(tmp_path, "run", "--job", "j", "--coordinator",
                                              address, "--connect-timeout-s", "3")
        assert code == 1, out
        assert f"no coordinator answered at {address} within 3s" in out
        assert "retrying" in out  # not silent while it waits
        assert took < 15 and not started

    def test_ctrl_c_on_an_agent_whose_job_never_ran_stops_at_once(self, tmp_path, client,
                                                                  coordinator_address,
                                                                  make_spec):
        job = client.create_job(make_spec(min_workers=2))  # one agent: it never runs
        log_path = tmp_path / "agent.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "springback.cli", "run", "--job", job.id,
             "--coordinator", coordinator_address, "--", sys.executable, MARKER_TRAIN],
            env={**os.environ, "MARKER_FILE": str(tmp_path / "m")},
            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: "joined job" in log_path.read_text(), 60, "the agent to join")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0, log_path.read_text()
            assert time.monotonic() - t0 < 10  # not the 60 s drain timeout
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert "never trained" in log_path.read_text()
        assert len(client.get_job(job.id).status.members) == 0  # it left


class TestTorchrunFlags:
    @pytest.mark.parametrize("flag,reason", [
        (["--node-rank", "1"], "springback assigns node ranks"),
        (["--rdzv-endpoint", "h:1"], "coordinator is the rendezvous"),
        (["--master-port", "29500"], "set per generation"),
    ])
    def test_flags_that_make_no_sense_here_are_refused_with_the_reason(self, flag, reason):
        code, out, _ = finish(springback("run", "--job", "j", *flag, "--", "python", EXAMPLE), 30)
        assert code == 2 and reason in out, out

    def test_nnodes_must_match_the_job(self, tmp_path, client, coordinator_address, make_spec):
        job = client.create_job(make_spec(min_workers=1, max_workers=3))
        code, out, _, started = marker_run(tmp_path, "run", "--job", job.id, "--coordinator",
                                           coordinator_address, "--nnodes", "2:4")
        assert code == 1 and "--nnodes 2:4 does not match" in out and "min_workers 1" in out
        assert not started

    def test_auto_mode_asks_for_mode_when_it_cannot_read_the_script(self):
        code, out, _ = finish(springback("run", "--job", "j", "--", "bash", "-c", "true"), 30)
        assert code == 2 and "pass --mode library" in out, out

    @pytest.mark.timeout(180)
    def test_standalone_runs_the_torchrun_example_with_its_output_in_the_log_dir(self,
                                                                                tmp_path):
        logs = tmp_path / "logs"
        code, out, _ = finish(springback(
            "run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(logs),
            "--redirects", "3", EXAMPLE, "--steps", "8", "--checkpoint-every", "4",
            "--checkpoint-uri", f"file://{tmp_path}/ckpt"), 170)
        assert code == 0, out
        assert "done at step 8" in (logs / "attempt_0" / "0" / "stdout.log").read_text()
        assert (logs / "attempt_0" / "1" / "stderr.log").exists()
        assert "done at step" not in out  # redirected, not on the console


class TestModeChoice:
    def test_a_script_importing_the_library_runs_in_library_mode(self, tmp_path):
        script = tmp_path / "s.py"
        script.write_text("def f():\n    from springback.worker import Session\n")
        assert uses_session(script.read_text())
        assert choose_mode("auto", [sys.executable, str(script)]) == "library"
        assert choose_mode("auto", [sys.executable, "-u", EXAMPLE]) == "restart"
        assert choose_mode("restart", ["bash", "x.sh"]) == "restart"

    def test_torchrun_value_forms_parse_and_bad_ones_name_the_flag(self):
        assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:4") == (1, 4)
        assert parse_streams("--tee", "3") == 3
        assert parse_streams("--tee", "0:1,1:2") == {0: 1, 1: 2}
        with pytest.raises(ValueError, match="--nnodes"):
            parse_nnodes("4:2")
        with pytest.raises(ValueError, match="--redirects"):
            parse_streams("--redirects", "5")


class TestLibraryModeLocalRanks:
    @pytest.mark.timeout(180)
    @pytest.mark.parametrize("how", ["exec", "fork-server", "fork-server-variable"])
    def test_two_ranks_on_one_agent_read_distinct_local_ranks_after_session(
            self, tmp_path, client, coordinator_address, make_spec, how):
        flags = {"exec": ["--no-fork-server"], "fork-server": ["--fork-server"]}.get(how, [])
        env = {"SPRINGBACK_FORK_SERVER": "1"} if how == "fork-server-variable" else {}
        job = client.create_job(make_spec(min_workers=1, max_workers=1, max_steps=3,
                                          data={"num_samples": 16, "global_batch_size": 4}))
        code, out, _ = finish(springback(
            "run", "--job", job.id, "--coordinator", coordinator_address,
            "--nproc-per-node", "2", "--no-standby", *flags, "--",
            sys.executable, str(HERE / "local_rank_train.py"),
            env={"LOCAL_RANK_OUT": str(tmp_path), **env}), 170)
        assert code == 0, out
        records = [json.loads(p.read_text()) for p in tmp_path.glob("rank-*.json")]
        assert sorted(r["LOCAL_RANK"] for r in records) == ["0", "1"], records
        for r in records:
            assert ("springback.worker.agent.forkserver" in r["parent"]) == (how != "exec"), r
            assert r["LOCAL_RANK"] == str(r["session_local_rank"])
            assert r["ranks"] == [r["session_local_rank"]]  # one node: rank = local rank


class TestRankOutput:
    def test_tee_writes_the_file_and_the_console_redirect_only_the_file(self, tmp_path, capfd):
        from springback.worker.agent.launch import RankOutput
        from springback.worker.agent.rankprocess import RankStarter

        output = RankOutput(log_dir=str(tmp_path / "logs"), redirects={1: 1}, tee={0: 1})
        script = tmp_path / "rank.py"
        script.write_text("import sys; print('out'); print('err', file=sys.stderr)")
        starter = RankStarter([sys.executable, str(script)], fork=True)  # forked
        try:
            for lr in (0, 1):
                proc = output.launch(starter, dict(os.environ), local_rank=lr,
                                     attempt="attempt_0")
                assert proc.wait(30) == 0
        finally:
            starter.close()
        for pump in output._pumps:
            pump.join(10)
        logs = tmp_path / "logs" / "attempt_0"
        assert (logs / "0" / "stdout.log").read_text() == "out\n"
        assert (logs / "1" / "stdout.log").read_text() == "out\n"
        assert not (logs / "0" / "stderr.log").exists()
        console = capfd.readouterr()
        assert console.out.count("out") == 1  # rank 0's tee; rank 1's went to its file only
        assert console.err.count("err") == 2  # neither redirected stderr

    def test_redirects_without_a_log_dir_are_refused(self):
        from springback.worker.agent.launch import RankOutput

        with pytest.raises(ValueError, match="--log-dir"):
            RankOutput(redirects=3)
