"""Chaos soak (marked `soak`, not in the default run): minutes of random faults
of every class a node or replica can suffer, against real etcd, two
`springback coordinator` replicas and three node agents.

Faults, drawn by a seeded generator (SPRINGBACK_SOAK_SEED, default 7) every
8-15 s until SPRINGBACK_SOAK_S (default 600) is spent: a node SIGKILLed (and
replaced), a rank SIGKILLed (its agent restarts it), a node SIGSTOPped past
the liveness timeout (fenced, rejoins), a node drained by SIGTERM (and
replaced), a coordinator replica SIGKILLed and restarted on its address,
every rank of a node crashing at once. After each fault the job must train
again within a deadline; the recovery time of each is printed.

At the end the job has SUCCEEDED, every sample was applied exactly once (the
sampler's records and the model's own per-sample counters), the replicas are
identical and every recorded checkpoint verifies.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from applied import check_applied
from cluster import AgentProcess, children, steps
from fakeplans import assert_replicas_identical
from sbtest import wait_for
from springback.client.api import Client
from springback.cli.local import free_port
from springback.storage import verify
from springback.v1 import types_pb2 as pb
from springback.worker.audit import check_exactly_once

SOAK_S = float(os.environ.get("SPRINGBACK_SOAK_S", "600"))
SEED = int(os.environ.get("SPRINGBACK_SOAK_SEED", "7"))
NUM_SAMPLES, BATCH = 256, 12
STEP_S = 0.25  # a step with TINY_STEP_SLEEP_S=0.1 on the 2-core machine, roughly
FAULTS = ("kill-node", "kill-rank", "stop-node", "drain-node", "kill-replica")


@pytest.mark.soak
@pytest.mark.timeout(int(SOAK_S * 3) + 300)
def test_random_faults_of_every_class_lose_and_double_nothing(spawn_coordinator, tmp_path):
    rng = random.Random(SEED)
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    options = ("--liveness-timeout-s", "3")
    replicas = {a: spawn_coordinator("--listen", a, *options) for a in addresses}
    max_steps = int(SOAK_S / STEP_S)
    spec = {"name": "chaos", "min_workers": 2, "max_workers": 3,
            "data": {"num_samples": NUM_SAMPLES, "global_batch_size": BATCH, "seed": 3},
            "checkpoint": {"uri": f"file://{tmp_path}/ckpt", "every_steps": 25},
            "max_steps": max_steps}
    with Client(",".join(addresses)) as client:
        job = wait_for(lambda: client.create_job(spec), 30, "a leader to take the job")
        agents: dict[str, AgentProcess] = {}
        counter = iter(range(1000))

        def start_node() -> None:
            name = f"n{next(counter)}"
            agents[name] = AgentProcess(tmp_path, name, job.id, ",".join(addresses))

        def progress() -> int:
            return max((r["step"] for r in steps(tmp_path)), default=0)

        for _ in range(3):
            start_node()
        wait_for(lambda: progress() >= 5, 120, "training to start")
        trace: list[tuple[str, float]] = []
        try:
            deadline = time.monotonic() + SOAK_S
            while time.monotonic() < deadline and progress() < 0.85 * max_steps:
                time.sleep(rng.uniform(8, 15))  # the fault schedule itself, not a sync
                fault = rng.choice(FAULTS)
                live = sorted(n for n, a in agents.items() if a.process.poll() is None)
                at, t0 = progress(), time.monotonic()
                if fault == "kill-node" and len(live) == 3:
                    agents.pop(rng.choice(live)).signal_node(signal.SIGKILL)
                    start_node()
                elif fault == "kill-rank":
                    ranks = children(agents[rng.choice(live)].pid)
                    if ranks:
                        os.kill(rng.choice(ranks), signal.SIGKILL)
                elif fault == "stop-node" and len(live) == 3:
                    victim = agents[rng.choice(live)]
                    victim.signal_node(signal.SIGSTOP)
                    wait_for(lambda: progress() >= at + 3, 90, "training without the stopped node")
                    victim.signal_node(signal.SIGCONT)
                elif fault == "drain-node" and len(live) == 3:
                    agents[rng.choice(live)].process.send_signal(signal.SIGTERM)
                    start_node()
                elif fault == "kill-replica":
                    address = rng.choice(addresses)
                    replicas[address].kill()
                    replicas[address] = spawn_coordinator("--listen", address, *options)
                else:
                    continue
                wait_for(lambda: progress() >= at + 3, 120, f"training again after {fault}")
                trace.append((fault, time.monotonic() - t0))
                print(f"soak: {fault} at step {at}: training again after "
                      f"{trace[-1][1]:.1f} s", flush=True)
            done = wait_for(lambda: (j := client.get_job(job.id)).status.state
                            == pb.JOB_STATE_SUCCEEDED and j, SOAK_S + 120, "the job to succeed")
            wait_for(lambda: all(a.process.poll() is not None for a in agents.values()), 90,
                     "every agent to end")
            checkpoints = client.list_checkpoints(job.id)
        finally:
            for agent in agents.values():
                agent.stop()
    print("soak: faults", {f: sum(1 for g, _ in trace if g == f) for f in FAULTS},
          "status", done.status.num_failures, "failures,", done.status.num_restores,
          "restores,", done.status.steps_redone, "steps redone,", done.status.generation,
          "generations", flush=True)
    assert done.status.step == max_steps
    assert len(trace) >= 3, trace
    audit = str(tmp_path / "audit")
    applied = check_applied(audit, num_samples=NUM_SAMPLES, global_batch_size=BATCH, seed=3,
                            last_step=max_steps)
    assert applied.ok, applied
    report = check_exactly_once(audit, num_samples=NUM_SAMPLES, global_batch_size=BATCH,
                                last_step=max_steps)
    assert report.ok, report
    assert assert_replicas_identical(audit) >= 2
    assert checkpoints and checkpoints[0].step == max_steps
    for ref in checkpoints:
        assert verify(ref.uri) == [], f"committed checkpoint {ref.uri} does not verify"
