"""Test helper: drive rank processes with hand-written plans, no coordinator.

`FakeJob` plays the agents' part of the control channel (one control directory
per member) and hosts the rendezvous store, so the library's generation
switching, state hand-over and sample accounting can be tested in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import torch.distributed as dist

from sbtest import start_python
from springback.service.transport.planboard import Posted
from springback.v1 import types_pb2 as pb
from springback.client import env as E
from springback.worker.agent.rankprocess import RankProcess
from springback.worker.control import PlanPublisher
from springback.worker.eventlog import read as read_metrics

TINY_TRAIN = str(Path(__file__).with_name("tiny_train.py"))


class FakeJob:
    def __init__(self, root: Path, *, num_samples: int = 256, global_batch_size: int = 12,
                 max_steps: int = 40) -> None:
        self.root = root
        self.audit_dir = str(root / "audit")
        self.metrics = str(root / "metrics.jsonl")
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.spec = pb.JobSpec(name="fake", max_steps=max_steps)
        self.spec.failures.plan_wait_s = 15
        self.spec.data.num_samples = num_samples
        self.spec.data.global_batch_size = global_batch_size
        self.generation = 0
        self.publishers: dict[str, PlanPublisher] = {}
        self.procs: dict[str, RankProcess] = {}

    def spawn(self, member: str, extra_env: dict[str, str] | None = None) -> RankProcess:
        control = str(self.root / "control" / member)
        if member not in self.publishers:
            self.publishers[member] = PlanPublisher(control)
        environ = dict(os.environ, **{
            E.JOB_ID: "fake", E.MEMBER_ID: member, E.LOCAL_RANK: "0", E.CONTROL_DIR: control,
            E.COLLECTIVE_TIMEOUT_S: "10", E.AUDIT_DIR: self.audit_dir,
            E.METRICS_FILE: self.metrics, "GLOO_SOCKET_IFNAME": "lo",
            "TINY_STEP_SLEEP_S": "0.05", "TINY_LOG": "info", **(extra_env or {})})
        environ.pop(E.COORDINATOR, None)
        log = open(self.root / f"{member}.log", "ab")
        proc = start_python([TINY_TRAIN], env=environ, stdout=log, stderr=subprocess.STDOUT)
        self.procs[member] = proc
        return proc

    def publish(self, members: list[str], reason: str = "", source_rank: int = 0,
                layout: pb.ParallelLayout | None = None) -> pb.Plan:
        self.generation += 1
        plan = pb.Plan(job_id="fake", generation=self.generation, action=pb.PLAN_ACTION_RUN,
                       world_size=len(members), master_addr="127.0.0.1",
                       master_port=self.store.port, reason=reason)
        plan.spec.CopyFrom(self.spec)
        for i, m in enumerate(members):
            plan.members.add(member_id=m, node_rank=i, first_rank=i, num_local_ranks=1)
        plan.restore.kind = pb.RESTORE_KIND_PEERS
        plan.restore.source_rank = source_rank
        if layout is not None:
            plan.layout.CopyFrom(layout)
        posted = Posted(plan.SerializeToString(), 0)
        for member, pub in self.publishers.items():
            pub.publish(posted.slice(member))  # what the coordinator sends each
        return plan

    def steps(self) -> list[dict]:
        return [r for r in read_metrics(self.metrics) if r["event"] == "step"]

    def wait_step(self, step: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(r["step"] >= step for r in self.steps()):
            assert time.monotonic() < deadline, f"step {step} not reached"
            time.sleep(0.05)

    def finish(self, members: list[str], timeout_s: float = 90) -> None:
        """Waits for `members`' ranks to exit 0 within `timeout_s` together.
        On a failure (a rank exited non-zero, or is still running), every rank
        still running has its Python stacks dumped into its log (tiny_train
        registers SIGUSR1 with faulthandler), and the assertion carries every
        member's log tail: a hang in CI says where each rank was."""
        deadline = time.monotonic() + timeout_s
        for m in members:
            try:
                code = self.procs[m].wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{m} still running after {timeout_s:.0f}s"
                                     f"{self._logs_with_stacks()}") from None
            assert code == 0, f"{m} exited {code}{self._logs_with_stacks()}"

    def log_tail(self, member: str, chars: int = 6000) -> str:
        return (self.root / f"{member}.log").read_text(errors="replace")[-chars:]

    def _logs_with_stacks(self) -> str:
        """Every member's log tail, the Python stacks of those still running last."""
        running = [m for m, p in self.procs.items() if p.poll() is None]
        for m in running:
            self.procs[m].send_signal(signal.SIGUSR1)
        until = time.monotonic() + 5
        while time.monotonic() < until and not all(
                "most recent call first" in self.log_tail(m) for m in running):
            time.sleep(0.05)
        return "".join(f"\n--- {m}'s log{' (still running; stacks last)' if m in running else ''}:"
                       f"\n{self.log_tail(m, 4000)}" for m in self.procs)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def state_records(audit_dir: str) -> list[dict]:
    out = []
    for path in Path(audit_dir).glob("state-*.jsonl"):
        out += [json.loads(l) for l in path.read_text().splitlines()]
    return out


def assert_replicas_identical(audit_dir: str) -> int:
    """Every (generation, when, step) group of state digests has one value;
    returns the number of groups compared."""
    groups: dict[tuple, set[str]] = {}
    for r in state_records(audit_dir):
        groups.setdefault((r["generation"], r["when"], r["step"]), set()).add(r["digest"])
    for key, digests in groups.items():
        assert len(digests) == 1, f"replicas differ at {key}"
    return len(groups)
