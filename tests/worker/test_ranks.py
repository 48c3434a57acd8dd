"""The warm spare's set-up runs at the idle scheduling class; ranks never do."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from sbtest import wait_for
from springback.worker.agent.ranks import LocalRanks, can_restore_priority

STANDBY = str(Path(__file__).with_name("standby_rank.py"))
IDENTITY = {"member_id": "m-1", "control_dir": "/nonexistent", "collective_timeout_s": 5.0}

pytestmark = pytest.mark.skipif(not can_restore_priority(),
                                reason="needs CAP_SYS_NICE or RLIMIT_NICE to leave SCHED_IDLE")


def _threads(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def _report(proc) -> dict:  # noqa: ANN001
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == 0, out
    return json.loads(out.decode().strip().splitlines()[-1])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fork", [False, True], ids=["exec", "fork-server"])
def test_the_spare_sets_up_at_idle_priority_and_runs_at_normal_priority_once_activated(
        tmp_path, fork):
    ranks = LocalRanks([sys.executable, STANDBY], str(tmp_path), keep_spare=True,
                       rank_logs=lambda proc: None, fork=fork)
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        first = ranks.start_all(1, env, timeout_s=30, abort=lambda: False)
        assert first[0].ready()
        assert _threads(first[0].proc.pid) == {os.SCHED_OTHER}  # a rank: never idle
        ranks.ensure_spare(env)
        spare = ranks.spare
        assert spare is not None
        wait_for(spare.ready, timeout_s=30, what="the spare's set-up")
        assert _threads(spare.proc.pid) == {os.SCHED_IDLE}  # both its threads
        first[0].activate(0, IDENTITY)
        assert set(_report(first[0].proc)["threads"].values()) == {"normal"}
        assert ranks.replace(0, IDENTITY, env)  # the spare takes the place, warm
        report = _report(spare.proc)
        assert report["local_rank"] == 0
        assert len(report["threads"]) == 2
        assert set(report["threads"].values()) == {"normal"}, report
    finally:
        ranks.close()
