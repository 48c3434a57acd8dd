"""Agent <-> coordinator over a faulty network: delay with jitter, resets, refusals.

A member (`agentsim.SimMember`: the agent's channel, cadence and deadlines)
reaches the coordinator only through a `NetProxy`. Short faults must cost
nothing (the member stays alive, its reports land once); a fault longer than
the liveness timeout fences it, and then nothing it sends counts.
"""

from __future__ import annotations

import time

import grpc
import pytest

from agentsim import SimMember
from netproxy import NetProxy
from sbtest import wait_for
from springback.service.etcd import keys
from springback.client.api import Client
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

pytestmark = pytest.mark.timeout(90)

LIVENESS_S = 3.0


class TestFaultyAgentLink:
    def test_short_faults_cost_nothing_and_a_long_one_fences_the_member(
        self, start_coordinator, make_spec
    ):
        coordinator = start_coordinator(liveness_timeout_s=LIVENESS_S)
        wait_for(coordinator.election.is_leader, 10, "the coordinator to lead")
        client = Client(coordinator.address)
        job = client.create_job(make_spec(max_workers=1, checkpoint={"uri": "file:///tmp/nf"}))
        with NetProxy(coordinator.address) as link:
            member = SimMember([link.address], job.id)
            try:
                generation = client.get_job(job.id).status.generation

                def beats_after(n: int) -> bool:
                    return member.num_ok >= n

                # 1. 200 ms +- 50 ms each way: slower, nothing lost.
                link.delay(0.2, jitter=0.05)
                start = member.num_ok
                wait_for(lambda: beats_after(start + 2 * 4), 20, "heartbeats over the slow link")
                assert member.report_step(generation, 5).generation == generation
                member.commit(generation, 5, "file:///tmp/nf")
                link.heal()
                # 2. Connections reset under the member, three times.
                for _ in range(3):
                    start = member.num_ok
                    link.reset()
                    wait_for(lambda: beats_after(start + 2), 10, "heartbeats after a reset")
                # 3. Refused connections for a third of the liveness timeout.
                link.refuse().reset()  # refused first: a reconnect between the two would go through
                refused_at = time.monotonic()
                wait_for(lambda: time.monotonic() - refused_at >= LIVENESS_S / 3
                         and link.num_refused > 0, 10, "refusals to last")
                start = member.num_ok
                link.heal()
                wait_for(lambda: beats_after(start + 2), 10, "heartbeats after the refusals")
                assert coordinator.store.get(keys.member(job.id, member.id)) is not None
                status = client.get_job(job.id).status
                assert status.generation == generation and status.step == 5
                assert [c.step for c in client.list_checkpoints(job.id)] == [5]
                assert member.failures["NOT_FOUND"] == 0  # short faults never fenced it

                # 4. Held beyond the liveness timeout: the member expires (fenced).
                link.hold()
                wait_for(lambda: coordinator.store.get(keys.member(job.id, member.id)) is None,
                         LIVENESS_S + 5, "the member to expire")
                link.reset().heal()
                member.stop_heartbeats()
                with pytest.raises(grpc.RpcError) as e:
                    member.heartbeat_once()
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
                for late in (lambda: member.commit(generation, 10, "file:///tmp/nf"),
                             lambda: member.report_step(generation, 10)):
                    with pytest.raises(grpc.RpcError) as e:
                        late()
                    assert e.value.code() in (grpc.StatusCode.NOT_FOUND,
                                              grpc.StatusCode.FAILED_PRECONDITION)
                stream = member.stub.WatchPlans(ws.WatchPlansRequest(
                    job_id=job.id, member_id=member.id), timeout=10)
                with pytest.raises(grpc.RpcError) as e:
                    next(stream)
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
                assert [c.step for c in client.list_checkpoints(job.id)] == [5]
                # replanned once the expiry settled (Reconciler.settled)
                wait_for(lambda: client.get_job(job.id).status.generation > generation, 10,
                         "a generation without the expired member")
            finally:
                member.close()
                client.close()

    def test_an_agent_retries_a_refusing_replica_at_most_about_a_second_apart(
        self, start_coordinator, make_spec
    ):
        # gRPC's default reconnect backoff (1 s, x1.6, +-20 %) leaves gaps of
        # 2.0-3.1 s by the third try: a 3 s outage then costs a 5 s liveness.
        coordinator = start_coordinator(liveness_timeout_s=30.0)
        wait_for(coordinator.election.is_leader, 10, "the coordinator to lead")
        job = Client(coordinator.address).create_job(make_spec(max_workers=1))
        with NetProxy(coordinator.address) as link:
            member = SimMember([link.address], job.id)
            try:
                link.refuse().reset()
                wait_for(lambda: len(link.refused_at) >= 1, 10, "a first refused try")
                first = link.refused_at[0]
                wait_for(lambda: link.refused_at[-1] - first >= 7.0, 20, "7 s of refused tries")
                link.heal()
                gaps = [b - a for a, b in zip(link.refused_at, link.refused_at[1:])]
                assert max(gaps) < 1.9, gaps  # 1 s +20 % jitter, and a loaded machine's lag
                member.heartbeat_once()  # and it is back
            finally:
                member.close()


class TestVanishedClient:
    def test_a_plan_stream_whose_client_went_silent_is_closed_by_the_servers_pings(
        self, start_coordinator, make_spec
    ):
        # A client whose host vanished sends no FIN: without the server's own
        # keepalive pings its connection and stream would stay for gRPC's 2 h.
        coordinator = start_coordinator(client_keepalive_s=1.0)
        wait_for(coordinator.election.is_leader, 10, "the coordinator to lead")
        job = Client(coordinator.address).create_job(make_spec())
        with NetProxy(coordinator.address) as link:
            channel = grpc.insecure_channel(link.address)  # no client keepalive
            try:
                stream = ws_grpc.WorkerServiceStub(channel).WatchPlans(
                    ws.WatchPlansRequest(job_id=job.id), timeout=60)
                wait_for(lambda: coordinator.plan_streams.num_open == 1, 10,
                         "the stream to open on the replica")
                link.hold()  # silent both ways: TCP stays up, nothing arrives
                wait_for(lambda: coordinator.plan_streams.num_open == 0, 15,
                         "the replica to close the silent client's stream")
                stream.cancel()
            finally:
                channel.close()
