"""Test helper: node agents (`springback run`) as real subprocesses.

`AgentProcess` runs ``python -m springback.worker.agent … -- python tiny_train.py``
against a real coordinator and exposes the fault injections the tests need:
SIGKILL, SIGTERM, and SIGSTOP/SIGCONT of the whole node (agent and ranks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from fakeplans import TINY_TRAIN
from sbtest import node_processes
from springback.client import env as E
from springback.worker.eventlog import read as read_metrics


FAST_FORWARD = "fast-forward"
"""The file, in a cluster's root, whose presence ends the scripts' step
sleeps (tests/worker/pace.py)."""


class AgentProcess:
    def __init__(self, root: Path, name: str, job_id: str, coordinator: str, *extra: str,
                 env: dict[str, str] | None = None, nproc: int = 1,
                 script: str = TINY_TRAIN, fork_server: bool | None = None) -> None:
        """`fork_server`: --fork-server or --no-fork-server; None leaves it to
        ``$SPRINGBACK_FORK_SERVER`` (the suite's environment). A test that
        reads a rank's /proc/<pid>/environ needs exec'd ranks (False): a
        forked rank's shows its fork server's."""
        self.name = name
        self.log_path = root / f"agent-{name}.log"
        environ = dict(os.environ, **{
            E.AUDIT_DIR: str(root / "audit"), E.METRICS_FILE: str(root / "metrics.jsonl"),
            "TINY_STEP_SLEEP_S": "0.1", "TINY_FAST_FORWARD_FILE": str(root / FAST_FORWARD),
            "PYTHONUNBUFFERED": "1", **(env or {})})
        self.process = subprocess.Popen(
            [sys.executable, "-m", "springback.worker.agent", "--job", job_id,
             "--coordinator", coordinator, "--nproc-per-node", str(nproc),
             "--drain-timeout-s", "30", *extra,
             *([] if fork_server is None else
               ["--fork-server" if fork_server else "--no-fork-server"]),
             "--", sys.executable, script],
            env=environ, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal_node(self, sig: int) -> None:
        """Sends `sig` to the agent and every rank it runs (a whole node,
        its fork server too)."""
        for pid in node_processes(self.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float) -> int:
        return self.process.wait(timeout=timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.signal_node(signal.SIGCONT)
            self.process.kill()
            self.process.wait()


def metrics(root: Path) -> list[dict]:
    return read_metrics(root / "metrics.jsonl")


def steps(root: Path) -> list[dict]:
    return [r for r in metrics(root) if r["event"] == "step"]
