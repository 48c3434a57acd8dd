"""The replica's health service under client channels that come and go."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sbtest import wait_for
from springback.client.channel import connect
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class TestHealthWatchers:
    def test_status_changes_never_block_while_watching_channels_close(self, coordinator):
        # Every Springback channel watches health (client-side health checking).
        channels = [connect([coordinator.address]) for _ in range(40)]
        for channel in channels:
            with pytest.raises(grpc.RpcError):  # any call: the channel connects and watches
                ws_grpc.WorkerServiceStub(channel).Heartbeat(
                    ws.HeartbeatRequest(job_id="none", member_id="none"), timeout=5)
        toggled = threading.Event()

        def toggle() -> None:
            for i in range(401):  # ends SERVING
                coordinator.health.set("", NOT_SERVING if i % 2 else SERVING)
            toggled.set()

        toggler = threading.Thread(target=toggle, daemon=True)
        toggler.start()
        for channel in channels:  # streams end while their status is being sent
            channel.close()
        assert toggled.wait(20), "health.set blocked"
        with grpc.insecure_channel(coordinator.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == SERVING

    def test_a_watching_channel_sees_not_serving_and_skips_the_replica(self, coordinator):
        with connect([coordinator.address]) as channel:
            stub = ws_grpc.WorkerServiceStub(channel)
            request = ws.HeartbeatRequest(job_id="none", member_id="none")
            with pytest.raises(grpc.RpcError) as e:
                stub.Heartbeat(request, timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND  # reached the replica
            coordinator.health.set("", NOT_SERVING)

            def refused_by_the_channel() -> bool:
                try:
                    stub.Heartbeat(request, timeout=1)
                except grpc.RpcError as e:  # not the replica's NOT_FOUND: never reached it
                    return e.code() in (grpc.StatusCode.UNAVAILABLE,
                                        grpc.StatusCode.DEADLINE_EXCEEDED)
                return False

            wait_for(refused_by_the_channel, 5, "the channel to skip the NOT_SERVING replica")
            coordinator.health.set("", SERVING)
            wait_for(lambda: not refused_by_the_channel(), 5, "the replica to be chosen again")
