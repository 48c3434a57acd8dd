"""The fork server (worker/agent/forkserver.py): a rank forked from the warm
interpreter starts as an exec'd one would, on imports already done; its exit
status, signals and death with the server or the agent are a Popen's; what
cannot be forked starts cold, saying why."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sbtest import process_alive, wait_for
from springback.worker.agent.forkserver import ForkedProcess, plan_fork
from springback.worker.agent.rankprocess import RankStarter

REPORT = textwrap.dedent("""\
    import atexit, concurrent.futures, ctypes, json, os, sys, threading
    torch_was_loaded = "torch" in sys.modules  # before this script imported anything
    import numpy
    left_open = concurrent.futures.ThreadPoolExecutor(1)  # its idle worker must not hang the exit
    left_open.submit(print, "from an executor").result()
    ctypes.CDLL(None).printf(b"from C stdio\\n")  # buffered in C: flushed at exit
    fd = int(os.environ["PASSED_FD"])
    os.write(fd, b"through the passed descriptor")
    atexit.register(lambda: open(os.environ["ATEXIT_FILE"], "w").write("ran"))
    late = threading.Thread(target=lambda: print("thread joined at exit", flush=True))
    print(json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(),
                      "path0": sys.path[0], "color": os.environ.get("COLOR"),
                      "torch_was_loaded": torch_was_loaded, "pid": os.getpid(),
                      "sid": os.getsid(0), "draw": float(numpy.random.rand())}))
    print("to stderr", file=sys.stderr)
    late.start()
    sys.exit(int(os.environ["EXIT_WITH"]))
    """)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "scripts" / "rank.py"
    path.parent.mkdir()
    path.write_text(REPORT)
    return path


@pytest.fixture
def starter(script: Path):
    s = RankStarter([sys.executable, str(script), "--flag", "x"], fork=True)
    yield s
    s.close()


def _run(starter: RankStarter, tmp_path: Path, exit_with: int, **env: str) -> tuple[dict, str, int]:
    read, write = os.pipe()
    environ = {**os.environ, "PASSED_FD": str(write), "EXIT_WITH": str(exit_with),
               "ATEXIT_FILE": str(tmp_path / f"atexit-{exit_with}"), **env}
    try:
        proc = starter.start(environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             pass_fds=(write,))
    finally:
        os.close(write)
    assert isinstance(proc, ForkedProcess)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    code = proc.wait(timeout=30)
    with os.fdopen(read, "rb") as f:
        assert f.read() == b"through the passed descriptor"
    report = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    return report, out, code


@pytest.mark.timeout(90)
def test_a_forked_rank_starts_as_an_execd_one_would_on_imports_already_done(
        starter, script, tmp_path):
    report, out, code = _run(starter, tmp_path, 3, COLOR="blue")
    assert code == 3
    assert report["torch_was_loaded"]  # the point: the server imported it
    assert report["name"] == "__main__"
    assert report["argv"] == [str(script), "--flag", "x"]
    assert report["cwd"] == os.getcwd()
    assert report["path0"] == str(script.parent)
    assert report["color"] == "blue"
    assert report["sid"] == report["pid"]  # a session of its own, as start_new_session
    assert "to stderr" in out and "thread joined at exit" in out
    assert "from an executor" in out and "from C stdio" in out
    assert (tmp_path / "atexit-3").read_text() == "ran"
    second, _, code = _run(starter, tmp_path, 0, COLOR="red")
    assert code == 0 and second["color"] == "red"
    assert second["draw"] != report["draw"]  # numpy's global state reseeded per rank


@pytest.mark.timeout(90)
def test_a_script_that_raises_exits_1_with_its_own_traceback(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("def build():\n    raise ValueError('bad corpus')\nbuild()\n")
    starter = RankStarter([sys.executable, str(path)], fork=True)
    try:
        proc = starter.start(dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert isinstance(proc, ForkedProcess)
        assert proc.stdout is not None
        out = proc.stdout.read().decode()
        assert proc.wait(timeout=30) == 1
    finally:
        starter.close()
    frames = [line for line in out.splitlines() if line.strip().startswith("File ")]
    assert frames and all(str(path) in f for f in frames), out  # none of the server's
    assert out.strip().endswith("ValueError: bad corpus")


@pytest.mark.timeout(90)
def test_an_interrupted_script_ends_by_sigint_as_an_execd_one_does(tmp_path):
    """CPython ends an interpreter whose script raised KeyboardInterrupt by
    SIGINT, after its clean-up: a forked rank's status says the same."""
    path = tmp_path / "interrupted.py"
    path.write_text("import atexit, os\n"
                    "atexit.register(lambda: print('cleaned up', flush=True))\n"
                    "raise KeyboardInterrupt\n")
    execd = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                           timeout=60)
    starter = RankStarter([sys.executable, str(path)], fork=True)
    try:
        proc = starter.start(dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert isinstance(proc, ForkedProcess) and proc.stdout is not None
        out = proc.stdout.read().decode()
        assert proc.wait(timeout=30) == execd.returncode == -signal.SIGINT, out
    finally:
        starter.close()
    assert "KeyboardInterrupt" in out and "cleaned up" in out


@pytest.fixture
def pausing(tmp_path: Path):
    """A starter of a rank that prints its parent's pid and waits for a signal."""
    path = tmp_path / "wait.py"
    path.write_text("import os, signal\nprint(os.getppid(), flush=True)\nsignal.pause()\n")
    starter = RankStarter([sys.executable, str(path)], fork=True)
    yield starter
    starter.close()


def _start_pausing(starter: RankStarter) -> tuple[ForkedProcess, int]:
    """A pausing rank, up, and its parent's pid (the fork server's)."""
    proc = starter.start(dict(os.environ), stdout=subprocess.PIPE)
    assert isinstance(proc, ForkedProcess) and proc.stdout is not None
    return proc, int(proc.stdout.readline())


@pytest.mark.timeout(90)
def test_signals_reach_the_rank_and_its_status_is_the_signal(pausing):
    proc, _ = _start_pausing(pausing)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM
    proc.kill()  # after its exit: nothing happens, as with Popen


@pytest.mark.timeout(90)
def test_the_server_outlives_a_job_wide_sigterm(pausing):
    """Slurm or systemd signal every process of a job: the server must not
    die of it (and take its ranks by their parent-death signal); each rank
    has SIGTERM's default action."""
    first, server = _start_pausing(pausing)
    os.kill(server, signal.SIGTERM)
    second, same = _start_pausing(pausing)
    assert same == server and first.poll() is None
    second.terminate()
    assert second.wait(timeout=30) == -signal.SIGTERM


@pytest.mark.timeout(120)
def test_the_ranks_die_with_the_fork_server_and_the_next_start_brings_a_new_one(pausing):
    first, server = _start_pausing(pausing)
    os.kill(server, signal.SIGKILL)
    assert first.wait(timeout=30) == -signal.SIGKILL
    assert not process_alive(first.pid)
    second, new_server = _start_pausing(pausing)
    assert new_server != server
    second.kill()
    assert second.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.timeout(120)
def test_a_forked_rank_dies_with_its_agent(tmp_path):
    """The agent SIGKILLed: the server dies by its parent-death signal, the
    rank by its own (never an orphan)."""
    path = tmp_path / "wait.py"
    path.write_text("import signal\nsignal.pause()\n")
    agent = subprocess.Popen(
        [sys.executable, "-c",
         "import os,sys; from springback.worker.agent.rankprocess import RankStarter;"
         f"p = RankStarter([sys.executable, {str(path)!r}], fork=True).start(dict(os.environ));"
         "print(type(p).__name__, p.pid, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None
        kind, pid = agent.stdout.readline().split()
        assert kind == "ForkedProcess"
        agent.kill()
        agent.wait(timeout=10)
        wait_for(lambda: not process_alive(int(pid)), 20, "the rank to die with its agent")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=10)


@pytest.mark.timeout(90)
def test_what_cannot_be_forked_starts_cold_saying_why(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="springback.agent")
    assert "not the agent's interpreter" in plan_fork(["/usr/bin/env", "python3", "t.py"], {})
    assert "-c" in plan_fork([sys.executable, "-c", "pass"], {})
    module = plan_fork([sys.executable, "-u", "-m", "pkg.train", "--lr", "1"], {})
    assert not isinstance(module, str)
    assert (module.module, module.args, module.unbuffered) == ("pkg.train", ["--lr", "1"], True)
    path = tmp_path / "ok.py"
    path.write_text("print('ok')\n")
    starter = RankStarter([sys.executable, str(path)], fork=True)
    try:
        warm = starter.start(dict(os.environ), stdout=subprocess.DEVNULL)
        assert isinstance(warm, ForkedProcess) and warm.wait(timeout=30) == 0
        assert "did not fork" not in caplog.text
        # a start-up variable the server did not start with: exec'd
        cold = starter.start({**os.environ, "OMP_NUM_THREADS": "7"}, stdout=subprocess.PIPE)
        assert isinstance(cold, subprocess.Popen) and cold.wait(timeout=30) == 0
        assert "OMP_NUM_THREADS" in caplog.text
    finally:
        starter.close()
    off = RankStarter([sys.executable, str(path)], fork=False)
    proc = off.start(dict(os.environ), stdout=subprocess.PIPE)
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=30) == 0

