"""Fixtures on real parts: an etcd server per test, coordinators on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from sbtest import CoordinatorProcess
from springback.client.api import Client
from springback.cli.local import EtcdServer
from springback.service.server import CoordinatorConfig, CoordinatorServer


@pytest.fixture
def etcd(tmp_path) -> Iterator[EtcdServer]:
    """A fresh etcd server (own data dir, free ports) for one test."""
    server = EtcdServer(str(tmp_path / "etcd"))
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
        config = dict(etcd=etcd.endpoint, listen="127.0.0.1:0", liveness_timeout_s=2.0,
                      leader_ttl_s=2, progress_flush_s=1.0)
        config.update(overrides)
        server = CoordinatorServer(CoordinatorConfig(**config))
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace_s=0.5)


@pytest.fixture
def coordinator(start_coordinator) -> CoordinatorServer:
    """One leader replica (waits until it leads)."""
    from sbtest import wait_for

    server = start_coordinator()
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
        process = CoordinatorProcess(etcd.endpoint, *args,
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
