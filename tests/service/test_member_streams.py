"""A member's plan stream: a fenced member is told NOT_FOUND on it."""

from __future__ import annotations

import threading

import grpc
import pytest

from agentsim import join
from sbtest import wait_for
from springback.v1 import worker_service_pb2 as ws

pytestmark = pytest.mark.timeout(60)


class TestPlanStreamOfAMember:
    def test_an_unknown_member_is_not_found_before_any_plan(self, client, workers, make_spec):
        job = client.create_job(make_spec())
        stream = workers.WatchPlans(ws.WatchPlansRequest(job_id=job.id, member_id="m-nobody"),
                                    timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            next(stream)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "m-nobody" in e.value.details()

    def test_the_stream_of_an_expired_member_ends_not_found_while_others_go_on(
        self, client, workers, make_spec
    ):
        job = client.create_job(make_spec(max_workers=2))
        a, b = join(workers, job.id, 9601), join(workers, job.id, 9602)
        stop = threading.Event()

        def keep_b_alive() -> None:
            while not stop.wait(0.3):
                try:
                    workers.Heartbeat(ws.HeartbeatRequest(job_id=job.id, member_id=b), timeout=2)
                except grpc.RpcError:
                    pass  # counted below: b must stay in the plan

        heartbeats = threading.Thread(target=keep_b_alive, daemon=True)
        heartbeats.start()
        streams = {m: workers.WatchPlans(ws.WatchPlansRequest(job_id=job.id, member_id=m),
                                         timeout=30) for m in (a, b)}
        try:
            first = {m: next(stream).plan for m, stream in streams.items()}
            assert first[a].generation == first[b].generation
            # a stops heartbeating: its lease expires, the leader replans without it.
            with pytest.raises(grpc.RpcError) as e:
                for _ in streams[a]:
                    pass
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert a in e.value.details()
            newer = wait_for(lambda: next(streams[b]).plan, 10, "b's next plan")
            assert newer.generation > first[b].generation
            assert [m.member_id for m in newer.members] == [b]
        finally:
            stop.set()
            heartbeats.join(5)
            for stream in streams.values():
                stream.cancel()
