"""Chaos soak (marked `soak`, not in the default run): minutes of random faults
of every class, against a whole local deployment (`chaos.Deployment`: a
3-member etcd cluster, two `springback coordinator` replicas, S3 on moto,
three node agents, a fault-injecting link in front of each of them).

Faults (`chaos.FAULTS`: worker, rank <-> rank and agent <-> coordinator
network, coordinator, etcd, storage and clock faults), drawn by a seeded
generator (SPRINGBACK_SOAK_SEED, default 7) every 8-15 s until
SPRINGBACK_SOAK_S (default 600) is spent. After each fault the job must
train again within a deadline; the recovery time of each is printed, and a
table of counts and recovery times at the end.

At the end the job has SUCCEEDED, every sample was applied exactly once (the
sampler's records and the model's own per-sample counters), the replicas are
identical and every recorded checkpoint verifies.
"""

from __future__ import annotations

import os
import random
import statistics
import time

import pytest

from applied import check_applied
from chaos import FAULTS, Deployment, Faults
from cluster import steps
from fakeplans import assert_replicas_identical
from sbtest import wait_for
from springback.service.client import Client
from springback.storage import verify
from springback.v1 import types_pb2 as pb
from springback.worker.audit import check_exactly_once

SOAK_S = float(os.environ.get("SPRINGBACK_SOAK_S", "600"))
SEED = int(os.environ.get("SPRINGBACK_SOAK_SEED", "7"))
NUM_SAMPLES, BATCH = 256, 12
STEP_S = 0.25  # a step with TINY_STEP_SLEEP_S=0.1 on the 2-core machine, roughly


@pytest.mark.soak
@pytest.mark.timeout(int(SOAK_S * 3) + 300)
def test_random_faults_of_every_class_lose_and_double_nothing(tmp_path, monkeypatch):
    rng = random.Random(SEED)
    max_steps = int(SOAK_S / STEP_S)
    with Deployment(tmp_path) as deployment:
        for name, value in deployment.s3_env.items():  # verify() below reads the store too
            monkeypatch.setenv(name, value)
        spec = {"name": "chaos", "min_workers": 2, "max_workers": 3,
                "data": {"num_samples": NUM_SAMPLES, "global_batch_size": BATCH, "seed": 3},
                "checkpoint": {"uri": f"{deployment.bucket()}/ckpt", "every_steps": 25},
                "max_steps": max_steps}
        with Client(deployment.coordinator) as client:
            job = wait_for(lambda: client.create_job(spec), 60, "a leader to take the job")
            faults = Faults(deployment, job.id, rng)

            def progress() -> int:
                return max((r["step"] for r in steps(tmp_path)), default=0)

            for _ in range(3):
                deployment.start_node(job.id)
            wait_for(lambda: progress() >= 5, 120, "training to start")
            trace = _inject_until(faults, progress, time.monotonic() + SOAK_S, max_steps, rng)
            done = wait_for(lambda: (j := client.get_job(job.id)).status.state
                            == pb.JOB_STATE_SUCCEEDED and j, SOAK_S + 180, "the job to succeed")
            wait_for(lambda: not deployment.live_nodes(), 90, "every agent to end")
            checkpoints = client.list_checkpoints(job.id)
        _print_table(trace, done)
        assert done.status.step == max_steps
        assert len(trace) >= 3, trace
        if SOAK_S >= 600:  # a full soak draws every class (some may not apply when drawn)
            assert len({f for f, _, _ in trace}) >= len(FAULTS) - 3, trace
        audit = str(tmp_path / "audit")
        applied = check_applied(audit, num_samples=NUM_SAMPLES, global_batch_size=BATCH,
                                seed=3, last_step=max_steps)
        assert applied.ok, applied
        report = check_exactly_once(audit, num_samples=NUM_SAMPLES, global_batch_size=BATCH,
                                    last_step=max_steps)
        assert report.ok, report
        assert assert_replicas_identical(audit) >= 2
        assert checkpoints and checkpoints[0].step == max_steps
        for ref in checkpoints:
            assert verify(ref.uri) == [], f"committed checkpoint {ref.uri} does not verify"


def _inject_until(faults: Faults, progress, deadline: float, max_steps: int,
                  rng: random.Random) -> list[tuple[str, str, float]]:
    """Draws and injects faults (each class once per round) until `deadline` or 85 % of the steps; after
    each, waits for 3 more steps than before it. Returns (fault, what, seconds
    from the fault's end to training again: 0 when it never stopped)."""
    trace: list[tuple[str, str, float]] = []
    order: list[str] = []
    while time.monotonic() < deadline and progress() < 0.85 * max_steps:
        time.sleep(rng.uniform(8, 15))  # the fault schedule itself, not a sync
        if not order:  # every class once per round, in a random order
            order = rng.sample(FAULTS, len(FAULTS))
        fault = order.pop()
        at = progress()
        what = faults.inject(fault)
        if what is None:
            continue
        t0 = time.monotonic()  # the fault is over (restarted, healed): recovery from here
        wait_for(lambda: progress() >= at + 3, 180, f"training again after {fault}")
        trace.append((fault, what, time.monotonic() - t0))
        print(f"soak: {fault} ({what}) at step {at}: training again after "
              f"{trace[-1][2]:.1f} s", flush=True)
    return trace


def _print_table(trace: list[tuple[str, str, float]], done: pb.Job) -> None:
    print("\nsoak: fault | count | median s to train again | max s", flush=True)
    for fault in FAULTS:
        times = [t for f, _, t in trace if f == fault]
        if times:
            print(f"soak: {fault} | {len(times)} | {statistics.median(times):.1f} | "
                  f"{max(times):.1f}", flush=True)
    print(f"soak: {len(trace)} faults; status: {done.status.num_failures} failures, "
          f"{done.status.num_restores} restores, {done.status.steps_redone} steps redone, "
          f"{done.status.generation} generations", flush=True)
