"""The agent's rank watchdog (worker/agent/watchdog.py) against real statistics files
written by `RankStats`, the way a rank writes them."""

from __future__ import annotations

import os

import pytest

from sbtest import wait_for
from springback.worker.agent import watchdog
from springback.worker.rankstats import RankStats
from springback.worker.agent.watchdog import RankWatchdog

pytestmark = pytest.mark.timeout(30)

COLLECTIVE_S = 0.1


@pytest.fixture
def dog(tmp_path, monkeypatch):
    monkeypatch.setattr(watchdog, "GRACE_S", 0.2)
    return RankWatchdog(str(tmp_path), COLLECTIVE_S)


def _rank(tmp_path, local_rank: int, *, seen: int) -> RankStats:
    stats = RankStats(str(tmp_path), local_rank)
    stats.plan_seen(seen)
    return stats


def test_a_rank_that_never_reads_the_newest_plan_is_hung_after_its_answer_deadline(
        tmp_path, dog):
    _rank(tmp_path, 0, seen=3)
    answering = _rank(tmp_path, 1, seen=3)
    dog.published(4)
    ranks = [(0, os.getpid()), (1, os.getpid())]
    assert dog.hung(ranks) == []  # too early for anyone to be late
    answering.plan_seen(4)
    found = wait_for(lambda: dog.hung(ranks), 10, "the watchdog to call rank 0 hung")
    assert [lr for lr, _ in found] == [0]
    assert "generation 4" in found[0][1] and "last read generation 3" in found[0][1]


def test_a_rank_in_a_bounded_operation_a_long_step_or_an_old_process_is_not_hung(
        tmp_path, dog):
    busy = _rank(tmp_path, 0, seen=3)
    busy.busy("agreeing on the state")
    slow = _rank(tmp_path, 1, seen=3)
    slow.values["last_step_seconds"] = 60.0  # a long step: it reads the plan at its end
    slow.flush(force=True)
    _rank(tmp_path, 2, seen=3)  # a file left by an earlier process of local rank 2
    dog.published(4)
    ranks = [(0, os.getpid()), (1, os.getpid()), (2, os.getpid() + 1)]
    # past the deadline of an idle rank several times over: still none is hung
    fresh = _rank(tmp_path, 3, seen=3)
    wait_for(lambda: dog.hung([(3, os.getpid())]), 10, "an idle rank's deadline to pass")
    assert dog.hung(ranks) == []
    busy.busy("")
    assert [lr for lr, _ in dog.hung(ranks)] == [0]
    fresh.plan_seen(4)
    assert dog.hung([(3, os.getpid())]) == []


def test_ranks_that_read_the_newest_plan_are_not_read_again_until_a_newer_one(
        tmp_path, dog, monkeypatch):
    reads = []
    read_all = watchdog.rankstats.read_all
    monkeypatch.setattr(watchdog.rankstats, "read_all",
                        lambda d: reads.append(d) or read_all(d))
    _rank(tmp_path, 0, seen=4)
    second = _rank(tmp_path, 1, seen=3)
    dog.published(4)
    ranks = [(0, os.getpid()), (1, os.getpid())]
    found = wait_for(lambda: dog.hung(ranks), 10, "the answer deadline to pass")
    assert [lr for lr, _ in found] == [1]
    second.plan_seen(4)
    assert dog.hung(ranks) == []
    n = len(reads)
    assert dog.hung(ranks) == [] and dog.hung(ranks) == []
    assert len(reads) == n  # everyone answered generation 4: no file read
    dog.published(5)  # a newer plan: rank 0 never reads it and is found again
    second.plan_seen(5)
    found = wait_for(lambda: dog.hung(ranks), 10, "the new answer deadline to pass")
    assert [lr for lr, _ in found] == [0] and len(reads) > n
