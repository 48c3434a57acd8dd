"""Chaos soak (marked `soak`, not in the default run): minutes of random faults
of every class, against a whole local deployment (`chaos.Deployment`: a
3-member etcd cluster, two `springback coordinator` replicas, S3 on moto,
three node agents, a fault-injecting link in front of each of them).

Faults (`chaos.FAULTS`: worker, rank <-> rank and agent <-> coordinator
network, coordinator, etcd, storage and clock faults, among them a storage
brown-out during a restore of every node and every rank crashing at once),
drawn by a seeded generator (SPRINGBACK_SOAK_SEED, default 7) every 8-15 s
until SPRINGBACK_SOAK_S (default 600) is spent; SPRINGBACK_SOAK_FAULTS
(comma-separated names, default all) draws only those (a short soak of the
faults under work). After each fault the job must
train again within a deadline; each fault's longest stall of training and
the steps it made the job redo are printed, and a table per class at the end.

Both forms: ``ddp`` (tiny_train.py on three one-rank nodes) and ``fsdp``
(fsdp_train.py, the sharded form, on three two-rank nodes: HSDP with the
shard inside each node, so a lost node is a lost replica and two lost in a
row still leave one; peer copies on).

At the end the job has SUCCEEDED, every sample was applied exactly once (the
sampler's records and the model's own per-sample counters), the replicas are
identical (DDP) or every generation start's gathered state equals the state
an earlier generation recorded at that step (FSDP, SHA-256), and every
recorded checkpoint verifies.
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time

import pytest

from pathlib import Path

from applied import check_applied
from chaos import FAULTS, Deployment, Faults
from cluster import steps
from fakeplans import assert_replicas_identical
from sbtest import wait_for
from pieces import assembled_digests
from test_sharded import digests, earlier_digests
from springback.client.api import Client
from springback.storage import verify
from springback.v1 import types_pb2 as pb
from springback.worker.train.audit import check_exactly_once

SOAK_S = float(os.environ.get("SPRINGBACK_SOAK_S", "600"))
SEED = int(os.environ.get("SPRINGBACK_SOAK_SEED", "7"))
DRAWN = tuple(f for f in os.environ.get("SPRINGBACK_SOAK_FAULTS", "").split(",") if f) or FAULTS
"""The faults drawn (SPRINGBACK_SOAK_FAULTS, default every one of `chaos.FAULTS`)."""
NUM_SAMPLES, BATCH = 256, 12
FSDP_TRAIN = str(Path(__file__).with_name("fsdp_train.py"))
FORMS = {"ddp": {}, "fsdp": {"script": FSDP_TRAIN, "nproc": 2}}
STEP_S = {"ddp": 0.15, "fsdp": 0.4}
"""Below a step's time here (TINY_STEP_SLEEP_S=0.1): the faults last SOAK_S."""


class StepWatch:
    """Samples the job's newest step every 0.2 s in a thread (from the step
    records rank 0 appends), remembering when each advance was first seen
    on this process's monotonic clock, so a fault's stall can be measured
    afterwards whatever the fault's own duration."""

    def __init__(self, root) -> None:
        self._root = root
        self.advances: list[tuple[float, int]] = [(time.monotonic(), 0)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def step(self) -> int:
        return self.advances[-1][1]

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            step = max((r["step"] for r in steps(self._root)), default=0)
            if step > self.advances[-1][1]:
                self.advances.append((time.monotonic(), step))

    def longest_stall(self, start: float, end: float) -> float:
        """The longest time without an advance that overlaps [start, end]."""
        times = [t for t, _ in self.advances]
        before = [t for t in times if t <= start]
        inside = [t for t in times if start < t <= end]
        edges = ([before[-1]] if before else []) + inside + [end]
        return max((b - a for a, b in zip(edges, edges[1:])), default=0.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.mark.soak
@pytest.mark.timeout(int(SOAK_S * 3) + 300)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_random_faults_of_every_class_lose_and_double_nothing(form, tmp_path, monkeypatch):
    unknown = set(DRAWN) - set(FAULTS)
    assert not unknown, f"SPRINGBACK_SOAK_FAULTS names no fault of chaos.FAULTS: {sorted(unknown)}"
    rng = random.Random(SEED)
    max_steps = int(SOAK_S / STEP_S[form])
    with Deployment(tmp_path, **FORMS[form]) as deployment:
        for name, value in deployment.s3_env.items():  # verify() below reads the store too
            monkeypatch.setenv(name, value)
        spec = {"name": "chaos", "min_workers": 2, "max_workers": 3,
                "data": {"num_samples": NUM_SAMPLES, "global_batch_size": BATCH, "seed": 3},
                "checkpoint": {"uri": f"{deployment.bucket()}/ckpt", "every_steps": 25},
                "max_steps": max_steps}
        with Client(deployment.coordinator) as client:
            job = wait_for(lambda: client.create_job(spec), 60, "a leader to take the job")
            faults = Faults(deployment, job.id, rng)

            watch = StepWatch(tmp_path)
            for _ in range(3):
                deployment.start_node(job.id)
            wait_for(lambda: watch.step() >= 5, 120, "training to start")
            try:
                trace = _inject_until(faults, watch, client, job.id,
                                      time.monotonic() + SOAK_S, max_steps, rng)
            finally:
                watch.close()
            done = wait_for(lambda: (j := client.get_job(job.id)).status.state
                            == pb.JOB_STATE_SUCCEEDED and j, SOAK_S + 180, "the job to succeed")
            wait_for(lambda: not deployment.live_nodes(), 90, "every agent to end")
            checkpoints = client.list_checkpoints(job.id)
        _print_table(trace, done)
        assert done.status.step == max_steps
        assert len(trace) >= 3, trace
        if SOAK_S >= 600:  # a full soak draws every class (some may not apply when drawn)
            assert len({f for f, *_ in trace}) >= len(DRAWN) - 3, trace
        audit = str(tmp_path / "audit")
        applied = check_applied(audit, num_samples=NUM_SAMPLES, global_batch_size=BATCH,
                                seed=3, last_step=max_steps)
        assert applied.ok, applied
        report = check_exactly_once(audit, num_samples=NUM_SAMPLES, global_batch_size=BATCH,
                                    last_step=max_steps)
        assert report.ok, report
        if form == "ddp":
            assert assert_replicas_identical(audit) >= 2
        else:
            assert assert_every_start_bit_identical(tmp_path) >= 3
        assert checkpoints and checkpoints[0].step == max_steps
        for ref in checkpoints:
            assert verify(ref.uri) == [], f"committed checkpoint {ref.uri} does not verify"


def assert_every_start_bit_identical(root: Path) -> int:
    """Every generation start from a trained step holds, bit for bit, the
    state an earlier generation held at that step; returns how many starts
    were compared. A start at a step whose whole state no earlier generation
    has on record (a node killed before it wrote its pieces of that step) has
    nothing to compare with: the applied-counter audit covers it."""
    records, assembled = digests(root), assembled_digests(root)
    starts = [r for r in records if r["when"] == "start" and r["step"] > 0]
    compared = 0
    for start in starts:
        earlier = earlier_digests(records, assembled, start)
        if earlier:
            assert earlier == {start["digest"]}, (start, earlier)
            compared += 1
    return compared


Fault = tuple[str, str, float, int]
"""(fault, what it did, longest stall of training in seconds, steps redone)."""


def _inject_until(faults: Faults, watch: StepWatch, client: Client, job_id: str,
                  deadline: float, max_steps: int, rng: random.Random) -> list[Fault]:
    """Draws and injects faults (every class once per round, in random order)
    until `deadline` or 85 % of the steps; after each, waits for 3 more
    steps than before it. A fault's stall is the longest time without a new
    step from its start to that point (0.2 s resolution); steps redone is
    the job's `steps_redone` counter's change across it."""
    trace: list[Fault] = []
    order: list[str] = []
    while time.monotonic() < deadline and watch.step() < 0.85 * max_steps:
        time.sleep(rng.uniform(8, 15))  # the fault schedule itself, not a sync
        if not order:
            order = rng.sample(DRAWN, len(DRAWN))
        fault = order.pop()
        at, t0 = watch.step(), time.monotonic()
        redone = wait_for(lambda: client.get_job(job_id), 60,
                          "the job record").status.steps_redone
        what = faults.inject(fault)
        if what is None:
            continue
        wait_for(lambda: watch.step() >= at + 3, 180, f"training again after {fault}")
        stall = watch.longest_stall(t0, time.monotonic())
        redone = wait_for(lambda: client.get_job(job_id), 60,
                          "the job record").status.steps_redone - redone
        trace.append((fault, what, stall, redone))
        print(f"soak: {fault} ({what}) at step {at}: longest stall {stall:.1f} s, "
              f"{redone} steps redone", flush=True)
    return trace


def _print_table(trace: list[Fault], done: pb.Job) -> None:
    print("\nsoak: fault | count | median stall s | max stall s | steps redone", flush=True)
    for fault in FAULTS:
        rows = [(stall, redone) for f, _, stall, redone in trace if f == fault]
        if rows:
            stalls = [r[0] for r in rows]
            print(f"soak: {fault} | {len(rows)} | {statistics.median(stalls):.1f} | "
                  f"{max(stalls):.1f} | {sum(r[1] for r in rows)}", flush=True)
    print(f"soak: {len(trace)} faults; status: {done.status.num_failures} failures, "
          f"{done.status.num_restores} restores, {done.status.steps_redone} steps redone, "
          f"{done.status.generation} generations", flush=True)
