"""Helpers shared by Springback's tests: waiting on conditions, real processes.

Nothing here fakes a component: etcd is the real binary, coordinators are real
gRPC servers (in-process or `springback coordinator` subprocesses).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Sequence
from typing import TypeVar

from springback.client.polling import wait_until

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


def run_gloo_peers(script: str, world: int, store_path: str, timeout_s: float = 80) -> list[dict]:
    """Runs `world` processes of `script` (argv: rank, world, a file-store
    path for ``init_process_group``), one thread each; fails the test unless
    every one exits 0, and returns each rank's ``RESULT <json>`` line, parsed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, script, str(r), str(world), store_path],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return [json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            for out in outs]
