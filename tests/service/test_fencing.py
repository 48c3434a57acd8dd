"""Leader fencing: a replica that acted as leader after its lease ran out writes nothing.

The old leader reaches etcd through a `NetProxy`; its clients reach it
directly. Holding its link to etcd makes the classic split: its writes were
decided while it led, but reach etcd only after a successor was elected. The
fencing comparison (the leader record's create revision) is the only thing
that stops them; remove it from the leader-only transactions and these tests
fail.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from netproxy import NetProxy
from sbtest import wait_for
from springback.service import keys
from springback.service.client import ApiError, Client
from springback.service.store import Store
from springback.v1 import job_service_pb2 as js
from springback.v1 import job_service_pb2_grpc as js_grpc
from springback.v1 import types_pb2 as pb

pytestmark = pytest.mark.timeout(60)

_CREATE = "/springback.v1.JobService/CreateJob"
_PAUSE = "/springback.v1.JobService/PauseJob"


class TestTwoReplicasActingAsLeader:
    def test_writes_of_a_leader_cut_off_from_etcd_are_refused_once_a_successor_leads(
        self, etcd, start_coordinator, make_spec
    ):
        with NetProxy(etcd.endpoint) as link:
            old = start_coordinator(etcd=link.url)
            wait_for(old.election.is_leader, 10, "the first replica to lead")
            new = start_coordinator()
            via_old = Client(old.address, timeout_s=20)
            raw_channel = grpc.insecure_channel(old.address)
            raw_old = js_grpc.JobServiceStub(raw_channel)
            job = via_old.create_job(make_spec(name="before"))
            store = Store(etcd.endpoint)
            before = store.get(keys.job(job.id), pb.Job)

            # The old leader's link to etcd goes silent; its clients still reach it.
            link.hold()
            outcomes: dict[str, object] = {}

            def call(name: str, fn) -> None:  # noqa: ANN001
                try:
                    outcomes[name] = fn()
                except (ApiError, grpc.RpcError) as e:
                    outcomes[name] = e

            calls = [
                threading.Thread(target=call, args=("create", lambda: via_old.create_job(
                    make_spec(name="stale")))),
                # A plain channel: the client library would retry this idempotent
                # call, and the retry, forwarded to the successor, may pause the job.
                threading.Thread(target=call, args=("pause", lambda: raw_old.PauseJob(
                    js.PauseJobRequest(job_id=job.id), timeout=20))),
            ]
            for thread in calls:
                thread.start()
            wait_for(lambda: old.counter.calls[_CREATE] == 2 and old.counter.calls[_PAUSE] == 1,
                     5, "both calls to reach the old leader")
            wait_for(new.election.is_leader, 15, "the successor to be elected")
            # The old replica stopped *believing* it leads before anyone else could.
            assert not old.election.is_leader()
            link.release()  # its queued writes now reach etcd, under a stale token
            for thread in calls:
                thread.join(30)

            assert all(isinstance(o, (ApiError, grpc.RpcError)) for o in outcomes.values()), outcomes
            # Only the successor writes: no job "stale", the job not paused, untouched.
            jobs = [e.value for e in store.get_prefix(keys.JOBS, pb.Job)]
            assert [j.spec.name for j in jobs] == ["before"]
            after = store.get(keys.job(job.id), pb.Job)
            assert after.mod_revision == before.mod_revision
            assert after.value.status.state != pb.JOB_STATE_PAUSED
            with Client(new.address) as via_new:
                assert via_new.pause_job(job.id).status.state == pb.JOB_STATE_PAUSED
            store.close()
            via_old.close()
            raw_channel.close()
