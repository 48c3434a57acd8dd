"""A coordinator replica cut off from etcd while its clients still reach it.

The replica reaches etcd through a `NetProxy` whose link is held silent: TCP
stays up, nothing arrives (a partition, not a crash).
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agentsim import SimMember
from netproxy import NetProxy
from sbtest import wait_for
from springback.service.etcd import keys
from springback.client.api import Client
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

# etcd behind TLS + auth; the NetProxy relays its TLS bytes as they are
pytestmark = [pytest.mark.timeout(60), pytest.mark.secure_etcd]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_of(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=2).status


class TestReplicaCutOffFromEtcd:
    def test_it_stops_serving_liveness_and_members_stay_alive_through_the_others(
        self, etcd, start_coordinator, make_spec
    ):
        # Liveness 4 s (production: 5 s): detecting the cut (~1 s) plus one
        # heartbeat's deadline on it must fit well inside one timeout, also on
        # a loaded machine (at 2 s the full suite expired a member here once).
        leader = start_coordinator(liveness_timeout_s=4.0)
        wait_for(leader.election.is_leader, 10, "the first replica to lead")
        with NetProxy(etcd.endpoint) as link, Client(leader.address) as client:
            cut = start_coordinator(etcd=link.url, liveness_timeout_s=4.0)
            job = client.create_job(make_spec(max_workers=2))
            members = [SimMember([leader.address, cut.address], job.id, port=9800 + i)
                       for i in range(2)]
            generation = client.get_job(job.id).status.generation

            def ok() -> int:
                return sum(m.num_ok for m in members)

            try:
                wait_for(lambda: ok() >= 4, 10, "heartbeats through both replicas")
                link.hold()  # the partition
                wait_for(lambda: health_of(cut.address) == NOT_SERVING, 5,
                         "the cut-off replica to say NOT_SERVING")
                with pytest.raises(grpc.RpcError) as e:  # straight to it: refused at once
                    with grpc.insecure_channel(cut.address) as direct:
                        ws_grpc.WorkerServiceStub(direct).Heartbeat(
                            ws.HeartbeatRequest(job_id=job.id, member_id=members[0].id), timeout=1)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                # Three liveness timeouts' worth of heartbeats during the partition.
                during = ok()
                wait_for(lambda: ok() >= during + 12, 20, "heartbeats during the partition")
                link.heal()
                wait_for(lambda: health_of(cut.address) == SERVING, 10, "the replica to serve again")
            finally:
                for member in members:
                    member.close()
            assert [dict(m.failures) for m in members] == [{}, {}]
            for member in members:
                assert leader.store.get(keys.member(job.id, member.id)) is not None, member.id
            assert client.get_job(job.id).status.generation == generation  # nobody expired
