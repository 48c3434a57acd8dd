"""A coordinator replica cut off from etcd while its clients still reach it.

The replica reaches etcd through a `NetProxy` whose link is held silent: TCP
stays up, nothing arrives (a partition, not a crash).
"""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from netproxy import NetProxy
from sbtest import wait_for
from springback.service import keys
from springback.service.channel import connect
from springback.service.client import Client
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_of(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=2).status


class Heartbeats:
    """Heartbeats of members as an agent sends them: every liveness/4, with the
    agent's deadline (at least 1 s), over a channel to every replica."""

    def __init__(self, stub, job_id: str, members: list[str], interval_s: float) -> None:  # noqa: ANN001
        self.num_ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(stub, job_id, m, interval_s),
                                          daemon=True) for m in members]
        for thread in self._threads:
            thread.start()

    def _run(self, stub, job_id: str, member: str, interval_s: float) -> None:  # noqa: ANN001
        request = ws.HeartbeatRequest(job_id=job_id, member_id=member)
        while not self._stop.wait(interval_s):
            try:
                stub.Heartbeat(request, timeout=max(interval_s, 1.0))
                self.num_ok += 1
            except grpc.RpcError as e:
                self.failures.append(f"{member}: {e.code().name} {e.details()}")

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)


class TestReplicaCutOffFromEtcd:
    def test_it_stops_serving_liveness_and_members_stay_alive_through_the_others(
        self, etcd, start_coordinator, make_spec
    ):
        leader = start_coordinator()
        wait_for(leader.election.is_leader, 10, "the first replica to lead")
        with NetProxy(etcd.endpoint) as link, Client(leader.address) as client:
            cut = start_coordinator(etcd=link.url)
            job = client.create_job(make_spec(max_workers=2))
            channel = connect([leader.address, cut.address])
            workers = ws_grpc.WorkerServiceStub(channel)
            members = [workers.JoinJob(ws.JoinJobRequest(
                job_id=job.id, host="127.0.0.1", rendezvous_port=9800 + i, num_local_ranks=1,
                join_token=f"node-{i}"), timeout=10).member.id for i in range(2)]
            generation = client.get_job(job.id).status.generation
            beats = Heartbeats(workers, job.id, members, interval_s=leader.config.liveness_timeout_s / 4)
            try:
                wait_for(lambda: beats.num_ok >= 4, 10, "heartbeats through both replicas")
                link.hold()  # the partition
                wait_for(lambda: health_of(cut.address) == NOT_SERVING, 5,
                         "the cut-off replica to say NOT_SERVING")
                with pytest.raises(grpc.RpcError) as e:  # straight to it: refused at once
                    with grpc.insecure_channel(cut.address) as direct:
                        ws_grpc.WorkerServiceStub(direct).Heartbeat(
                            ws.HeartbeatRequest(job_id=job.id, member_id=members[0]), timeout=1)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                # Three liveness timeouts' worth of heartbeats during the partition.
                during = beats.num_ok
                wait_for(lambda: beats.num_ok >= during + 12, 20, "heartbeats during the partition")
                link.heal()
                wait_for(lambda: health_of(cut.address) == SERVING, 10, "the replica to serve again")
            finally:
                beats.stop()
                channel.close()
            assert beats.failures == [], beats.failures
            for member in members:
                assert leader.store.get(keys.member(job.id, member)) is not None, member
            assert client.get_job(job.id).status.generation == generation  # nobody expired
