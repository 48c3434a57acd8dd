"""Leader fencing: a replica that acted as leader after its lease ran out writes nothing.

The old leader reaches etcd through a `NetProxy`; its clients reach it
directly. Holding its link to etcd makes the classic split: its writes were
decided while it led, but reach etcd only after a successor was elected. The
fencing comparison (the leader record's create revision) is the only thing
that stops them; remove it from the leader-only transactions and the first
test fails. The second pauses a leader subprocess (SIGSTOP) past its TTL:
it wakes as a follower (its belief ended with its local lease deadline),
forwards what was queued for it, and makes no generation; every generation
number was made by exactly one replica.
"""

from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest

from netproxy import NetProxy
from sbtest import leader_of, scrape, wait_for
from springback.service.etcd import keys
from springback.client.api import ApiError, Client
from springback.cli.local import free_port
from springback.v1 import job_service_pb2 as js
from springback.v1 import job_service_pb2_grpc as js_grpc
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

# etcd behind TLS + auth; the NetProxy relays its TLS bytes as they are
pytestmark = [pytest.mark.timeout(60), pytest.mark.secure_etcd]


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
            store = etcd.store()
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


def _metric(address: str, name: str) -> float:
    return scrape(address)[name]


class TestPausedLeader:
    def test_a_leader_paused_past_its_ttl_wakes_as_a_follower_and_writes_nothing(
        self, etcd, spawn_coordinator, make_spec
    ):
        ports = [free_port(), free_port()]
        old = spawn_coordinator("--metrics-listen", f"127.0.0.1:{ports[0]}")
        store = etcd.store()
        wait_for(lambda: leader_of(store) == old.address, 15, "the first replica to lead")
        new = spawn_coordinator("--metrics-listen", f"127.0.0.1:{ports[1]}")
        old_metrics, new_metrics = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
        with Client(old.address) as client, grpc.insecure_channel(old.address) as channel:
            job = client.create_job(make_spec(max_workers=2))
            workers = ws_grpc.WorkerServiceStub(channel)
            join = ws.JoinJobRequest(job_id=job.id, host="127.0.0.1", rendezvous_port=9950,
                                     num_local_ranks=1, join_token="before-pause")
            workers.JoinJob(join, timeout=10)
            made_before = _metric(old_metrics, "springback_coordinator_generations_total")

            os.killpg(old.process.pid, signal.SIGSTOP)
            try:
                wait_for(lambda: leader_of(store) == new.address, 15, "the other replica to lead")
                outcomes: list[object] = []

                def join_via_the_paused_one() -> None:  # queued in its socket meanwhile
                    try:
                        outcomes.append(workers.JoinJob(ws.JoinJobRequest(
                            job_id=job.id, host="127.0.0.1", rendezvous_port=9951,
                            num_local_ranks=1, join_token="during-pause"), timeout=20))
                    except grpc.RpcError as e:
                        outcomes.append(e)

                sender = threading.Thread(target=join_via_the_paused_one)
                sender.start()
                with Client(new.address) as via_new:
                    via_new.scale_job(job.id, 1, 3)  # the successor writes meanwhile
            finally:
                os.killpg(old.process.pid, signal.SIGCONT)
            sender.join(30)
            assert len(outcomes) == 1
            wait_for(lambda: _metric(old_metrics, "springback_coordinator_is_leader") == 0, 5,
                     "the woken replica to know it follows")
            assert _metric(old_metrics, "springback_coordinator_generations_total") == made_before
            # Every generation was made by exactly one replica: the woken one made
            # none after the pause, and no number was issued twice.
            plan = Client(new.address).get_job(job.id).status.generation
            made_after = _metric(new_metrics, "springback_coordinator_generations_total")
            assert made_before + made_after == plan
        store.close()
