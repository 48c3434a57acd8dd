"""Hundreds of simulated agents on two replicas: one settled plan, no false expiry, a failover survived."""

from __future__ import annotations

import time

import pytest

from agentsim import SimFleet, SimMember
from sbtest import wait_for
from springback.service import keys
from springback.client.api import Client
from springback.service.store import Store
from springback.v1 import worker_service_pb2 as ws

N = 500


def _leader(store: Store) -> str | None:
    entry = store.get(keys.LEADER)
    return entry.value.decode() if entry else None


@pytest.mark.timeout(300)
def test_500_agents_settle_into_one_plan_and_survive_a_leader_kill(etcd, spawn_coordinator,
                                                                   make_spec):
    replicas = [spawn_coordinator("--liveness-timeout-s", "10") for _ in range(2)]
    addresses = [r.address for r in replicas]
    store = Store(etcd.endpoint)
    fleet = None
    try:
        wait_for(lambda: _leader(store), 20, "a leader")
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

            leader = _leader(store)
            next(r for r in replicas if r.address == leader).kill()
            killed_at = time.monotonic()
            wait_for(lambda: _leader(store) not in (None, leader), 30, "a new leader")
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
