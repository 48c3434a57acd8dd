"""Member input is bounded (issue 43): a bad join field is refused by name on
leader and follower, writing nothing; joins beyond a job's member cap are
RESOURCE_EXHAUSTED; members' free text is stored cut and logged on one line;
one job's planner error waits that job, named, while other jobs plan on."""

from __future__ import annotations

import logging

import grpc
import pytest

from sbtest import wait_for
from springback.service.etcd import keys
from springback.service.core.membership import members_cap
from springback.service.transport.servicers import MAX_REASON_CHARS
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

HUGE = "forged line\n" * 17_000  # 204,000 characters, a newline every 12


def join_request(job_id: str, port: int = 9701, ranks: int = 1, token: str = "",
                 host: str = "127.0.0.1") -> ws.JoinJobRequest:
    return ws.JoinJobRequest(job_id=job_id, host=host, rendezvous_port=port,
                             num_local_ranks=ranks, join_token=token)


def etcd_view(server, job_id: str) -> tuple:
    """What the job has in etcd: its members' keys and values, and the job and
    plan records' revisions."""
    store = server.store
    members = tuple((e.key, e.value) for e in store.get_prefix(keys.members(job_id)))
    job, plan = store.get(keys.job(job_id)), store.get(keys.plan(job_id))
    return members, job.mod_revision, plan.mod_revision if plan else 0


def planned(server, job_id: str, member_id: str) -> bool:
    plan = server.coordinator.current_plan(job_id)
    return plan is not None and plan.action == pb.PLAN_ACTION_RUN and any(
        m.member_id == member_id for m in plan.members)


BAD_JOINS = [
    ("num_local_ranks", {"ranks": 2**32 - 1}),
    ("num_local_ranks", {"ranks": 1025}),
    ("num_local_ranks", {"ranks": 0}),
    ("rendezvous_port", {"port": 0}),
    ("rendezvous_port", {"port": 65536}),
    ("host", {"host": "evil\nhost"}),
    ("join_token", {"token": "t\n" * 10}),
]


class TestABadJoinFieldIsRefusedByName:
    @pytest.mark.timeout(90)
    @pytest.mark.parametrize("replica", ["leader", "follower"])
    def test_on_any_replica_writing_nothing_while_jobs_plan_on(
            self, start_coordinator, make_spec, replica):
        leader = start_coordinator()
        wait_for(leader.election.is_leader, 10, "a leader")
        follower = start_coordinator()
        wait_for(lambda: follower.election.leader_address(), 10, "the follower to see the leader")
        target = leader if replica == "leader" else follower
        from springback.client.api import Client

        with Client([leader.address]) as client:
            job = client.create_job(make_spec(name="aaa", max_workers=2))
            other = client.create_job(make_spec(name="zzz", max_workers=1))
        with grpc.insecure_channel(target.address) as channel:
            workers = ws_grpc.WorkerServiceStub(channel)
            first = workers.JoinJob(join_request(job.id), timeout=10).member
            wait_for(lambda: planned(leader, job.id, first.id), 10, "the first member planned")
            before = etcd_view(leader, job.id)
            forwarded = follower._forwarding.num_forwarded  # noqa: SLF001
            for field, bad in BAD_JOINS:
                with pytest.raises(grpc.RpcError) as e:
                    workers.JoinJob(join_request(job.id, **bad), timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, bad)
                assert e.value.details().startswith(f"{field}:"), e.value.details()
            assert etcd_view(leader, job.id) == before  # nothing written for them
            if replica == "follower":  # refused there, not a round trip to the leader
                assert follower._forwarding.num_forwarded == forwarded  # noqa: SLF001
            # both jobs plan on: a join to each is planned promptly
            second = workers.JoinJob(join_request(job.id, port=9702), timeout=10).member
            lone = workers.JoinJob(join_request(other.id, port=9703), timeout=10).member
        wait_for(lambda: planned(leader, job.id, second.id), 5, "the job's next member planned")
        wait_for(lambda: planned(leader, other.id, lone.id), 5, "the second job planned")
        assert leader.reconciler.num_loop_errors == 0


class TestTheMembersCap:
    @pytest.mark.timeout(90)
    def test_joins_beyond_the_cap_are_resource_exhausted_and_a_retry_still_lands(
            self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(max_workers=1))
        cap = members_cap(job.spec)
        assert cap == 9  # max_workers 1, at least 8 spares
        joined = [workers.JoinJob(join_request(job.id, 9000 + i, token=f"t-{i}"), timeout=10).member
                  for i in range(cap)]
        before = etcd_view(coordinator, job.id)
        for i in range(3):
            with pytest.raises(grpc.RpcError) as e:
                workers.JoinJob(join_request(job.id, 9500 + i, token=f"over-{i}"), timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.details().startswith("members:") and str(cap) in e.value.details()
        retried = workers.JoinJob(join_request(job.id, 9000, token="t-0"), timeout=10).member
        assert retried.id == joined[0].id  # a retry of a join that landed is not over the cap
        assert etcd_view(coordinator, job.id)[0] == before[0]
        workers.LeaveJob(ws.LeaveJobRequest(job_id=job.id, member_id=joined[-1].id), timeout=10)
        workers.JoinJob(join_request(job.id, 9600, token="after-leave"), timeout=10)  # room again


def _springback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("springback")]


class TestMembersFreeText:
    @pytest.mark.timeout(60)
    def test_a_huge_state_lost_is_stored_cut_and_logged_on_one_line(
            self, coordinator, client, workers, make_spec, caplog):
        caplog.set_level(logging.INFO, logger="springback")
        job = client.create_job(make_spec(max_workers=2))
        member = workers.JoinJob(join_request(job.id), timeout=10).member
        wait_for(lambda: planned(coordinator, job.id, member.id), 10, "the member planned")
        generation = coordinator.coordinator.current_plan(job.id).generation
        workers.ReportStep(ws.ReportStepRequest(
            job_id=job.id, member_id=member.id, generation=generation, step=10), timeout=10)
        joiner = workers.JoinJob(join_request(job.id, port=9702), timeout=10).member
        wait_for(lambda: planned(coordinator, job.id, joiner.id), 10, "a generation with both")
        generation = coordinator.coordinator.current_plan(job.id).generation
        report = dict(job_id=job.id, member_id=member.id, generation=generation)
        workers.ReportStep(ws.ReportStepRequest(  # it starts from scratch: 10 steps lost
            **report, step=0, generation_start=True, restored_from=pb.RESTORE_KIND_NONE,
            state_lost=HUGE), timeout=10)
        workers.ReportStep(ws.ReportStepRequest(**report, step=1), timeout=10)  # shows the event
        stored = wait_for(lambda: next((e.state_lost for e in client.list_job_events(job.id)[1]
                                        if e.generation == generation and e.state_lost), None),
                          5, "the generation's event to record the loss")
        assert len(stored) == MAX_REASON_CHARS and "\n" not in stored
        assert stored.startswith("forged line\\nforged line\\n")
        message = client.get_job(job.id).status.message
        assert "state lost" in message and "\n" not in message
        lines = [line for line in _springback_lines(caplog) if "forged line" in line]
        assert lines and all("\n" not in line for line in lines)

    @pytest.mark.timeout(60)
    def test_huge_reasons_are_stored_cut_and_logged_on_one_line(
            self, coordinator, client, workers, make_spec, caplog):
        caplog.set_level(logging.INFO, logger="springback")
        job = client.create_job(make_spec(max_workers=3))
        a, b, c = (workers.JoinJob(join_request(job.id, 9700 + i), timeout=10).member
                   for i in range(3))
        wait_for(lambda: planned(coordinator, job.id, c.id), 10, "three members planned")
        workers.ReportFailure(ws.ReportFailureRequest(
            job_id=job.id, member_id=a.id, reason=HUGE,
            generation=coordinator.coordinator.current_plan(job.id).generation), timeout=10)
        workers.DrainMember(ws.DrainMemberRequest(job_id=job.id, member_id=b.id, reason=HUGE),
                            timeout=10)
        workers.LeaveJob(ws.LeaveJobRequest(job_id=job.id, member_id=c.id, reason=HUGE),
                         timeout=10)
        status, events = client.list_job_events(job.id)
        said = [status.status.message, *(e.reason for e in events)]
        assert all("\n" not in text for text in said)
        assert all(len(text) <= 3 * MAX_REASON_CHARS for text in said)  # three members' reasons
        assert sum("forged line\\n" in text for text in said) >= 3
        lines = [line for line in _springback_lines(caplog) if "forged line" in line]
        assert lines and all("\n" not in line for line in lines)


class TestAPlannerError:
    @pytest.mark.timeout(60)
    def test_waits_its_job_named_while_another_job_plans_on(
            self, coordinator, client, workers, make_spec, caplog):
        """Member records `JoinJob` would refuse, written straight to etcd (by
        an older coordinator, say): their job's planner raises. That job waits,
        its message names the error, it is not replanned on every pass, and a
        job after it in the reconcile loop's order is planned."""
        broken = client.create_job(make_spec(name="aaa", max_workers=2))
        other = client.create_job(make_spec(name="zzz", max_workers=1))
        for i in range(2):
            bad = pb.Member(id=f"m-bad{i}", job_id=broken.id, host="127.0.0.1",
                            rendezvous_port=9800 + i, num_local_ranks=2**32 - 1)
            coordinator.store.put(keys.member(broken.id, bad.id), bad)
        message = wait_for(lambda: next((m for m in [client.get_job(broken.id).status.message]
                                         if "planner error" in m), None),
                           10, "the planner error named")
        assert "num_local_ranks 4294967295" in message
        plan = coordinator.coordinator.current_plan(broken.id)
        assert plan.action == pb.PLAN_ACTION_WAIT and set(plan.spares) == {"m-bad0", "m-bad1"}
        lone = workers.JoinJob(join_request(other.id), timeout=10).member
        wait_for(lambda: planned(coordinator, other.id, lone.id), 5, "the other job planned")
        # settled: every live member is planned, so the broken job is not rewritten each pass
        revision = coordinator.store.get(keys.job(broken.id)).mod_revision
        later = coordinator.store.get(keys.plan(other.id)).mod_revision
        workers.LeaveJob(ws.LeaveJobRequest(job_id=other.id, member_id=lone.id), timeout=10)
        wait_for(lambda: coordinator.store.get(keys.plan(other.id)).mod_revision > later, 5,
                 "the other job replanned again")
        assert coordinator.store.get(keys.job(broken.id)).mod_revision == revision
        assert coordinator.reconciler.num_loop_errors == 0
        status = client.get_job(broken.id).status
        assert status.planner_error.startswith("planner error: ")
        assert status.planner_error in status.message
        # a third such member: replanned, the planner raises the same again
        bad = pb.Member(id="m-bad2", job_id=broken.id, host="127.0.0.1", rendezvous_port=9802,
                        num_local_ranks=2**32 - 1)
        coordinator.store.put(keys.member(broken.id, bad.id), bad)
        wait_for(lambda: "m-bad2" in coordinator.coordinator.current_plan(broken.id).spares, 10,
                 "the broken job replanned with the third member")
        logged = [r for r in caplog.records if "planner error" in r.getMessage()]
        assert len(logged) == 1, logged  # logged once, not at each replan that meets it


class TestAnUnreadableMemberRecord:
    @pytest.mark.timeout(60)
    def test_stops_only_its_own_job_in_the_reconcile_loop(
            self, coordinator, client, workers, make_spec):
        """A member record that is not a `Member` at all (bytes no replica
        wrote) makes its job's reconcile raise before the planner runs: the
        error is logged and counted, and a job after it in the loop's order
        is planned all the same (before, one job's error ended every pass)."""
        # full with it (max_workers 1): reconciled on every pass, with no settling wait
        broken = client.create_job(make_spec(name="aaa", max_workers=1))
        other = client.create_job(make_spec(name="zzz", max_workers=1))
        coordinator.store.put(keys.member(broken.id, "m-garbage"), b"\xff\xfe not a member")
        wait_for(lambda: coordinator.reconciler.num_loop_errors >= 1, 20,
                 "the broken job's reconcile to fail")
        lone = workers.JoinJob(join_request(other.id), timeout=10).member
        wait_for(lambda: planned(coordinator, other.id, lone.id), 10, "the other job planned")
