"""Members, generations and fencing against a real coordinator and etcd."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest

from sbtest import wait_for
from springback.client.api import Client
from springback.service.etcd import keys
from springback.service.core import departures
from springback.service.core.leases import MEMBER_CHECK_S
from springback.service.policy.failures import UNSTARTED_FACTOR
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

pytestmark = pytest.mark.timeout(60)


def join(workers, job_id: str, port: int, ranks: int = 1) -> str:
    response = workers.JoinJob(
        ws.JoinJobRequest(job_id=job_id, host="127.0.0.1", rendezvous_port=port,
                          num_local_ranks=ranks), timeout=10)
    return response.member.id


def plan_of(coordinator, job_id: str) -> pb.Plan:
    return coordinator.coordinator.current_plan(job_id)


def started(workers, coordinator, job_id: str, member_id: str, step: int = 0) -> None:
    """What rank 0 reports once its generation agreed on the state: it proves
    that every member of that generation holds the state of `step`."""
    generation = plan_of(coordinator, job_id).generation
    workers.ReportStep(ws.ReportStepRequest(
        job_id=job_id, member_id=member_id, generation=generation, step=step,
        generation_start=True, restored_from=pb.RESTORE_KIND_PEERS), timeout=5)


def keep_alive(workers, job_id: str, *members: str) -> None:
    for member in members:
        workers.Heartbeat(ws.HeartbeatRequest(job_id=job_id, member_id=member), timeout=5)


class TestGenerations:
    def test_joins_make_generations_with_stable_ranks(self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(min_workers=2, max_workers=3))
        a = join(workers, job.id, 5001)
        plan = plan_of(coordinator, job.id)
        assert plan.action == pb.PLAN_ACTION_WAIT and client.get_job(job.id).status.state == pb.JOB_STATE_PENDING
        b = join(workers, job.id, 5002)
        plan = plan_of(coordinator, job.id)
        assert plan.action == pb.PLAN_ACTION_RUN and plan.world_size == 2
        assert [m.member_id for m in plan.members] == [a, b]
        assert (plan.master_addr, plan.master_port) == ("127.0.0.1", 5001)
        started(workers, coordinator, job.id, a)
        c = join(workers, job.id, 5003)
        newer = plan_of(coordinator, job.id)
        assert newer.generation == plan.generation + 1 and newer.world_size == 3
        assert [(m.member_id, m.first_rank) for m in newer.members] == [(a, 0), (b, 1), (c, 2)]
        assert newer.restore.kind == pb.RESTORE_KIND_PEERS and newer.restore.source_rank == 0
        status = client.get_job(job.id).status
        assert status.state == pb.JOB_STATE_RUNNING and list(status.members) == [a, b, c]

    def test_a_report_from_a_plan_in_etcd_not_yet_cached_by_the_leader_is_current(
        self, coordinator, client, workers, make_spec
    ):
        """The window between a change's etcd write and the leader's cache of
        it (`Coordinator._applied`): a member that already read the new plan
        reports from it. Made here by writing that plan the way the change
        does, then reporting before anything else runs."""
        job = client.create_job(make_spec(min_workers=1, max_workers=3))
        a = join(workers, job.id, 6100)
        started(workers, coordinator, job.id, a)
        newer = plan_of(coordinator, job.id)
        newer.generation += 1
        coordinator.coordinator.store.put(keys.plan(job.id), newer.SerializeToString())
        started(workers, coordinator, job.id, a, step=0)  # generation + 1: taken, not stale
        assert coordinator.coordinator.current_generation(job.id) == newer.generation

    def test_a_member_that_stops_heartbeating_is_failed_and_replanned(
        self, coordinator, client, workers, make_spec
    ):
        job = client.create_job(make_spec(min_workers=1, max_workers=3))
        a, b, c = (join(workers, job.id, 6000 + i) for i in range(3))
        started(workers, coordinator, job.id, a)
        before = plan_of(coordinator, job.id)

        def b_gone() -> bool:
            keep_alive(workers, job.id, a, c)  # b stays silent
            return b not in [m.member_id for m in plan_of(coordinator, job.id).members]

        wait_for(b_gone, 15, "b to be declared failed after the liveness timeout")
        after = plan_of(coordinator, job.id)
        assert after.generation == before.generation + 1
        # a keeps rank 0; c moves into the vacated slot; state comes from survivors.
        assert [(m.member_id, m.node_rank) for m in after.members] == [(a, 0), (c, 1)]
        assert after.restore.kind == pb.RESTORE_KIND_PEERS
        assert "lost" in after.reason and b in after.reason
        with pytest.raises(grpc.RpcError) as e:  # b is fenced when it wakes up
            workers.Heartbeat(ws.HeartbeatRequest(job_id=job.id, member_id=b), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND

    def test_layout_sends_surplus_members_to_hot_spares(self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(min_workers=2, max_workers=4, layout={"tp": 2}))
        members = [join(workers, job.id, 7000 + i) for i in range(3)]
        plan = plan_of(coordinator, job.id)
        assert plan.world_size == 2 and plan.layout.dp == 1 and plan.layout.tp == 2
        assert list(plan.spares) == members[2:]
        generation = plan.generation
        fourth = join(workers, job.id, 7003)
        plan = plan_of(coordinator, job.id)
        assert plan.world_size == 4 and plan.generation == generation + 1
        assert [m.member_id for m in plan.members] == members + [fourth]

    def test_graceful_leave_and_drain_make_a_generation_without_the_member(
        self, coordinator, client, workers, make_spec
    ):
        job = client.create_job(make_spec(min_workers=1, max_workers=3))
        a, b = join(workers, job.id, 8001), join(workers, job.id, 8002)
        started(workers, coordinator, job.id, a)
        drained = workers.DrainMember(ws.DrainMemberRequest(job_id=job.id, member_id=b, reason="spot"),
                                      timeout=10)
        assert drained.checkpoint is False  # a still holds the state
        plan = plan_of(coordinator, job.id)
        assert [m.member_id for m in plan.members] == [a]
        # The last holder must checkpoint before it goes: nothing changes yet.
        last = workers.DrainMember(ws.DrainMemberRequest(job_id=job.id, member_id=a), timeout=10)
        assert last.checkpoint is True and plan_of(coordinator, job.id).generation == plan.generation
        workers.LeaveJob(ws.LeaveJobRequest(job_id=job.id, member_id=b), timeout=10)
        workers.LeaveJob(ws.LeaveJobRequest(job_id=job.id, member_id=a), timeout=10)
        workers.LeaveJob(ws.LeaveJobRequest(job_id=job.id, member_id=a), timeout=10)  # idempotent
        final = plan_of(coordinator, job.id)
        assert final.action == pb.PLAN_ACTION_WAIT and not final.members
        assert client.get_job(job.id).status.state == pb.JOB_STATE_PENDING

    def test_a_generation_made_by_another_writer_names_the_members_gone_and_why(
        self, coordinator, client, workers, make_spec
    ):
        """A fence revokes a member's lease, then replans; a progress write that
        reads the membership in between makes that generation. Its reason still
        names the lost member and the evidence, a member whose lease just
        expired is named as such, and its kind is the departures' (a loss),
        not the progress write's own."""
        from springback.v1 import job_service_pb2 as js

        job = client.create_job(make_spec(min_workers=1, max_workers=3))
        a, b, c = (join(workers, job.id, port) for port in (8011, 8012, 8013))
        wait_for(lambda: plan_of(coordinator, job.id).world_size == 3, 10, "a plan with three")
        leader = coordinator.coordinator
        # the reconcile loop stays out of it
        coordinator.reconciler.settle_s = coordinator.reconciler.max_settle_s = 600.0
        departures.note(leader, job.id, b, f"lost {b} (peers: connections reset by ranks 0)",
                        js.CHANGE_KIND_NODE_LOST)
        for gone in (b, c):  # b fenced on evidence, c's lease expired
            leader.store.revoke_lease(leader.leases.lease_of(job.id, gone))
        leader.change_with_retry(job.id, "progress",  # the writer that lands first
                                 kind=js.CHANGE_KIND_OTHER)
        _, events = client.list_job_events(job.id)
        newest = events[-1]
        assert list(newest.members) == [a], events
        assert newest.reason == (f"lost {b} (peers: connections reset by ranks 0); "
                                 f"lost {c} (liveness timeout); progress"), newest
        assert newest.kind == js.CHANGE_KIND_NODE_LOST, newest


class TestSettling:
    def test_a_join_that_fills_the_job_is_planned_without_waiting_for_the_burst_to_settle(
            self, start_coordinator, make_spec):
        server = start_coordinator(liveness_timeout_s=30.0)  # no heartbeats needed here
        wait_for(server.election.is_leader, 10, "the coordinator to lead")
        server.reconciler.settle_s = server.reconciler.max_settle_s = 600.0
        channel = grpc.insecure_channel(server.address)
        workers = ws_grpc.WorkerServiceStub(channel)
        try:
            with Client(server.address) as client:
                job = client.create_job(make_spec(min_workers=1, max_workers=2))
            a = join(workers, job.id, 5001)  # answered unplanned after JoinJob's 5 s wait
            plan = plan_of(server, job.id)
            assert plan is None or a not in {m.member_id for m in plan.members}, \
                "a join that leaves room for more waits for the burst to settle"
            b = join(workers, job.id, 5002)
            plan = plan_of(server, job.id)
            assert plan.action == pb.PLAN_ACTION_RUN
            assert [m.member_id for m in plan.members] == [a, b]
        finally:
            channel.close()


class TestFencing:
    def test_reports_from_an_older_generation_are_rejected(self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(max_workers=2))
        a = join(workers, job.id, 9001)
        old = plan_of(coordinator, job.id).generation
        workers.ReportStep(ws.ReportStepRequest(job_id=job.id, member_id=a, generation=old, step=3,
                                                samples_consumed=96, loss=2.5), timeout=5)
        assert client.get_job(job.id).status.step == 3
        join(workers, job.id, 9002)
        for call, request in (
            (workers.ReportStep, ws.ReportStepRequest(job_id=job.id, member_id=a, generation=old, step=9)),
            (workers.CommitCheckpoint, ws.CommitCheckpointRequest(
                job_id=job.id, member_id=a, generation=old,
                checkpoint=pb.CheckpointRef(step=3, uri="file:///tmp/x"))),
            (workers.ReportFailure, ws.ReportFailureRequest(job_id=job.id, member_id=a,
                                                            generation=old + 5)),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call(request, timeout=5)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"generation {request.generation}" in e.value.details()
        status = client.get_job(job.id).status
        assert status.step == 3 and not status.last_checkpoint.step
        assert status.generation == old + 1

    def test_step_reports_read_the_member_from_etcd_once_a_second_and_an_expired_one_is_refused(
            self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(min_workers=1, max_workers=1))
        a = join(workers, job.id, 9050)
        started(workers, coordinator, job.id, a)
        generation = plan_of(coordinator, job.id).generation
        store = coordinator.coordinator.store
        etcd_get, reads = store.get, []

        def get(key, *args, **kwargs):  # counts the coordinator's etcd reads of the member
            reads.append(key)
            return etcd_get(key, *args, **kwargs)

        def report(step: int) -> None:
            workers.ReportStep(ws.ReportStepRequest(job_id=job.id, member_id=a,
                                                    generation=generation, step=step), timeout=5)

        store.get = get
        try:
            t0 = time.monotonic()
            for step in range(1, 31):
                report(step)
            elapsed = time.monotonic() - t0
        finally:
            store.get = etcd_get
        member_reads = reads.count(keys.member(job.id, a))
        assert 1 <= member_reads <= 1 + int(elapsed / MEMBER_CHECK_S), (member_reads, elapsed)
        assert client.get_job(job.id).status.step == 30
        store.delete(keys.member(job.id, a))  # its lease expired

        def refused() -> bool:
            try:
                report(31)
            except grpc.RpcError as e:
                return e.code() == grpc.StatusCode.NOT_FOUND
            return False

        wait_for(refused, 5 * MEMBER_CHECK_S, "the expired member's report to be refused")

    def test_a_rank_failure_makes_a_new_generation_at_once(self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(max_workers=2))
        a, b = join(workers, job.id, 9101), join(workers, job.id, 9102)
        started(workers, coordinator, job.id, a)
        plan = plan_of(coordinator, job.id)
        response = workers.ReportFailure(ws.ReportFailureRequest(
            job_id=job.id, member_id=a, generation=plan.generation, reason="rank 0 exited 1"), timeout=5)
        after = plan_of(coordinator, job.id)
        assert response.generation == after.generation == plan.generation + 1
        assert [m.member_id for m in after.members] == [a, b]  # same ranks
        # a's ranks lost their state: b (rank 1) is the source.
        assert after.restore.kind == pb.RESTORE_KIND_PEERS and after.restore.source_rank == 1
        assert list(client.get_job(job.id).status.state_holders) == [b]
        # b's ranks crashed in the same generation; its agent reports after the
        # replan: accepted, b holds nothing either, no further generation
        workers.ReportFailure(ws.ReportFailureRequest(
            job_id=job.id, member_id=b, generation=plan.generation, reason="rank 0 exited 1"),
            timeout=5)
        status = client.get_job(job.id).status
        assert not status.state_holders and status.num_failures == 2
        assert plan_of(coordinator, job.id).generation == after.generation

    def test_a_generation_broken_on_live_ranks_is_made_again_with_every_holder(
            self, coordinator, client, workers, make_spec):
        # a reset link between live ranks: both report the broken generation
        # with their state kept; one new generation, same ranks, both still hold
        job, a, b, plan = _two_running(coordinator, client, workers, make_spec, 9121)
        holders = list(client.get_job(job.id).status.state_holders)
        assert sorted(holders) == sorted([a, b])
        for member in (a, b):
            _report_broken(workers, job.id, member, plan.generation)
        after = plan_of(coordinator, job.id)
        assert after.generation == plan.generation + 1
        assert [m.member_id for m in after.members] == [a, b]
        status = client.get_job(job.id).status
        assert sorted(status.state_holders) == sorted(holders)
        assert after.restore.kind == pb.RESTORE_KIND_PEERS and after.restore.source_rank == 0

    def test_two_racing_reports_of_one_broken_generation_make_one_new_generation(
            self, coordinator, client, workers, make_spec):
        job, a, b, plan = _two_running(coordinator, client, workers, make_spec, 9131)
        go = threading.Barrier(2)

        def report(member: str) -> None:
            go.wait(timeout=10)
            _report_broken(workers, job.id, member, plan.generation)

        threads = [threading.Thread(target=report, args=(m,)) for m in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert plan_of(coordinator, job.id).generation == plan.generation + 1
        assert client.get_job(job.id).status.num_failures == 2


def _two_running(coordinator, client, workers, make_spec, port: int):
    """A job with two members (ports `port`, `port` + 1) in a started generation."""
    job = client.create_job(make_spec(max_workers=2))
    a, b = join(workers, job.id, port), join(workers, job.id, port + 1)
    started(workers, coordinator, job.id, a)
    return job, a, b, plan_of(coordinator, job.id)


def _report_broken(workers, job_id: str, member: str, generation: int) -> None:
    workers.ReportFailure(ws.ReportFailureRequest(
        job_id=job_id, member_id=member, generation=generation,
        reason="connection reset", state_kept=True), timeout=10)


class TestStateHolders:
    def test_members_of_a_generation_that_never_started_hold_no_state(
            self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(max_workers=2))
        a, b = join(workers, job.id, 9151), join(workers, job.id, 9152)
        workers.ReportFailure(ws.ReportFailureRequest(
            job_id=job.id, member_id=a, generation=plan_of(coordinator, job.id).generation),
            timeout=5)
        # b was planned but no rank of it ever reported a started generation
        assert plan_of(coordinator, job.id).restore.kind == pb.RESTORE_KIND_NONE

    def test_a_generation_start_behind_the_progress_counts_the_steps_redone(
            self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(max_workers=1))
        a = join(workers, job.id, 9161)
        started(workers, coordinator, job.id, a)
        generation = plan_of(coordinator, job.id).generation
        workers.ReportStep(ws.ReportStepRequest(job_id=job.id, member_id=a,
                                                generation=generation, step=14), timeout=5)
        workers.ReportFailure(ws.ReportFailureRequest(
            job_id=job.id, member_id=a, generation=generation), timeout=5)
        generation = plan_of(coordinator, job.id).generation
        for _ in range(2):  # a retried report counts once
            workers.ReportStep(ws.ReportStepRequest(
                job_id=job.id, member_id=a, generation=generation, step=10,
                generation_start=True, restored_from=pb.RESTORE_KIND_CHECKPOINT), timeout=5)
        status = client.get_job(job.id).status
        assert (status.step, status.steps_redone, status.num_restores) == (10, 4, 1)
        assert list(status.state_holders) == [a] and status.holders_step == 10
        workers.ReportStep(ws.ReportStepRequest(job_id=job.id, member_id=a,
                                                generation=generation, step=11), timeout=5)
        assert client.get_job(job.id).status.step == 11


def _trained_then_started(workers, coordinator, job_id: str, member: str, *, step: int = 0,
                          restored_from: int = pb.RESTORE_KIND_NONE, state_lost: str = "",
                          reports: int = 2) -> int:
    """`member` trains to step 14, its generation breaks, and the next one
    starts at `step` from `restored_from` (by default: from nothing, no
    holder, no commit), reported `reports` times (a retried report counts
    once): returns that generation."""
    started(workers, coordinator, job_id, member)
    generation = plan_of(coordinator, job_id).generation
    workers.ReportStep(ws.ReportStepRequest(job_id=job_id, member_id=member,
                                            generation=generation, step=14), timeout=5)
    workers.ReportFailure(ws.ReportFailureRequest(
        job_id=job_id, member_id=member, generation=generation), timeout=5)
    generation = plan_of(coordinator, job_id).generation
    for _ in range(reports):
        workers.ReportStep(ws.ReportStepRequest(
            job_id=job_id, member_id=member, generation=generation, step=step,
            generation_start=True, restored_from=restored_from, state_lost=state_lost),
            timeout=5)
    return generation


class TestStateLoss:
    def test_a_start_from_nothing_behind_the_progress_is_counted_said_and_evented(
            self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(max_workers=1))
        a = join(workers, job.id, 9171)
        generation = _trained_then_started(workers, coordinator, job.id, a,
                                           state_lost="rank 1's rows have no live holder")
        status = client.get_job(job.id).status
        assert (status.num_state_losses, status.steps_lost, status.step) == (1, 14, 0)
        assert status.state == pb.JOB_STATE_RUNNING  # the default policy restarts
        assert "state lost: 14 trained steps" in status.message and \
            "no live holder" in status.message, status.message
        workers.ReportStep(ws.ReportStepRequest(job_id=job.id, member_id=a,
                                                generation=generation, step=1), timeout=5)
        _, events = client.list_job_events(job.id)
        event = next(e for e in events if e.generation == generation)
        assert (event.steps_lost, event.state_lost) == (14, "rank 1's rows have no live holder")
        for args, said in ((("job", "get"), "STATE LOST 1 times: 14 trained steps"),
                           (("job", "events"), "STATE LOST (14 steps): rank 1's rows")):
            out = subprocess.run([sys.executable, "-m", "springback.cli", "--coordinator",
                                  coordinator.address, *args, job.id], capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0 and said in out.stdout, (out.stdout, out.stderr)

    def test_with_on_state_lost_fail_the_job_ends_failed_naming_the_loss(
            self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(max_workers=1, failures={"on_state_lost": "fail"}))
        a = join(workers, job.id, 9181)
        _trained_then_started(workers, coordinator, job.id, a, reports=1)
        status = client.get_job(job.id).status
        assert status.state == pb.JOB_STATE_FAILED, status
        assert status.message.startswith("failed (failures.on_state_lost: fail): state lost: 14")
        assert "nothing was committed" in status.message, status.message

    def test_a_start_from_a_checkpoint_is_no_state_loss(
            self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(max_workers=1))
        a = join(workers, job.id, 9191)
        _trained_then_started(workers, coordinator, job.id, a, step=10,
                              restored_from=pb.RESTORE_KIND_CHECKPOINT)
        status = client.get_job(job.id).status
        assert (status.num_state_losses, status.steps_lost, status.steps_redone) == (0, 0, 4)

    def test_a_job_fatal_failure_ends_the_job_at_once_with_its_reason(
            self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(max_workers=2))
        a, b = join(workers, job.id, 9195), join(workers, job.id, 9196)
        started(workers, coordinator, job.id, a)
        workers.ReportFailure(ws.ReportFailureRequest(
            job_id=job.id, member_id=a, generation=plan_of(coordinator, job.id).generation,
            reason="'0.weight' cannot be resharded in memory", job_fatal=True), timeout=5)
        status = client.get_job(job.id).status
        assert status.state == pb.JOB_STATE_FAILED and status.num_failures == 1
        assert status.message == f"failed: {a}: '0.weight' cannot be resharded in memory"


class TestCommits:
    def test_commits_are_recorded_and_retention_retires_the_oldest(
        self, coordinator, client, workers, make_spec
    ):
        job = client.create_job(make_spec(max_workers=1, checkpoint={"uri": "file:///tmp/c", "keep_last": 2}))
        a = join(workers, job.id, 9201)
        generation = plan_of(coordinator, job.id).generation
        for step in (10, 20, 30):
            response = workers.CommitCheckpoint(ws.CommitCheckpointRequest(
                job_id=job.id, member_id=a, generation=generation,
                checkpoint=pb.CheckpointRef(step=step, uri=f"file:///tmp/c/{job.id}/step-{step}", world_size=1,
                                            cursor=pb.DataCursor(offset=step * 32))), timeout=5)
            assert [r.step for r in response.retained] == [s for s in (10, 20, 30) if step - 20 < s <= step]
        assert {r.uri for r in response.retained} == {f"file:///tmp/c/{job.id}/step-20",
                                                  f"file:///tmp/c/{job.id}/step-30"}
        assert [c.step for c in client.list_checkpoints(job.id)] == [30, 20]
        assert client.get_job(job.id).status.last_checkpoint.step == 30
        # When every holder is gone, the next generation restores the newest commit.
        workers.LeaveJob(ws.LeaveJobRequest(job_id=job.id, member_id=a), timeout=5)
        join(workers, job.id, 9202)
        plan = plan_of(coordinator, job.id)
        assert plan.restore.kind == pb.RESTORE_KIND_CHECKPOINT
        assert plan.restore.checkpoint.step == 30 and plan.step == 30 and plan.cursor.offset == 960
        # An operator can pick an older committed step.
        restored = client.restore_job(job.id, 20)
        plan = plan_of(coordinator, job.id)
        assert restored.status.generation == plan.generation
        assert plan.restore.checkpoint.step == 20 and plan.step == 20
        assert client.get_job(job.id).status.restore_step == 0  # consumed by that generation

    @staticmethod
    def _run_to_max_steps(coordinator, client, workers, make_spec, port: int):
        """A one-member job whose rank 0 reports its last step (5)."""
        job = client.create_job(make_spec(max_workers=1, max_steps=5))
        a = join(workers, job.id, port)
        generation = plan_of(coordinator, job.id).generation
        workers.ReportStep(ws.ReportStepRequest(job_id=job.id, member_id=a, generation=generation,
                                                step=5, samples_consumed=160), timeout=5)
        return job, a

    def test_reaching_max_steps_succeeds_the_job_and_stops_members(
        self, coordinator, client, workers, make_spec
    ):
        job, a = self._run_to_max_steps(coordinator, client, workers, make_spec, 9301)
        assert client.get_job(job.id).status.state == pb.JOB_STATE_SUCCEEDED
        stream = workers.WatchPlans(ws.WatchPlansRequest(job_id=job.id, member_id=a), timeout=10)
        plans = [r.plan for r in stream]
        assert plans[-1].action == pb.PLAN_ACTION_STOP

    def test_an_ended_job_keeps_why_it_ended_when_its_members_leave(
        self, coordinator, client, workers, make_spec
    ):
        job, a = self._run_to_max_steps(coordinator, client, workers, make_spec, 9311)
        assert client.get_job(job.id).status.message == "reached max_steps 5"
        workers.LeaveJob(ws.LeaveJobRequest(job_id=job.id, member_id=a, reason="ranks finished"),
                         timeout=5)
        status = client.get_job(job.id).status
        assert not status.members and status.state == pb.JOB_STATE_SUCCEEDED
        assert status.message == "reached max_steps 5"

    def test_a_persistent_storage_failure_shows_in_the_job_until_the_next_commit(
        self, coordinator, client, workers, make_spec
    ):
        job = client.create_job(make_spec(max_workers=1, checkpoint={"uri": "s3://b/p"}))
        a = join(workers, job.id, 9401)
        generation = plan_of(coordinator, job.id).generation
        workers.ReportCheckpointError(ws.ReportCheckpointErrorRequest(
            job_id=job.id, member_id=a, generation=generation,
            error="rank 0: StorageError: s3://b/p/step-10: 503 after 8 attempts"), timeout=5)
        status = client.get_job(job.id).status
        assert "503 after 8 attempts" in status.checkpoint_error
        assert status.state == pb.JOB_STATE_RUNNING  # training goes on
        with pytest.raises(grpc.RpcError) as e:  # a stale report changes nothing
            workers.ReportCheckpointError(ws.ReportCheckpointErrorRequest(
                job_id=job.id, member_id=a, generation=generation - 1, error="old"), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        workers.CommitCheckpoint(ws.CommitCheckpointRequest(
            job_id=job.id, member_id=a, generation=generation,
            checkpoint=pb.CheckpointRef(step=20, uri=f"s3://b/p/{job.id}/step-20")), timeout=5)
        assert client.get_job(job.id).status.checkpoint_error == ""


class TestCrashLoopCounting:
    """What counts toward ``failures.max_per_step`` (service/policy/failures.py)."""

    def test_live_ranks_breaks_of_generations_that_never_started_count_apart(
            self, coordinator, client, workers, make_spec):
        """After a started generation broke, the generations made for it that
        never started (a rendezvous a dead peer never joined) do not add to
        the crash-loop streak: two such breaks leave a max_per_step of 2
        job running. Six in a row (`UNSTARTED_FACTOR` x 2) end it FAILED,
        naming why, so a rendezvous that never completes is no endless loop."""
        job = client.create_job(make_spec(max_workers=2, failures={"max_per_step": 2}))
        a, b = join(workers, job.id, 9171), join(workers, job.id, 9172)
        started(workers, coordinator, job.id, a)
        workers.ReportFailure(ws.ReportFailureRequest(
            job_id=job.id, member_id=b, generation=plan_of(coordinator, job.id).generation,
            reason="rank 0 exited 1"), timeout=5)
        for n in range(1, 2 * UNSTARTED_FACTOR + 1):
            keep_alive(workers, job.id, a, b)
            _report_broken(workers, job.id, a, plan_of(coordinator, job.id).generation)
            status = client.get_job(job.id).status
            if n < 2 * UNSTARTED_FACTOR:
                assert status.state == pb.JOB_STATE_RUNNING, (n, status.message)
        assert status.state == pb.JOB_STATE_FAILED
        assert "6 generations in a row could not start" in status.message, status.message

    def test_live_ranks_breaks_of_started_generations_still_make_a_crash_loop(
            self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(max_workers=2, failures={"max_per_step": 2}))
        a, b = join(workers, job.id, 9181), join(workers, job.id, 9182)
        for _ in range(2):
            started(workers, coordinator, job.id, a)
            _report_broken(workers, job.id, a, plan_of(coordinator, job.id).generation)
        status = client.get_job(job.id).status
        assert status.state == pb.JOB_STATE_FAILED
        assert "2 generations broke by rank failures" in status.message, status.message
