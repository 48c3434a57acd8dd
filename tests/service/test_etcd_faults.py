"""A 3-member etcd cluster under the coordinators: lose a member, lose quorum.

Real etcd processes on loopback (`etcdcluster.EtcdCluster`); coordinators
in-process, given every member's endpoint. What must hold: losing one member
(the raft leader included) loses no job, member or commit and writes go on;
losing quorum makes the coordinators fail closed (no write acknowledged, never
two leaders at once) and, once quorum is back, the job resumes with nothing
lost. The members serve https:// with client certificates and etcd's auth
(the coordinators as the user limited to /springback/), as in production.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from agentsim import SimMember
from etcdcluster import EtcdCluster
from sbtest import wait_for
from springback.client.api import ApiError, Client

LIVENESS_S = 3.0


@pytest.fixture
def cluster(request, tmp_path):
    """Three etcd members; behind TLS + auth for a test marked `secure_etcd`."""
    secure = request.node.get_closest_marker("secure_etcd") is not None
    cluster = EtcdCluster(str(tmp_path / "etcd"), size=3,
                          tls=request.getfixturevalue("etcd_tls") if secure else None)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def replicas(cluster, start_coordinator):
    """Starts coordinator replicas on the cluster (every member's endpoint)."""
    return lambda: start_coordinator(etcd=cluster.endpoints, etcd_security=cluster.client_security,
                                     liveness_timeout_s=LIVENESS_S)


def state(client: Client, job_id: str) -> tuple:
    job = client.get_job(job_id)
    return (job.status.generation, list(job.status.members),
            [c.step for c in client.list_checkpoints(job_id)])


@pytest.mark.secure_etcd
class TestLosingOneEtcdMember:
    @pytest.mark.timeout(90)
    def test_losing_the_raft_leader_loses_nothing_and_writes_go_on(self, cluster, replicas, make_spec):
        server = replicas()
        wait_for(server.election.is_leader, 15, "the coordinator to lead")
        client = Client(server.address, timeout_s=5)
        job = client.create_job(make_spec(max_workers=1, checkpoint={"uri": "file:///tmp"}))
        member = SimMember([server.address], job.id)
        try:
            generation = client.get_job(job.id).status.generation
            member.commit(generation, 10)
            before = state(client, job.id)
            assert before == (generation, [member.id], [10])

            raft_leader = cluster.raft_leader()
            raft_leader.stop(kill=True)
            killed = time.monotonic()
            after_job = wait_for(lambda: client.create_job(make_spec(name="after")), 30,
                                 "a write to be acknowledged again")
            print(f"raft leader killed: writes acknowledged again after "
                  f"{time.monotonic() - killed:.1f} s")
            assert cluster.raft_leader() is not raft_leader
            assert state(client, job.id) == before  # nothing lost, nobody expired
            member.commit(generation, 20)
            assert sorted(j.id for j in client.list_jobs()) == sorted([job.id, after_job.id])
            assert [c.step for c in client.list_checkpoints(job.id)] == [20, 10]
            assert member.failures["NOT_FOUND"] == 0
        finally:
            member.close()
            client.close()


@pytest.mark.secure_etcd
class TestLosingQuorum:
    @pytest.mark.timeout(120)
    def test_coordinators_fail_closed_then_the_job_resumes_with_nothing_lost(
        self, cluster, replicas, make_spec
    ):
        first = replicas()
        wait_for(first.election.is_leader, 15, "the first replica to lead")
        second = replicas()
        addresses = [first.address, second.address]
        client = Client(addresses, timeout_s=3)
        job = client.create_job(make_spec(max_workers=1, checkpoint={"uri": "file:///tmp"}))
        member = SimMember(addresses, job.id)
        leaders_at_once: list[int] = []
        sampling = threading.Event()

        def sample_leadership() -> None:
            while not sampling.wait(0.02):
                leaders_at_once.append(first.election.is_leader() + second.election.is_leader())

        sampler = threading.Thread(target=sample_leadership, daemon=True)
        try:
            generation = client.get_job(job.id).status.generation
            member.commit(generation, 10)
            before = state(client, job.id)
            sampler.start()

            lost = [cluster.raft_leader()]
            lost.append(next(m for m in cluster.members if m is not lost[0]))
            for etcd_member in lost:
                etcd_member.stop(kill=True)
            outage_started = time.monotonic()
            acknowledged, attempts = [], 0
            while time.monotonic() - outage_started < 10:  # the outage lasts 10 s
                attempts += 1
                try:
                    acknowledged.append(client.create_job(make_spec(name=f"during{attempts}")).id)
                except ApiError as e:
                    assert e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
                                      grpc.StatusCode.DEADLINE_EXCEEDED), e
            assert acknowledged == [] and attempts > 0
            assert not first.election.is_leader() and not second.election.is_leader()

            for etcd_member in lost:
                etcd_member.start(wait=False)
            for etcd_member in lost:
                etcd_member.wait_serving(30)
            quorum_back = time.monotonic()
            resumed = wait_for(lambda: client.create_job(make_spec(name="after")), 30,
                               "writes to be acknowledged again")
            print(f"quorum lost {quorum_back - outage_started:.1f} s: {attempts} writes tried, "
                  f"0 acknowledged; writes again {time.monotonic() - quorum_back:.1f} s "
                  "after quorum returned")
            wait_for(lambda: state(client, job.id) == before, 15, "the job's state to be served")
            member.commit(generation, 20)  # the same generation resumes: nobody expired
        finally:
            sampling.set()
            if sampler.is_alive():
                sampler.join(5)
            member.close()
        assert max(leaders_at_once) == 1  # never two leaders at once
        names = sorted(j.spec.name for j in client.list_jobs())
        assert names == ["after", "test"], names  # nothing acknowledged during the outage
        assert resumed.spec.name == "after"
        assert [c.step for c in client.list_checkpoints(job.id)] == [20, 10]
        assert member.failures["NOT_FOUND"] == 0
        client.close()


@pytest.mark.secure_etcd
class TestWatches:
    @pytest.mark.timeout(60)
    def test_a_watch_hears_that_it_broke_when_etcd_goes_away(self, etcd):
        store = etcd.store()
        heard: list = []
        try:
            store.watch_prefix("/springback/v1/test/", heard.append)
            store.put("/springback/v1/test/a", b"1")
            wait_for(lambda: heard, 10, "the put to be delivered")
            etcd.stop(kill=True)
            wait_for(lambda: any(isinstance(r, Exception) for r in heard), 20,
                     "the watch to say that it broke")
        finally:
            store.close()
