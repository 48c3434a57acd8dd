"""The straggler policy (spec ``controls.straggler``, service/policy/stragglers.py)
end to end: real etcd, a real coordinator, four real agents whose gloo ranks
train tiny_train.py. One agent's rank becomes ~2x slower mid-run (a sleep in
its compute from step SLOW_FROM, TINY_COMPUTE_SLEEP_FROM_STEP): it is set
aside within the window, the job's step rate comes back, and the job
succeeds with every sample applied exactly once. A healthy run with the
policy on sets nobody aside."""

from __future__ import annotations

import re
import time

import pytest
from applied import check_applied
from cluster import AgentProcess, steps
from sbtest import wait_for
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb
from springback.worker.train.audit import check_exactly_once

NUM_SAMPLES, BATCH, MAX_STEPS = 2400, 12, 200
SLOW_FROM, SLOW_S, WINDOW = 40, 0.1, 10
PACE = {"TINY_STEP_SLEEP_S": "0.05"}  # a step of about 0.1 s here: 0.1 s more is ~2x
ENDED = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)


def _spec(name: str) -> dict:
    return {"name": name, "min_workers": 2, "max_workers": 4,
            "data": {"num_samples": NUM_SAMPLES, "global_batch_size": BATCH, "seed": 1},
            "max_steps": MAX_STEPS,
            # change_cost_s: the cost model's change cost fixed (this job has no
            # measured change before the slowdown: the default 30 s would need
            # 300 steps left at 0.1 s saved per step)
            "controls": {"straggler": {"enabled": True, "window_steps": WINDOW,
                                       "change_cost_s": 5}}}


def _member_id(agent: AgentProcess) -> str | None:
    found = re.search(r"joined job \S+ as member (\S+) ", agent.log())
    return found[1] if found else None


def _rate(points: list[tuple[float, int]], first: int, last: int) -> float:
    """Steps per second between steps `first` and `last` (or the nearest
    after them) of `points`, (time, step) in the order they were taken."""
    a = next(p for p in points if p[1] >= first)
    b = next(p for p in points if p[1] >= last)
    return (b[1] - a[1]) / (b[0] - a[0])


def _run(tmp_path, coordinator, client, name: str, slow: bool):
    job_id = client.create_job(_spec(name)).id
    env = {"TINY_COMPUTE_SLEEP_S": str(SLOW_S), "TINY_COMPUTE_SLEEP_FROM_STEP": str(SLOW_FROM)}
    agents = [AgentProcess(tmp_path, f"n{i}", job_id, coordinator.address,
                           env={**PACE, **(env if slow and i == 3 else {})}) for i in range(4)]
    try:
        ids = [wait_for(lambda a=a: _member_id(a), 60, f"{a.name}'s member id") for a in agents]
        job = wait_for(lambda: (j := client.get_job(job_id)).status.state in ENDED and j,
                       240, "the job to end")
        assert job.status.state == pb.JOB_STATE_SUCCEEDED, job.status.message
        wait_for(lambda: all(a.process.poll() is not None for a in agents), 60,
                 "every agent to end")
        applied = check_applied(tmp_path / "audit", num_samples=NUM_SAMPLES,
                                global_batch_size=BATCH, seed=1, last_step=MAX_STEPS)
        assert applied.ok, applied
        report = check_exactly_once(str(tmp_path / "audit"), num_samples=NUM_SAMPLES,
                                    global_batch_size=BATCH, last_step=MAX_STEPS)
        assert report.ok, report
        _, events = client.list_job_events(job_id)
        return job, events, ids, coordinator.coordinator.series(job_id)
    finally:
        for agent in agents:
            agent.stop()


@pytest.mark.timeout(300)
def test_a_node_made_2x_slower_mid_run_is_set_aside_and_the_step_rate_comes_back(
        tmp_path, coordinator, client):
    started = time.monotonic()
    job, events, ids, series = _run(tmp_path, coordinator, client, "straggler", slow=True)
    slow_id = ids[3]
    controls = [e for e in events if e.kind == js.CHANGE_KIND_CONTROL]
    assert len(controls) == 1, [(e.kind, e.reason) for e in events]
    evicted = controls[0]
    assert slow_id not in evicted.members and evicted.world_size == 3, evicted
    assert f"set aside {slow_id}" in evicted.reason and "saves" in evicted.reason, evicted.reason
    assert slow_id in evicted.spares  # set aside as a spare
    assert [e.member_id for e in job.status.set_aside if not e.returned] == [slow_id]
    # within the window after its timing showed it (a median over the last 50
    # steps moves once half of them, 25, are slow), plus a report's lag
    eviction_step = next(e.start_step for e in events if e.generation == evicted.generation)
    assert SLOW_FROM < eviction_step <= SLOW_FROM + 25 + WINDOW + 15, eviction_step
    # the step rate on rank 0's clock (its metrics): the leader's series
    # adds the report path's lag (a report every 0.25 s at most, etcd reads),
    # printed beside it
    clock = [(r["t"], r["step"]) for r in steps(tmp_path)]
    rates = {name: [_rate(points, 10, SLOW_FROM - 2),
                    _rate(points, SLOW_FROM + 2, eviction_step - 2),
                    _rate(points, eviction_step + 10, MAX_STEPS)]
             for name, points in (("rank 0", clock), ("leader", [p[:2] for p in series]))}
    before, slowed, after = rates["rank 0"]
    print(f"\nstraggler set aside at step {eviction_step}: {before:.2f} steps/s before the "
          f"slowdown, {slowed:.2f} while slowed, {after:.2f} after "
          f"({after / before:.0%} of before; the leader's series: "
          f"{', '.join(f'{r:.2f}' for r in rates['leader'])}); "
          f"{time.monotonic() - started:.0f} s; {evicted.reason}")
    assert slowed < 0.8 * before, (before, slowed)  # the injection is real
    # back near the fast nodes' rate: 4 agents' ranks on 2 shared cores, so
    # within 20 % (the 10 % needs a quiet machine; printed above)
    assert after >= 0.8 * before, (rates, [
        (e.generation, js.ChangeKind.Name(e.kind), e.start_step, e.reason) for e in events])


@pytest.mark.timeout(300)
def test_a_healthy_run_with_the_policy_on_sets_nobody_aside(tmp_path, coordinator, client):
    job, events, ids, _ = _run(tmp_path, coordinator, client, "healthy", slow=False)
    assert [e for e in events if e.kind == js.CHANGE_KIND_CONTROL] == []
    assert not job.status.set_aside, job.status
    runs = [e for e in events if e.action == pb.PLAN_ACTION_RUN]
    assert runs and runs[-1].world_size == 4, [(e.world_size, e.reason) for e in events]
