"""Fixtures on real parts: an etcd server per test, coordinators on loopback.

A test marked `secure_etcd` (``pytestmark = pytest.mark.secure_etcd``) gets
its `etcd` as production runs it: https:// with client certificates (a
throw-away CA, one per session) and etcd's auth (user ``root``; role
``springback`` readwrite on /springback/ only; user ``springback`` with that
role), and `start_coordinator` / `spawn_coordinator` reach it as that
limited user. Use ``etcd.store()`` for a Store of its own (it carries
the certificates and the password).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from etcdtls import make_certs, random_password
from sbtest import CoordinatorProcess
from springback.client.api import Client
from springback.cli.local import EtcdServer, EtcdServerTls
from springback.service.transport.config import CoordinatorConfig
from springback.service.transport.server import CoordinatorServer

SECURE_ETCD = "secure_etcd"
"""The marker that puts a test's `etcd` behind TLS and etcd's auth."""


@pytest.fixture(autouse=True)
def _root_logger_as_found() -> Iterator[None]:
    """Puts the root logger's handlers and level back after each test: the
    `springback` CLI run in-process (`cli.main.main`, `service.logs.configure`)
    replaces them with a handler on that test's captured stderr, closed once
    the test ends ("Logging error ... I/O operation on closed file" in every
    later test's teardown)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


BUSY_LOOPS = 2
"""Processes the `loaded` fixture keeps spinning: one per core of the 2-core
machines this suite is sized for, so the test's own processes get about
half the CPU they would on an idle machine (load ~ 2 + the test's)."""


SUITE_LIVENESS_S = 5.0
"""The liveness timeout of the in-process coordinators (`start_coordinator`,
`coordinator`): the product's default. Members' leases must outlive a loaded
two-worker run, where heartbeats (or a test's raw JoinJob and its next
reads) were starved past 2 s many times, each a fence no test asked for. A
test that waits for a lease to expire asks for a short one:
``@pytest.mark.liveness(2.0)`` (the `coordinator` fixture) or
``start_coordinator(liveness_timeout_s=...)``."""

LOAD_VARIABLE = "SPRINGBACK_TEST_LOAD"
"""Busy loops for the whole run (`_run_loaded`): the suite's loaded mode."""


def _busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _stop(loops: list[subprocess.Popen]) -> None:
    for p in loops:
        p.kill()
    for p in loops:
        p.wait(timeout=10)


@pytest.fixture(scope="session", autouse=True)
def _run_loaded(worker_id: str) -> Iterator[None]:
    """The suite's loaded mode: with ``SPRINGBACK_TEST_LOAD=N``, N CPU-bound
    processes spin from the run's first test to its end (started by one
    pytest-xdist worker only), so every test meets a machine as busy as a
    shared CI runner's; without it, nothing."""
    value = os.environ.get(LOAD_VARIABLE, "0")
    if not value.isdigit():
        raise pytest.UsageError(f"{LOAD_VARIABLE}={value!r}: a number of busy loops (0, 1, 2, ...)")
    loops = _busy_loops(int(value)) if worker_id in ("master", "gw0") else []
    try:
        yield
    finally:
        _stop(loops)


@pytest.fixture
def loaded() -> Iterator[list[subprocess.Popen]]:
    """Weather, not lab conditions: `BUSY_LOOPS` CPU-bound processes run
    beside the test and are killed at its teardown. A test that takes it
    asserts what it asserts on an idle machine, only slower."""
    loops = _busy_loops(BUSY_LOOPS)
    try:
        yield loops
    finally:
        _stop(loops)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{SECURE_ETCD}: the test's etcd serves https:// with "
                            "client certificates and etcd's auth; coordinators reach it as a "
                            "user limited to /springback/ (tests/conftest.py)")


@pytest.fixture(scope="session")
def etcd_tls(tmp_path_factory) -> EtcdServerTls:
    """Throw-away certificates (one CA for the session) and a password for
    etcd's user ``springback``."""
    return make_certs(str(tmp_path_factory.mktemp("etcd-certs")), password=random_password())


@pytest.fixture
def etcd(request: pytest.FixtureRequest, tmp_path) -> Iterator[EtcdServer]:
    """A fresh etcd server (own data dir, free ports) for one test; behind
    TLS and etcd's auth when the test is marked `secure_etcd`."""
    secure = request.node.get_closest_marker(SECURE_ETCD) is not None
    yield from _etcd_server(tmp_path, request.getfixturevalue("etcd_tls") if secure else None)


@pytest.fixture
def secure_etcd(tmp_path, etcd_tls: EtcdServerTls) -> Iterator[EtcdServer]:
    """An etcd on https:// with client certificates and etcd's auth, whatever
    the test's marks (for tests that need both kinds); ``client_security``
    reaches it as the limited user."""
    yield from _etcd_server(tmp_path, etcd_tls)


def _etcd_server(tmp_path, tls: EtcdServerTls | None) -> Iterator[EtcdServer]:
    server = EtcdServer(str(tmp_path / "etcd"), tls=tls)
    server.start()
    yield server
    server.stop(kill=True)


@pytest.fixture
def etcd_endpoint(etcd: EtcdServer) -> str:
    return etcd.endpoint


@pytest.fixture
def start_coordinator(etcd: EtcdServer) -> Iterator[Callable[..., CoordinatorServer]]:
    """Starts in-process coordinator replicas: ``start_coordinator(**config)``."""
    servers: list[CoordinatorServer] = []

    def start(**overrides) -> CoordinatorServer:
        config = dict(etcd=etcd.endpoint, etcd_security=etcd.client_security,
                      listen="127.0.0.1:0", liveness_timeout_s=SUITE_LIVENESS_S, leader_ttl_s=2,
                      progress_flush_s=1.0)
        config.update(overrides)
        server = CoordinatorServer(CoordinatorConfig(**config))
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace_s=0.5)


@pytest.fixture
def coordinator(start_coordinator, request) -> CoordinatorServer:
    """One leader replica (waits until it leads), at `SUITE_LIVENESS_S`, or at
    ``@pytest.mark.liveness(seconds)``'s: a test that waits for a member's
    lease to expire asks for a short one."""
    from sbtest import wait_for

    marker = request.node.get_closest_marker("liveness")
    server = start_coordinator(**({"liveness_timeout_s": float(marker.args[0])} if marker else {}))
    wait_for(server.election.is_leader, 10, "the coordinator to become leader")
    return server


@pytest.fixture
def coordinator_address(coordinator: CoordinatorServer) -> str:
    return coordinator.address


@pytest.fixture
def client(coordinator: CoordinatorServer) -> Iterator[Client]:
    with Client(coordinator.address) as c:
        yield c


@pytest.fixture
def spawn_coordinator(etcd: EtcdServer, tmp_path) -> Iterator[Callable[..., CoordinatorProcess]]:
    """Starts `springback coordinator` subprocesses (killable with SIGKILL)."""
    processes: list[CoordinatorProcess] = []

    def spawn(*extra: str) -> CoordinatorProcess:
        # No drain on SIGTERM unless a test asks for one (later flags win).
        args = ("--liveness-timeout-s", "2", "--leader-ttl-s", "2", "--drain-s", "0", *extra)
        process = CoordinatorProcess(etcd.endpoint, *args, etcd_flags=etcd.coordinator_flags(),
                                     log_path=str(tmp_path / f"coordinator-{len(processes)}.log"))
        processes.append(process)
        return process

    yield spawn
    for process in processes:
        process.stop()


def job_spec(**overrides) -> dict:
    """A valid spec mapping for tests; keyword arguments replace top-level keys."""
    spec = {
        "name": "test",
        "min_workers": 1,
        "max_workers": 3,
        "data": {"num_samples": 1024, "global_batch_size": 32, "seed": 1},
        "max_steps": 100,
    }
    spec.update(overrides)
    return spec


@pytest.fixture
def make_spec() -> Callable[..., dict]:
    return job_spec
