"""A hundred jobs on one replica set: every job settles, none starves, a leader kill costs none of them."""

from __future__ import annotations

import time

import pytest

from agentsim import SimFleet, kill_leader, start_replicas
from sbtest import wait_for
from springback.client.api import Client
from springback.service.etcd.store import Store

NUM_JOBS, NUM_AGENTS = 100, 10
SETTLE_S = 40.0  # every job, not the average, holds its plan within this


@pytest.mark.timeout(120)
def test_100_jobs_of_10_agents_all_settle_and_outlive_a_leader_kill(etcd, spawn_coordinator,
                                                                      make_spec):
    store = Store(etcd.endpoint)
    fleet = None
    try:
        replicas = start_replicas(spawn_coordinator, store, "--liveness-timeout-s", "10")
        addresses = [r.address for r in replicas]
        with Client(addresses) as client:
            jobs = [client.create_job(make_spec(
                name=f"job-{i}", max_workers=NUM_AGENTS,
                data={"num_samples": 10**6, "global_batch_size": NUM_AGENTS * 10})).id
                for i in range(NUM_JOBS)]
            # One fleet, one loop, a few channels for all 1,000 members.
            fleet = SimFleet.many(addresses, {job: NUM_AGENTS for job in jobs}).start()
            settled_at: dict[str, float] = {}

            def all_settled() -> bool:
                now = time.monotonic() - fleet.first_join_at
                for job in fleet.settled_jobs():
                    settled_at.setdefault(job, now)
                return len(settled_at) == NUM_JOBS

            # None starved: the wait is for every job, so the slowest one too
            # held its plan within SETTLE_S of the first join.
            wait_for(all_settled, SETTLE_S, f"all {NUM_JOBS} jobs holding one plan of {NUM_AGENTS}")
            assert fleet.expired == set() and not fleet.failures, fleet.failures
            generations = {job: client.get_job(job).status.generation for job in jobs}

            kill_leader(replicas, store, 30)
            beats = list(fleet.num_ok)
            # Every member of every job is still served: two more heartbeats each.
            wait_for(lambda: all(now >= then + 2 for now, then in zip(fleet.num_ok, beats)), 30,
                     "two heartbeats from every member after the kill")
            assert fleet.expired == set()
            assert {job: client.get_job(job).status.generation for job in jobs} == generations
            assert fleet.settled_jobs() == set(jobs)
    finally:
        if fleet is not None:
            fleet.close()
        store.close()
