"""Replicas, leader failover and etcd restarts: nothing lost, nothing issued twice.

Against an etcd as production runs it: https:// with client certificates and
etcd's auth (user ``springback`` limited to /springback/): marked
`secure_etcd` (tests/conftest.py).
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from sbtest import wait_for
from springback.service.etcd import keys
from springback.service.etcd.election import Election
from springback.service.transport.interceptors import LeaderForwarding
from springback.client.api import ApiError, Client
from springback.cli.local import EtcdServer
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

pytestmark = [pytest.mark.timeout(90), pytest.mark.secure_etcd]


def leader_of(etcd: EtcdServer) -> str | None:
    store = etcd.store()
    try:
        entry = store.get(keys.LEADER)
        return entry.value.decode() if entry else None
    finally:
        store.close()


class TestLeaderFailover:
    def test_killing_the_leader_mid_traffic_loses_nothing(self, etcd, spawn_coordinator, make_spec):
        replicas = [spawn_coordinator(), spawn_coordinator()]
        wait_for(lambda: leader_of(etcd), 15, "a leader to be elected")
        leader = next(r for r in replicas if r.address == leader_of(etcd))
        follower = next(r for r in replicas if r is not leader)
        client = Client([r.address for r in replicas], timeout_s=5)
        workers = ws_grpc.WorkerServiceStub(grpc.insecure_channel(follower.address))

        # State before the failure: jobs, members, generations, a commit.
        jobs = [client.create_job(make_spec(name=f"j{i}", max_workers=2,
                                            checkpoint={"uri": "file:///tmp/ck"})).id
                for i in range(3)]
        member = workers.JoinJob(ws.JoinJobRequest(job_id=jobs[0], host="127.0.0.1",
                                                   rendezvous_port=4000, num_local_ranks=1), timeout=10)
        generation = client.get_job(jobs[0]).status.generation
        workers.CommitCheckpoint(ws.CommitCheckpointRequest(
            job_id=jobs[0], member_id=member.member.id, generation=generation,
            checkpoint=pb.CheckpointRef(step=5, uri=f"file:///tmp/ck/{jobs[0]}/step-5")), timeout=10)

        # Traffic during the failover: keep creating jobs and reading them back.
        created: list[str] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def heartbeats() -> None:
            # As an agent does, on its own thread; the follower serves them
            # without a leader, so the member outlives the failover.
            heartbeat = ws.HeartbeatRequest(job_id=jobs[0], member_id=member.member.id)
            while not stop.wait(0.25):
                try:
                    workers.Heartbeat(heartbeat, timeout=1)
                except grpc.RpcError as e:
                    errors.append(e)

        def traffic() -> None:
            while not stop.is_set():
                try:
                    created.append(client.get_job(jobs[1]).id)
                except ApiError as e:
                    if e.code != grpc.StatusCode.UNAVAILABLE:
                        errors.append(e)

        threads = [threading.Thread(target=f, daemon=True) for f in (traffic, heartbeats)]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: len(created) > 5, 10, "traffic through the leader")
            leader.kill()
            wait_for(lambda: leader_of(etcd) == follower.address, 15,
                     "the follower to take over")
            served = len(created)
            wait_for(lambda: len(created) > served + 5, 15, "calls served by the new leader")
        finally:
            stop.set()
            for thread in threads:
                thread.join(10)
        assert errors == []

        # Nothing lost: every job, the member, the generation and the commit.
        assert sorted(j.id for j in client.list_jobs()) == sorted(jobs)
        job = client.get_job(jobs[0])
        assert job.status.generation == generation and list(job.status.members) == [member.member.id]
        assert [c.step for c in client.list_checkpoints(jobs[0])] == [5]
        # The new leader keeps the member alive and issues the *next* generation.
        workers.Heartbeat(ws.HeartbeatRequest(job_id=jobs[0], member_id=member.member.id), timeout=10)
        joined = workers.JoinJob(ws.JoinJobRequest(job_id=jobs[0], host="127.0.0.1",
                                                   rendezvous_port=4001, num_local_ranks=1), timeout=10)
        assert joined.member.id != member.member.id
        assert client.get_job(jobs[0]).status.generation == generation + 1
        client.close()

    def test_a_follower_forwards_every_call_to_the_leader(self, etcd, spawn_coordinator, make_spec):
        replicas = [spawn_coordinator(), spawn_coordinator()]
        wait_for(lambda: leader_of(etcd), 15, "a leader to be elected")
        follower = next(r for r in replicas if r.address != leader_of(etcd))
        with Client(follower.address) as client:
            job = client.create_job(make_spec())
            assert client.get_job(job.id).id == job.id
            with pytest.raises(ApiError) as e:
                client.get_job("missing")
            assert e.value.code == grpc.StatusCode.NOT_FOUND  # the leader's status, unchanged
            events = client.watch_job(job.id, timeout_s=10)
            first, _ = next(events)
            assert first.id == job.id
            events.close()


class TestEtcdRestart:
    def test_the_coordinator_reconnects_after_etcd_restarts(self, etcd, coordinator, client, make_spec):
        job = client.create_job(make_spec())
        etcd.stop(kill=True)
        with pytest.raises(ApiError) as e:
            client.get_job(job.id)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        etcd.start()
        got = wait_for(lambda: client.get_job(job.id), 30, "the coordinator to serve again")
        assert got.id == job.id
        second = wait_for(lambda: client.create_job(make_spec(name="after")), 30, "writes to work again")
        assert sorted(j.id for j in client.list_jobs()) == sorted([job.id, second.id])


class TestCallsDuringAnElection:
    def test_a_call_that_finds_no_leader_waits_for_the_election_instead_of_failing(self, etcd):
        store = etcd.store()
        follower = Election(store, "127.0.0.1:1")  # never started: it never campaigns
        pool = futures.ThreadPoolExecutor(max_workers=1)
        forwarding = LeaderForwarding(follower, pool)
        looked = threading.Event()
        etcd_get = store.get

        def get(*args, **kwargs):  # tells when the forwarder has looked (no leader yet)
            looked.set()
            return etcd_get(*args, **kwargs)

        store.get = get  # type: ignore[method-assign]
        found: list = []
        waiter = threading.Thread(target=lambda: found.append(forwarding._find_leader(10.0)))
        try:
            waiter.start()
            assert looked.wait(5), "the forwarder never looked for the leader"
            store.put(keys.LEADER, b"127.0.0.1:7")  # a replica wins the election
            waiter.join(15)
            channel, why = found[0]
            assert channel is not None and why == ""
            assert list(forwarding._channels) == ["127.0.0.1:7"]
        finally:
            forwarding.close()
            pool.shutdown()
            store.close()

    def test_with_no_leader_elected_a_call_fails_unavailable_once_its_wait_is_over(self, etcd):
        store = etcd.store()
        pool = futures.ThreadPoolExecutor(max_workers=1)
        forwarding = LeaderForwarding(Election(store, "127.0.0.1:1"), pool)
        try:
            channel, why = forwarding._find_leader(0.3)
            assert channel is None and "no coordinator leader elected yet" in why
        finally:
            forwarding.close()
            pool.shutdown()
            store.close()


class TestResignation:
    def test_a_campaign_in_flight_when_the_replica_resigns_leaves_no_leader_record(self, etcd):
        """A replica told to stop (SIGTERM) while its campaign's transaction
        is on the wire must not keep what that campaign wins: it would hold
        the leader record, renewed by no one, for a whole lease TTL, and no
        successor could be elected meanwhile (test_drain's hand-over)."""
        store = etcd.store()
        etcd_transaction = store.transaction
        on_the_wire, go_on = threading.Event(), threading.Event()

        def transaction(*args, **kwargs):  # the campaign's create-only put waits
            on_the_wire.set()
            assert go_on.wait(10)
            return etcd_transaction(*args, **kwargs)

        store.transaction = transaction  # type: ignore[method-assign]
        election = Election(store, "127.0.0.1:1", ttl_s=10)
        resigning = threading.Thread(target=election.resign)
        try:
            election.start()
            assert on_the_wire.wait(10), "the replica never campaigned"
            resigning.start()
            wait_for(election._stop.is_set, 5, "the resignation to begin")  # noqa: SLF001
            go_on.set()
            resigning.join(10)
            assert not resigning.is_alive()
            assert store.get(keys.LEADER) is None
            assert not election.is_leader()
        finally:
            go_on.set()
            store.close()
