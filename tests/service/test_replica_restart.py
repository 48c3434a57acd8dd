"""Every coordinator replica stopped and replaced by new ones (new processes'
worth of nothing in memory): all durable state is in etcd, so the new replicas
serve it as it was and go on from it. (SIGKILL of the leader mid-traffic is in
test_high_availability.)"""

from __future__ import annotations

import pytest

from agentsim import SimMember
from sbtest import leader_of, wait_for
from springback.client.api import Client

pytestmark = [pytest.mark.timeout(60), pytest.mark.secure_etcd]  # etcd behind TLS + auth


class TestRestartFromNothing:
    def test_new_replicas_serve_every_job_commit_and_generation_and_continue_them(
        self, etcd, start_coordinator, make_spec
    ):
        store = etcd.store()
        old = [start_coordinator(), start_coordinator()]
        wait_for(lambda: leader_of(store), 15, "a leader to be elected")
        with Client([r.address for r in old], timeout_s=5) as client:
            jobs = [client.create_job(make_spec(name=f"j{i}", max_workers=1,
                                                checkpoint={"uri": f"file:///tmp/rr{i}"})).id
                    for i in range(2)]
            member = SimMember([r.address for r in old], jobs[0])
            generation = client.get_job(jobs[0]).status.generation
            member.commit(generation, 10, "file:///tmp/rr0")
            member.close()
            before = {j: (client.get_job(j).status.generation,
                          [c.step for c in client.list_checkpoints(j)]) for j in jobs}
        for replica in old:
            replica.stop(grace_s=0.5)

        new = [start_coordinator(), start_coordinator()]
        wait_for(lambda: leader_of(store) in {r.address for r in new}, 15, "a new leader")
        with Client([r.address for r in new], timeout_s=5) as client:
            assert sorted(j.id for j in client.list_jobs()) == sorted(jobs)
            assert [c.step for c in client.list_checkpoints(jobs[0])] == before[jobs[0]][1] == [10]
            # The member (no agent heartbeats it now) expires; the new leader makes
            # the next generation number, never one issued before.
            job = wait_for(lambda: (j := client.get_job(jobs[0])).status.generation > generation
                           and j, 15, "the expiry to be replanned")
            assert job.status.generation == generation + 1 and list(job.status.members) == []
            joined = SimMember([r.address for r in new], jobs[0], port=9961)
            try:
                job = wait_for(lambda: (j := client.get_job(jobs[0])).status.members and j, 10,
                               "the new member to be planned")
                assert job.status.generation == generation + 2
                joined.commit(job.status.generation, 20, "file:///tmp/rr0")
                assert [c.step for c in client.list_checkpoints(jobs[0])] == [20, 10]
            finally:
                joined.close()
        store.close()
