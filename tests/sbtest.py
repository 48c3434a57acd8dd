"""Helpers shared by Springback's tests: waiting on conditions, real processes.

Nothing here fakes a component: etcd is the real binary, coordinators are real
gRPC servers (in-process or `springback coordinator` subprocesses).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from springback.client.polling import wait_until
from springback.worker.agent.forkserver import startup_environment
from springback.worker.agent.rankprocess import RankProcess, RankStarter

T = TypeVar("T")

OPERATOR_TOKEN = "zL3qes3IQ19oV3_nLCrIGNxjvsbWsWp2"
"""The operator token of tests' coordinators: random, strong enough
(`credentials.token_weakness`; coordinators refuse weak tokens)."""
VIEWER_TOKEN = "a8JmpOGSxbQMCihl7cRI_jzt0JcZ85Bv"
"""The viewer token of tests' coordinators (differs from the operator's)."""


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Polls `predicate` until it returns a truthy value; fails the test after `timeout_s`.

    Exceptions raised by the predicate count as "not yet" (the last one is
    reported on timeout).
    """
    last_error: BaseException | None = None

    def attempt() -> T | None:
        nonlocal last_error
        try:
            return predicate()
        except Exception as e:  # noqa: BLE001 (reported below)
            last_error = e
            return None

    value = wait_until(attempt, timeout_s=timeout_s, interval_s=interval_s)
    if not value:
        raise AssertionError(
            f"timed out after {timeout_s}s waiting for {what}"
            + (f" (last error: {last_error!r})" if last_error else "")
        )
    return value


class CoordinatorProcess:
    """A `springback coordinator` subprocess on a free loopback port."""

    def __init__(self, etcd_endpoint: str, *extra: str, log_path: str | None = None,
                 etcd_flags: Sequence[str] = ()) -> None:
        """`etcd_flags`: how it reaches a secured etcd (``--etcd-ca`` …, e.g. an
        `EtcdServer`'s ``coordinator_flags()``)."""
        self.log_path = log_path
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "springback.cli", "--json", "coordinator",
             "--etcd", etcd_endpoint, *etcd_flags, "--listen", "127.0.0.1:0", *extra],
            stdout=subprocess.PIPE, stderr=self._log, start_new_session=True,
            env={**os.environ, "SPRINGBACK_LOG_LEVEL": "INFO"},
        )
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"coordinator exited with {self.process.wait()} (log: {log_path})")
        self.address: str = json.loads(line)["address"]

    def kill(self) -> None:
        """SIGKILL: no resignation, no graceful stop."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process.stdout:
            self.process.stdout.close()
        if self._log is not subprocess.DEVNULL:
            self._log.close()


def scrape(address: str, token: str | None = None) -> dict[str, float]:
    """``name{labels}`` -> value of every sample a Prometheus endpoint at
    ``HOST:PORT`` serves on /metrics, parsed with prometheus-client's own
    parser (so the exposition must be valid). Labels are sorted by name.
    `token`: sent as ``Authorization: Bearer`` (a coordinator with a token
    wants its operator's or viewer's). Raises OSError while nothing answers
    (urllib.error.HTTPError, an OSError, for a refusal)."""
    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(
        f"http://{address}/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def leader_of(store) -> str | None:  # noqa: ANN001 (a springback.service.etcd.store.Store)
    """The address in the leader record, or None while no replica leads."""
    from springback.service.etcd import keys

    entry = store.get(keys.LEADER)
    return entry.value.decode() if entry else None


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc); none once it is gone."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    except FileNotFoundError:
        pass
    return out


FORK_SERVER_MODULE = b"springback.worker.agent.forkserver"


def _cmdline(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def ranks_of(agent_pid: int) -> list[int]:
    """The rank processes of a node agent, exec'd (its children) or forked
    (its fork server's children; `springback run --fork-server`), in the
    order they started. A child not exec'd yet (its command line still the
    agent's) is left out: it may become the fork server."""
    out: list[int] = []
    agent = _cmdline(agent_pid)
    for pid in children(agent_pid):
        cmdline = _cmdline(pid)
        if FORK_SERVER_MODULE in cmdline:  # also while its launcher runs
            out += children(pid)
        elif cmdline != agent:
            out.append(pid)
    return out


def node_processes(agent_pid: int) -> list[int]:
    """A whole node: the agent, its children (ranks, a fork server) and a
    fork server's children (forked ranks). Unlike `ranks_of`, a child not
    exec'd yet is included: a node is signalled whole."""
    out = [agent_pid]
    for pid in children(agent_pid):
        out += [pid, *(children(pid) if FORK_SERVER_MODULE in _cmdline(pid) else [])]
    return out


_PEER_STARTERS: dict[tuple[tuple[str, str], ...], RankStarter] = {}
"""The warm interpreters of this test process, one per start-up environment."""


def start_python(args: Sequence[str], *, env: dict[str, str] | None = None,
                 stdout: Any = None, stderr: Any = None) -> RankProcess:
    """``python args`` as `subprocess.Popen` starts it (`env`: os.environ when
    None; `stdout`/`stderr` as Popen's), forked from a warm interpreter that
    imported torch once for this test process where the command allows it
    (the product's fork server: `worker/agent/forkserver.py`, one per
    start-up environment); exec'd otherwise. Either way the process dies with
    this one. A forked process has the part of Popen that `ForkedProcess`
    lists: ``wait``, ``poll``, ``kill``, ``returncode``, ``stdout``, no
    ``communicate``. Each start saves the 2-3 CPU seconds of importing torch,
    which a suite of hundreds of gloo peers otherwise spends on its 2 cores."""
    environ = dict(os.environ if env is None else env)
    key = tuple(sorted(startup_environment(environ).items()))
    starter = _PEER_STARTERS.get(key)
    if starter is None:
        if not _PEER_STARTERS:
            atexit.register(lambda: [s.close() for s in _PEER_STARTERS.values()])
        starter = _PEER_STARTERS[key] = RankStarter([sys.executable], fork=True)
    return starter.start(environ, stdout=stdout, stderr=stderr,
                         command=[sys.executable, *args])


def run_python_all(argvs: Sequence[Sequence[str]], *, env: dict[str, str] | None = None,
                   timeout_s: float) -> tuple[list[int], list[str]]:
    """Starts ``python argv`` for every argv at once (`start_python`), waits
    for all of them (up to `timeout_s` for all; any left then is killed and
    the test fails with every peer's status and output so far), and returns
    their exit statuses and whole outputs (stdout and stderr together,
    through files: an output nobody reads yet never blocks its process)."""
    with tempfile.TemporaryDirectory(prefix="peers-") as logs:
        procs = []

        def outputs() -> list[str]:
            return [open(os.path.join(logs, str(i)), encoding="utf-8", errors="replace").read()
                    for i in range(len(procs))]

        try:
            for i, argv in enumerate(argvs):
                with open(os.path.join(logs, str(i)), "wb") as log:
                    procs.append(start_python(argv, env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout_s
            codes = [p.wait(timeout=max(deadline - time.monotonic(), 0.01)) for p in procs]
        except subprocess.TimeoutExpired:
            statuses = [p.poll() for p in procs]  # None: still running
            raise AssertionError(f"peers still running after {timeout_s} s (status None): "
                                 f"{statuses}; their outputs: {outputs()}") from None
        finally:
            for p in procs:
                p.kill()
        return codes, outputs()


def result_line(out: str) -> dict:
    """The ``RESULT <json>`` line of a peer's output, parsed."""
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def run_gloo_peers(script: str, world: int, store_path: str, timeout_s: float = 80) -> list[dict]:
    """Runs `world` processes of `script` (argv: rank, world, a file-store
    path for ``init_process_group``; `run_python_all`); fails the test
    unless every one exits 0, and returns each rank's ``RESULT <json>``
    line, parsed."""
    codes, outs = run_python_all([[script, str(r), str(world), store_path] for r in range(world)],
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout_s=timeout_s)
    assert codes == [0] * world, outs
    return [result_line(out) for out in outs]
