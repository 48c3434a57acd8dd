"""Hundreds of simulated agents on two replicas: one settled plan, no false expiry, a failover survived."""

from __future__ import annotations

import time
from datetime import timedelta

import psutil
import pytest

from agentsim import SimFleet, SimMember, _interval_in, kill_leader, members_placed, start_replicas
from sbtest import OPERATOR_TOKEN, wait_for
from springback.client.api import Client
from springback.service.etcd import keys
from springback.service.etcd.store import Store
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws

N = 500


@pytest.mark.timeout(300)
def test_500_agents_settle_into_one_plan_and_survive_a_leader_kill(etcd, spawn_coordinator,
                                                                   make_spec):
    store = Store(etcd.endpoint)
    fleet = None
    try:
        replicas = start_replicas(spawn_coordinator, store, "--liveness-timeout-s", "10")
        addresses = [r.address for r in replicas]
        with Client(addresses) as client:
            job = client.create_job(make_spec(
                max_workers=N, data={"num_samples": 10**6, "global_batch_size": 1000}))
            first_generation = client.get_job(job.id).status.generation
            fleet = SimFleet(addresses, job.id, N).start()
            wait_for(lambda: fleet.num_holding(N) == N, 120, f"one plan holding all {N}")
            settled = client.get_job(job.id).status.generation
            assert fleet.expired == set() and not fleet.failures, fleet.failures
            # A join storm is a few generations, not one per join.
            assert settled - first_generation <= 10, (first_generation, settled)

            killed_at = time.monotonic()
            kill_leader(replicas, store, 30)
            beats = len(fleet.heartbeat_s)
            # every member heartbeats at least twice more, through the survivor
            wait_for(lambda: len(fleet.heartbeat_s) >= beats + 2 * N, 60, "heartbeats after the kill")
            assert time.monotonic() - killed_at < 60
            assert fleet.expired == set()
            assert len(store.get_prefix(keys.members(job.id))) == N
            assert client.get_job(job.id).status.generation == settled  # nobody was lost
    finally:
        if fleet is not None:
            fleet.close()
        store.close()


AGENTS = 300


@pytest.mark.timeout(300)
def test_agents_each_on_its_own_connection_with_credentials_settle_into_one_plan(
        etcd, spawn_coordinator, make_spec):
    """As a cluster connects (issue 48): two replicas with an operator token;
    every simulated agent opens its own TCP connection, checks the job with
    the job's join credential (any replica answers), joins, then heartbeats
    and streams its plans on a connection of its own with its member
    credential. All at once: one plan holds all, nothing refused, nothing
    expired."""
    _storm(etcd, spawn_coordinator, make_spec, AGENTS)


@pytest.mark.soak  # ~30 s when it settles, ~1 GB
@pytest.mark.timeout(300)
def test_a_storm_of_2000_agents_each_on_its_own_connection_settles_on_a_loaded_machine(
        etcd, spawn_coordinator, make_spec, loaded):
    """Issue 48's target: the same with 2,000 agents while busy loops hold
    both cores. Not met yet: it settled in 3 of 4 runs here (18-20 s) after
    the replicas stopped calling themselves cut off on a late renewal and a
    join stopped sorting every member key; in the fourth 12 members expired
    (heartbeats past their deadline) and none holds a plan of all 2,000. Before
    those two changes it settled in 0 of 4 (69 to 1,084 members expired).
    With the reconcile loop's member watch (5ae5e59): 1 passed (22 s), 1
    settled but 10 plan streams were ended UNAVAILABLE (a liveness probe
    flap), and a run beside a full suite timed out (187 expired)."""
    _storm(etcd, spawn_coordinator, make_spec, 2000)


def _storm(etcd, spawn_coordinator, make_spec, n: int) -> None:  # noqa: ANN001
    store = Store(etcd.endpoint)
    fleet = None
    try:
        replicas = start_replicas(spawn_coordinator, store, "--token", OPERATOR_TOKEN,
                                  "--liveness-timeout-s", "10")
        addresses = [r.address for r in replicas]
        with Client(addresses, token=OPERATOR_TOKEN) as client:
            job = client.create_job(make_spec(
                max_workers=n, data={"num_samples": 10**6, "global_batch_size": n}))
            fleet = SimFleet(addresses, job.id, n,
                             join_credential=client.issue_join_credential(job.id)).start()
            try:
                wait_for(lambda: fleet.num_holding(n) == n, 240, f"one plan holding all {n}")
            except AssertionError as e:
                raise AssertionError(f"{e}: {fleet.num_joined} joined, "
                                     f"{fleet.num_holding(n)} holding a plan of all, "
                                     f"{len(fleet.expired)} expired, failures "
                                     f"{dict(fleet.failures)}") from None
            assert fleet.expired == set() and not fleet.failures, fleet.failures
            # one connection per agent: the member channels, each its own sockets
            ports = {int(a.rsplit(":", 1)[1]) for a in addresses}
            sockets = {(c.laddr.port, c.raddr.port)
                       for c in psutil.Process().net_connections("tcp")
                       if c.raddr and c.raddr.port in ports and c.status == "ESTABLISHED"}
            assert len(sockets) >= n, len(sockets)
            assert len(store.get_prefix(keys.members(job.id))) == n
    finally:
        if fleet is not None:
            fleet.close()
        store.close()


def test_heartbeats_joins_and_plan_streams_take_no_server_thread(start_coordinator, make_spec):
    # Two worker threads, both held by WatchJob streams (an operator's stream
    # holds one): heartbeats, joins and plan streams are still served.
    server = start_coordinator(max_workers=2)
    wait_for(server.election.is_leader, 10, "leadership")
    with Client(server.address) as client:
        job = client.create_job(make_spec(max_workers=4))
        watches = [client.watch_job(job.id, timeout_s=30) for _ in range(2)]
        for watch in watches:
            next(watch)  # open: each holds a worker thread now
        member = SimMember([server.address], job.id)
        try:
            member.heartbeat_once()
            plans = member.stub.WatchPlans(ws.WatchPlansRequest(job_id=job.id, member_id=member.id),
                                           timeout=10)
            assert member.id in [m.member_id for m in next(plans).plan.members]
            plans.cancel()
        finally:
            member.close()
            for watch in watches:
                watch.close()


class TestWhatTheSimulatorReadsFromItsMessages:
    @pytest.mark.timeout(10)
    def test_a_plan_slice_counts_its_node_runs_and_spares_not_its_own_entry(self):
        active = pb.Plan(members=[pb.PlanMember(member_id="m1")],
                         nodes=[pb.NodeRun(num_nodes=2, num_local_ranks=8),
                                pb.NodeRun(num_nodes=1, num_local_ranks=4)], num_spares=1)
        spare = pb.Plan(spares=["s"], nodes=[pb.NodeRun(num_nodes=3, num_local_ranks=8)],
                        num_spares=2)
        assert [members_placed(p) for p in (active, spare, pb.Plan())] == [4, 5, 0]

    @pytest.mark.timeout(10)
    def test_a_heartbeat_response_names_an_interval_only_when_it_sets_one(self):
        def raw(**fields) -> bytes:
            return ws.HeartbeatResponse(**fields).SerializeToString()

        assert _interval_in(raw()) is None
        assert _interval_in(raw(generation=300)) is None  # a multi-byte varint, nothing after it
        assert _interval_in(raw(generation=7, heartbeat_interval=timedelta(seconds=12.5))) == 12.5
        assert _interval_in(raw(heartbeat_interval=timedelta(milliseconds=250))) == 0.25
