"""The step-boundary agreement (worker/train/boundary.py) on real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from sbtest import run_python_all

PEER = str(Path(__file__).with_name("boundary_peer.py"))
BROKEN_VOTE_PEER = str(Path(__file__).with_name("broken_vote_peer.py"))
DDP_VOTE_PEER = str(Path(__file__).with_name("ddp_vote_peer.py"))
STEP_VOTE_PEER = str(Path(__file__).with_name("step_vote_peer.py"))


def run_peers(script: str, world: int) -> list[str]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    codes, outs = run_python_all([[script, str(r), str(store.port)] for r in range(world)],
                                 timeout_s=80)
    assert codes == [0] * world, outs
    return outs


@pytest.mark.timeout(90)
def test_ranks_agree_on_the_newest_generation_without_waiting_for_the_vote():
    outs = run_peers(PEER, 3)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    for r in results:
        assert r["first"] is None and r["after"] is None
        # MAX of the generation seen; the loss shares summed; any rank's flag;
        # every rank draining only when each is; every rank's timing in its
        # own slot (-1: none)
        assert r["step1"] == {"step": 1, "newest_generation": 7, "loss": 6.0,
                              "draining": True, "every_draining": False,
                              "last_holder": False, "ended_t": 1.0,
                              "bad": True, "compute_s": [0.25, 1.25, 2.25],
                              "collective_s": [0.0, 2.0, 4.0]}
        assert r["step2"] == {"step": 2, "newest_generation": 5, "loss": -6.0,
                              "draining": True, "every_draining": True,
                              "last_holder": True, "ended_t": 2.0,
                              "bad": False, "compute_s": [-1.0] * 3,
                              "collective_s": [-1.0] * 3}
    # the step loop does not wait for the all-reduce: the prompt ranks' vote of
    # step 1 returned while the last rank was still 1.5 s away from its own
    assert results[0]["vote_s"] < 0.75 and results[1]["vote_s"] < 0.75, results


@pytest.mark.timeout(90)
def test_a_rank_whose_vote_failed_leaves_the_group_without_waiting_for_gloo_to_let_go():
    # The failed vote's traceback holds the vote's tensors; left there, the
    # wait for gloo to release them ran to its timeout on every such failure
    # (5 s by default: a kill of the goodput bench now and then cost 5 s).
    outs = run_peers(BROKEN_VOTE_PEER, 2)
    result = json.loads(outs[0].strip().splitlines()[-1])
    assert result["failed"], "rank 0's vote did not fail"
    assert not [w for w in result["warnings"] if "gloo still holds" in w], result


@pytest.mark.timeout(90)
def test_votes_carried_in_ddp_s_all_reduce_agree_alike_and_train_the_same_model():
    results = [json.loads(out.strip().splitlines()[-1]) for out in run_peers(DDP_VOTE_PEER, 3)]
    for r in results:
        assert r["same"], "the carrying DDP trained a different model"
        # the vote of step k is read at the end of step k + 1 (the last at settle)
        # (every rank drains at step 3, carried, and at step 5, all-reduced alone)
        agreed = [a and (a["step"], a["newest_generation"], a["loss"], a["draining"],
                         a["every_draining"], a["bad"]) for a in r["agreed"]]
        assert agreed == [None, (1, 5, 6.0, False, False, False), (2, 6, 9.0, False, False, True),
                          (3, 5, 12.0, True, True, False), (4, 5, 15.0, True, False, False),
                          (5, 5, 18.0, True, True, False)]
        # each rank's timing in its own slot, carried in the bucket as well
        assert [a and (a["compute_s"], a["collective_s"]) for a in r["agreed"]] == [None] + [
            ([10.0 * k, 10.0 * k + 1, 10.0 * k + 2], [0.0, 1.0, 2.0]) for k in range(1, 6)]
        # step 3 ran no backward: step 2's vote, which step 3's all-reduce would
        # have carried, was all-reduced by itself at step 3's boundary, and the
        # last one at settle; every other vote rode DDP's all-reduce
        assert r["own_all_reduces"] == [2, 5]
        # leaving while the wrapper lives: gloo let go of every carried tensor
        assert not [w for w in r["warnings"] if "gloo still holds" in w], r["warnings"]


@pytest.mark.timeout(90)
def test_a_pipeline_s_votes_ride_its_optimizer_steps_and_no_rank_steps_past_a_dead_peer():
    out = run_peers(STEP_VOTE_PEER, 2)[0]  # rank 1 dies before step 6, printing nothing
    r = json.loads(out.strip().splitlines()[-1])
    # the vote of step k is read at the end of step k + 1 (the last at settle)
    agreed = [a and (a["step"], a["newest_generation"], a["loss"], a["draining"],
                     a["every_draining"], a["bad"]) for a in r["agreed"]]
    assert agreed == [None, (1, 5, 3.0, False, False, False), (2, 6, 5.0, False, False, True),
                      (3, 5, 7.0, False, False, False), (4, 5, 9.0, True, False, False),
                      (5, 5, 11.0, True, True, False)]
    assert [a and (a["compute_s"], a["collective_s"]) for a in r["agreed"]] == [None] + [
        ([10.0 * k, 10.0 * k + 1], [0.0, 1.0]) for k in range(1, 6)]
    # one all-reduce a step: the optimizer step's wait for the world, which
    # carries the previous step's vote (step 3 stepped no optimizer: its
    # boundary all-reduced step 2's vote by itself), and the last at settle
    assert r["all_reduces"] == [1, 1, 1, 1, 1, 1]
    # rank 1 died before its optimizer step of step 6: rank 0's raised in
    # the pre-hook and applied nothing
    assert r["failed"], "rank 0's optimizer step did not fail"
    assert r["kept"], "rank 0 applied a step that rank 1 never reached"
