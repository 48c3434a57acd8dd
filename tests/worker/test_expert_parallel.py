"""Expert parallel kept live (DP x EP): a mixture-of-experts script
(tests/worker/moe_train.py: top-2 router replicated, experts stacked
``[E, ...]`` and sharded over the ``ep`` dimension of the expert mesh,
all-to-all dispatch over gloo) on real agents, coordinator and etcd. A
node's loss leaves its experts' replicas on the survivors, a join takes
them from there: in memory, no checkpoint read, bit-identical."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from cluster import steps
from inflight import SLOW_COLLECTIVES, kill_mid_transfer
from sbtest import ranks_of, run_gloo_peers, wait_for
from test_elastic import cluster  # noqa: F401 - the fixture
from test_sharded import SPEC, assert_resharded_bit_identical

MOE_TRAIN = str(Path(__file__).with_name("moe_train.py"))
EP = {**SPEC, "name": "expert-parallel", "min_workers": 1, "max_workers": 2,
      "layout": {"ep": 2}}


@pytest.mark.timeout(90)
def test_experts_split_over_ep_train_as_the_same_experts_held_whole(tmp_path):
    """moe_equivalence_peer.py on two gloo ranks: moe_train.py's top-2
    mixture of experts trained 4 steps with its experts sharded over ep = 2
    (tokens dispatched by all-to-all) ends where the same model with every
    expert on every rank (ep = 1) ends, so a token reaches its expert and
    the expert's gradient reaches the rank that holds it."""
    script = str(Path(__file__).with_name("moe_equivalence_peer.py"))
    split, whole = run_gloo_peers(script, 2, str(tmp_path / "store"))[0].values()
    assert sorted(split) == sorted(whole) and "moe.w1" in split
    for name in whole:
        assert torch.allclose(torch.tensor(split[name]), torch.tensor(whole[name]),
                              atol=1e-5), name
    applied = torch.zeros(256, dtype=torch.float64)
    applied[:48] = 1  # 4 steps of 12 samples, each applied once
    assert torch.allclose(torch.tensor(split["counter.weight"], dtype=torch.float64), applied,
                          atol=1e-9)


def held_experts(root: Path) -> dict[int, dict[int, dict]]:
    """generation -> rank -> what moe_train.py recorded holding at its start."""
    out: dict[int, dict[int, dict]] = {}
    for path in (root / "audit").glob("experts-g*-r*.json"):
        generation, rank = (int(p[1:]) for p in path.stem.split("-")[1:])
        out.setdefault(generation, {})[rank] = json.loads(path.read_text())
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cluster", [EP], indirect=True)
def test_expert_parallel_node_loss_then_join_reshard_the_experts_in_memory_bit_identical(
        cluster):
    """Two nodes of two ranks, ep = 2: each node is one expert group (dp
    ranks 0-1 and 2-3), a replica of the other. SIGKILL of one node: the
    survivor's group holds every expert, training goes on at world 2 with
    ep = 2. A third node joins: its ranks take the experts from the
    survivor's, world 4 again."""
    moe = {"script": MOE_TRAIN, "nproc": 2, "env": {"TINY_STEP_SLEEP_S": "0.2"}}
    a = cluster.start("a", **moe)
    b = cluster.start("b", **moe)
    cluster.wait_world(4, min_step=12, timeout_s=150)
    cluster.damage_commits(min_step=10)  # a restore would fail: memory must serve
    b.signal_node(signal.SIGKILL)
    cluster.wait_world(2, min_step=max(r["step"] for r in steps(cluster.root)) + 2,
                       timeout_s=90)
    c = cluster.start("c", **moe)  # joins the survivor: 2 -> 4 ranks
    cluster.wait_world(4, min_step=max(r["step"] for r in steps(cluster.root)) + 3,
                       timeout_s=120)
    cluster.fast_forward()  # the last fault is past: no more slow steps
    job = cluster.wait_succeeded(timeout_s=150)
    assert a.wait(30) == 0, a.log()
    assert c.wait(30) == 0, c.log()
    # from memory: no checkpoint read, no step redone (the other group held every expert)
    assert job.status.num_restores == 0 and job.status.steps_redone == 0, job.status
    assert "restoring checkpoint" not in a.log() + c.log()
    assert job.status.last_checkpoint.step >= 10 and "failed on rank" not in a.log(), a.log()
    assert_resharded_bit_identical(cluster.root, world=2)  # after the loss
    assert_resharded_bit_identical(cluster.root, world=4)  # after the join
    # every generation split the 4 experts over ep = 2: ranks 0-1 and 2-3 two each
    generations = held_experts(cluster.root)
    assert {h["world_size"] for g in generations.values() for h in g.values()} == {2, 4}
    for held in generations.values():
        for rank, h in held.items():
            assert h["ep"] == 2 and h["experts"] == [2 * (rank % 2), 2 * (rank % 2) + 2], held
    cluster.audit()  # exactly once: sampler records and the applied counter


EP_INFLIGHT = {**{k: v for k, v in EP.items() if k != "checkpoint"}, "name": "expert-inflight",
               "max_workers": 3, "max_steps": 60}
"""No checkpoint: the experts can only come from a live expert group."""


@pytest.mark.soak
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cluster", [EP_INFLIGHT], indirect=True)
def test_expert_parallel_a_holder_sigkilled_while_a_joiner_receives_its_experts_keeps_them(
        cluster):
    """Issue 50's second fault with teeth, expert parallel: expert groups a
    and b (ep = 2 each) train with a frozen ballast stacked per expert
    (MOE_BALLAST_MB, sharded like the experts), c joins (world 6); while the
    joiner's ranks receive their experts, node b is SIGKILLed from outside,
    timed by the bytes the joiner has received. The experts can only come
    from a."""
    ballast = 256 * 2**20  # each joiner rank receives its half: ep = 2
    moe = {"script": MOE_TRAIN, "nproc": 2,
           "env": {"TINY_STEP_SLEEP_S": "0.2", "MOE_BALLAST_MB": str(ballast // 2**20)}}
    a = cluster.start("a", *SLOW_COLLECTIVES, **moe)
    b = cluster.start("b", *SLOW_COLLECTIVES, **moe)
    cluster.wait_world(4, min_step=3, timeout_s=150)
    c = cluster.start("c", *SLOW_COLLECTIVES, **moe)
    joiners = wait_for(lambda: len(ranks := ranks_of(c.pid)) == 2 and ranks, 60,
                       "the joiner's two ranks")
    kill_mid_transfer(b, [a, b], joiners, ballast, "experts", percent=20)
    cluster.fast_forward()
    job = cluster.wait_succeeded(timeout_s=180)
    assert b.wait(30) == -signal.SIGKILL
    for agent in (a, c):
        assert agent.wait(30) == 0, agent.log()
    assert job.status.num_state_losses == 0 and job.status.num_restores == 0, job.status
    assert not job.status.last_checkpoint.uri, job.status
    assert sorted(r["step"] for r in steps(cluster.root)) == list(range(1, 61))
    assert_resharded_bit_identical(cluster.root, world=4)  # a and c, after the kill
    cluster.audit()
