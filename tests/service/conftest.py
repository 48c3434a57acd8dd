"""Fixtures of the coordinator tests."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from etcdtls import make_certs, random_password
from springback.cli.local import EtcdServer, EtcdServerTls
from springback.v1 import worker_service_pb2_grpc as ws_grpc


@pytest.fixture(scope="session")
def etcd_tls(tmp_path_factory) -> EtcdServerTls:
    """Throw-away certificates (one CA for the session) and a password for
    etcd's user ``springback``."""
    return make_certs(str(tmp_path_factory.mktemp("etcd-certs")), password=random_password())


@pytest.fixture
def secure_etcd(tmp_path, etcd_tls: EtcdServerTls) -> Iterator[EtcdServer]:
    """An etcd on https:// with client certificates and auth enabled (user
    ``springback`` limited to /springback/); its ``client_security`` reaches it."""
    server = EtcdServer(str(tmp_path / "etcd"), tls=etcd_tls)
    server.start()
    yield server
    server.stop(kill=True)


@pytest.fixture
def workers(coordinator):
    """A WorkerService stub on a plain channel to the `coordinator` fixture's replica."""
    channel = grpc.insecure_channel(coordinator.address)
    yield ws_grpc.WorkerServiceStub(channel)
    channel.close()
