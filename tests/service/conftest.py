"""Fixtures of the coordinator tests."""

from __future__ import annotations

import grpc
import pytest

from springback.v1 import worker_service_pb2_grpc as ws_grpc


@pytest.fixture
def workers(coordinator):
    """A WorkerService stub on a plain channel to the `coordinator` fixture's replica."""
    channel = grpc.insecure_channel(coordinator.address)
    yield ws_grpc.WorkerServiceStub(channel)
    channel.close()
