"""The leader's watch on the members (service/core/memberwatch.py), against a
real coordinator and etcd: the reconcile loop takes each job's membership
fingerprint from it instead of a sorted read of etcd per pass, and falls back
to that read, replanning joins and expiries as before, while the watch may
have missed an event."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import pytest

from sbtest import wait_for
from springback.client.api import Client
from springback.client.errors import StoreUnavailable
from springback.service.etcd import keys
from springback.service.etcd.store import Store
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc


def join(workers: ws_grpc.WorkerServiceStub, job_id: str, port: int) -> str:
    return workers.JoinJob(ws.JoinJobRequest(job_id=job_id, host="127.0.0.1", rendezvous_port=port,
                                             num_local_ranks=1), timeout=10).member.id


def planned(server, job_id: str) -> set[str]:  # noqa: ANN001
    plan = server.coordinator.current_plan(job_id)
    return {m.member_id for m in plan.members} | set(plan.spares) if plan else set()


def count_job_fingerprints(store: Store) -> list[str]:
    """Wraps `store.fingerprint`: the prefixes of its reads of one job's
    members (the sorted read the watch replaces) are appended to the list."""
    read = store.fingerprint
    reads: list[str] = []

    def counted(prefix: str) -> tuple[int, int]:
        if prefix.startswith(keys.MEMBERS) and prefix != keys.MEMBERS:
            reads.append(prefix)
        return read(prefix)

    store.fingerprint = counted  # type: ignore[method-assign]
    return reads


@pytest.fixture
def stub(coordinator) -> Iterator[ws_grpc.WorkerServiceStub]:  # noqa: ANN001
    channel = grpc.insecure_channel(coordinator.address)
    yield ws_grpc.WorkerServiceStub(channel)
    channel.close()


@pytest.mark.timeout(60)
def test_a_burst_of_joins_and_a_leave_are_planned_with_no_sorted_read_per_pass(
        start_coordinator, make_spec):
    server = start_coordinator(liveness_timeout_s=30.0)  # no heartbeats needed here
    wait_for(server.election.is_leader, 10, "the coordinator to lead")
    store = server.coordinator.store
    read = store.fingerprint
    reads = count_job_fingerprints(store)
    channel = grpc.insecure_channel(server.address)
    workers = ws_grpc.WorkerServiceStub(channel)
    try:
        with Client(server.address) as client:
            job = client.create_job(make_spec(min_workers=1, max_workers=20))
        first = join(workers, job.id, 5000)  # answered once planned: passes ran
        burst = [threading.Thread(target=join, args=(workers, job.id, 5001 + i)) for i in range(10)]
        for thread in burst:
            thread.start()
        for thread in burst:
            thread.join(20)
        wait_for(lambda: len(planned(server, job.id)) == 11, 15, "a plan with all 11")
        last = join(workers, job.id, 5011)  # the newest member key
        wait_for(lambda: len(planned(server, job.id)) == 12, 15, "a plan with all 12")
        workers.LeaveJob(ws.LeaveJobRequest(job_id=job.id, member_id=last), timeout=10)
        wait_for(lambda: last not in planned(server, job.id), 15, "a plan without the leaver")
        assert first in planned(server, job.id)
        assert reads == [], f"{len(reads)} sorted fingerprint reads of the job's members"
        watch = server.coordinator.member_watch
        assert watch.live and watch.num_rebuilds == 1 and watch.num_misses == 0
        # the watched value is the one a read returns (the newest key deleted too)
        wait_for(lambda: watch.fingerprint(job.id) == read(keys.members(job.id)), 10,
                 "the watched fingerprint to be etcd's")
    finally:
        channel.close()


@pytest.mark.timeout(60)
def test_a_watch_that_dies_silently_and_cannot_be_made_again_still_replans_joins_and_expiries(
        coordinator, client, stub, make_spec):
    """The watch is cancelled in etcd (its callback hears nothing) and every
    new watch on the members is refused: the check finds the join it missed,
    the reconcile loop reads the fingerprints from etcd, the join and a
    member's expiry (liveness 2 s) are planned; once a watch can be made
    again the loop uses it again."""
    watch = coordinator.coordinator.member_watch
    store = coordinator.coordinator.store
    wait_for(lambda: watch.live, 10, "the members watch to start")
    job = client.create_job(make_spec(min_workers=1, max_workers=3))
    alive: set[str] = set()
    stopping = threading.Event()

    def heartbeats() -> None:  # the agents' own pace: liveness timeout / 4
        while not stopping.wait(0.5):
            for member in list(alive):
                stub.Heartbeat(ws.HeartbeatRequest(job_id=job.id, member_id=member), timeout=5)

    beating = threading.Thread(target=heartbeats, daemon=True)
    beating.start()
    try:
        a = join(stub, job.id, 6001)
        alive.add(a)
        b = join(stub, job.id, 6002)
        alive.add(b)
        wait_for(lambda: planned(coordinator, job.id) == {a, b}, 10, "a plan with a and b")
        in_line = store.fingerprint(keys.members(job.id))  # nothing left to plan: the loop
        wait_for(lambda: coordinator.coordinator.job_state(job.id).fingerprint == in_line, 10,
                 "the loop to find the members in line with the plan")  # reads them no more
        reads = count_job_fingerprints(store)
        refuse_member_watches(store)
        store.cancel_watch(watch.watch_id)  # etcd stops sending; nobody is told
        c = join(stub, job.id, 6003)
        alive.add(c)
        wait_for(lambda: planned(coordinator, job.id) == {a, b, c}, 15, "c planned")
        assert not watch.live and watch.num_misses == 1
        assert reads, "planned from etcd's fingerprint"
        alive.discard(b)  # b stops heartbeating: its lease expires in 2 s
        wait_for(lambda: planned(coordinator, job.id) == {a, c}, 15, "b's expiry planned")
        assert not watch.live
        del store.watch_prefix  # watches can be made again
        wait_for(lambda: watch.live, 10, "the members watch to start again")
        wait_for(lambda: watch.fingerprint(job.id) == store.fingerprint(keys.members(job.id)),
                 10, "the watched fingerprint to be etcd's")
        assert watch.num_rebuilds == 2
    finally:
        stopping.set()
        beating.join(5)


def refuse_member_watches(store: Store) -> Callable[..., object]:
    """Makes `store.watch_prefix` refuse the members prefix (as an
    unreachable etcd would); other watches (the plan board's) are made."""
    watch_prefix = store.watch_prefix

    def refused(prefix: str, callback: Callable[[object], None],
                start_revision: int | None = None) -> object:
        if prefix == keys.MEMBERS:
            raise StoreUnavailable("etcd unavailable: (test) no watch on the members")
        return watch_prefix(prefix, callback, start_revision)

    store.watch_prefix = refused  # type: ignore[method-assign]
    return watch_prefix
