"""Test helper: one trainer script under `springback run` (restart mode) on a
real coordinator, through a SIGKILLed node and a join, and the checks of what
the run's audit file shows (see hf_train.py).

Scenario: agents a and b (1 rank each, world 2) train; once a checkpoint is
committed node b (agent and rank) is SIGKILLed; a resumes alone (world 1)
from the commit and redoes the steps since; then agent c joins, a's rank is
stopped by SIGTERM and writes a drain checkpoint, and the world of 2 resumes
from it and trains to max_steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from sbtest import node_processes, wait_for
from springback.v1 import types_pb2 as pb

STEPS, EVERY, NUM_SAMPLES, GLOBAL_BATCH = 60, 10, 64, 8


@dataclass
class Run:
    job: pb.Job
    audit: list[dict]
    logs: str


def run_through_kill_and_join(tmp_path: Path, client, coordinator: str, script: str,
                              step_sleep_s: float = 0.15) -> Run:
    job = client.create_job({
        "name": "trainer", "min_workers": 1, "max_workers": 2,
        "data": {"num_samples": NUM_SAMPLES, "global_batch_size": GLOBAL_BATCH},
        "checkpoint": {"uri": f"file://{tmp_path}/ckpt", "every_steps": EVERY},
        "max_steps": STEPS})
    audit_path = tmp_path / "audit.jsonl"
    env = dict(os.environ, TRAIN_AUDIT=str(audit_path), MAX_STEPS=str(STEPS),
               CKPT_EVERY=str(EVERY), GLOBAL_BATCH=str(GLOBAL_BATCH),
               STEP_SLEEP_S=str(step_sleep_s), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               TMPDIR=str(tmp_path))
    agents: dict[str, subprocess.Popen] = {}

    def start(name: str) -> None:
        agents[name] = subprocess.Popen(
            [sys.executable, "-m", "springback.cli", "run", "--job", job.id,
             "--coordinator", coordinator, "--mode", "restart", "--nproc-per-node", "1",
             "--drain-timeout-s", "30", "--", sys.executable, script],
            env=env, stdout=open(tmp_path / f"agent-{name}.log", "wb"), stderr=subprocess.STDOUT)

    def logs() -> str:
        return "".join(f"--- {p.name}\n" + p.read_text(errors="replace")
                       for p in sorted(tmp_path.glob("agent-*.log")))

    def losses_in(gen_min: int) -> int:
        return sum(1 for r in read_audit(audit_path) if "loss" in r and r["gen"] >= gen_min)

    try:
        start("a")
        start("b")
        s = wait_for(lambda: (s := client.get_job(job.id).status).world_size == 2
                     and s.last_checkpoint.step >= EVERY and s.step >= EVERY + 3 and s, 150,
                     f"world 2 with a commit\n{logs()}")
        killed_in = s.generation
        victim = agents["b"]
        for pid in node_processes(victim.pid):
            os.kill(pid, signal.SIGKILL)
        victim.wait()
        wait_for(lambda: losses_in(killed_in + 1) >= 5, 150,
                 f"training resumed at world 1\n{logs()}")
        start("c")
        done = wait_for(lambda: (j := client.get_job(job.id)).status.state
                        == pb.JOB_STATE_SUCCEEDED and j, 180, f"the job to succeed\n{logs()}")
        for name in ("a", "c"):
            assert agents[name].wait(60) == 0, logs()
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    return Run(job=done, audit=read_audit(audit_path), logs=logs())


def read_audit(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check(run: Run, *, loss_tolerance: float = 1e-3, drain_jump: float = 0.3) -> None:
    """Everything the scenario promises; see the module docstring. `drain_jump`:
    how far the first loss after a drain checkpoint may be from the last one
    before it (a different batch: the script's batch-to-batch noise)."""
    job, audit = run.job, run.audit
    assert job.status.step == STEPS and job.status.last_checkpoint.step == STEPS, job.status
    losses: dict[int, dict[int, float]] = defaultdict(dict)       # gen -> step -> loss
    samples: dict[tuple[int, int], list[int]] = defaultdict(list)  # (gen, step) -> sample ids
    for r in audit:
        if "loss" in r:
            losses[r["gen"]][r["step"]] = r["loss"]
        else:
            samples[(r["gen"], r["step"])] += r["idx"]
    gens = sorted(losses)
    assert len(gens) >= 3, (gens, run.logs)  # the first world, the survivor, the joined world

    # every step 1..STEPS was trained, and the lineage (each step's last run)
    # takes every sample of an epoch exactly once
    lineage = {s: max(g for g in gens if s in losses[g]) for s in range(1, STEPS + 1)
               if any(s in losses[g] for g in gens)}
    assert sorted(lineage) == list(range(1, STEPS + 1)), lineage
    per_epoch = NUM_SAMPLES // GLOBAL_BATCH
    for epoch_start in range(1, STEPS + 1, per_epoch):
        taken = [i for s in range(epoch_start, min(epoch_start + per_epoch, STEPS + 1))
                 for i in samples[(lineage[s], s)]]
        assert len(taken) == len(set(taken)), f"a sample repeated in the epoch of step {epoch_start}"
        if epoch_start + per_epoch - 1 <= STEPS:
            assert sorted(taken) == list(range(NUM_SAMPLES)), f"epoch of step {epoch_start}"

    # each later generation resumed where a commit was, never past what the
    # previous one trained; a step trained twice took the same samples and,
    # from the same state, gave the same loss: the loss continues from the
    # resumed step
    redone = redone_started = 0
    for prev, gen in zip(gens, gens[1:]):
        resumed = min(losses[gen]) - 1
        trained = max(losses[prev])
        assert 0 < resumed <= trained, (prev, gen, resumed, trained)
        for s in range(resumed + 1, trained + 1):
            assert sorted(samples[(gen, s)]) == sorted(samples[(prev, s)]), s
            assert abs(losses[gen][s] - losses[prev][s]) < loss_tolerance, (
                s, losses[prev][s], losses[gen][s])
        if resumed == trained:  # a drain checkpoint: the next loss follows the last one
            assert abs(losses[gen][resumed + 1] - losses[prev][resumed]) < drain_jump, (
                losses[prev][resumed], losses[gen][resumed + 1])
        redone += trained - resumed
        redone_started += max(s for g, s in samples if g == prev) - resumed
    first = losses[gens[0]][1]
    assert losses[gens[-1]][STEPS] < first - 0.3, (first, losses[gens[-1]][STEPS])

    # the job's counters tell the truth: every restart restored a commit; the
    # steps redone are those the coordinator had seen reported before the
    # restart (reports go every 0.5 s, so the last fraction of a second may
    # be missing), never more than were redone. A step is reported when it
    # ends (on_step_end), before its loss is logged (on_log): a SIGKILL in
    # between leaves a finished step without a loss in the audit, so the
    # upper bound is the steps started (the sample ids every rank audits)
    assert job.status.num_restores == len(gens) - 1, job.status
    assert redone > 0, "the SIGKILLed node cost the steps since the commit"
    assert redone - 8 <= job.status.steps_redone <= redone_started, (
        job.status.steps_redone, redone, redone_started)
