"""Pipeline parallel kept live (DP x PP): a pipeline script
(tests/worker/pp_train.py: four layers split over pp = 2 stages by
`springback.worker.stage_layers`, each stage the full model less the other
stages' layers, so its state keeps the global names; GPipe over gloo;
plain parameters replicated over a stage's dp ranks) on real agents,
coordinator and etcd. A node's loss leaves each stage a live dp replica on
the survivors, a join takes the stages from there: in memory, no checkpoint
read, bit-identical."""

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
from test_sharded import SPEC

from springback.worker.state.reshard import Box, plan_transfers
from springback.worker.state.sharded import unfilled

PP_TRAIN = str(Path(__file__).with_name("pp_train.py"))
PP = {**{k: v for k, v in SPEC.items() if k != "checkpoint"}, "name": "pipeline-parallel",
      "min_workers": 1, "max_workers": 4, "layout": {"pp": 2}}
"""No checkpoint: memory is the only source, so a fill that failed would be
a state loss, which the tests refuse (pipeline checkpoints:
test_layout_restore.py)."""
PP_COPIES = {**PP, "name": "pipeline-copies", "max_workers": 2, "max_steps": 40,
             "peer_copies": {"every_steps": 2}}
"""pp = 2 x dp = 1: no stage has a replica, so only the peer copies hold a
lost stage."""


def _whole(n: int) -> Box:
    return Box((n,), "float32", (0,), (n,))


@pytest.mark.timeout(10)
def test_each_stage_is_filled_from_its_own_replicas_and_judged_on_every_stage():
    """Old ranks 0-1 held stage 0 (layers.0), 2-3 stage 1 (layers.1), whole;
    the new world of 2 needs one stage each: each key comes from a holder of
    it, and the fill is complete only over both stages' keys."""
    stage = [{"param/layers.0.weight": _whole(4)}, {"param/layers.1.weight": _whole(6)}]
    have = [stage[0], stage[0], stage[1], stage[1]]
    transfers = plan_transfers(have, [stage[0], stage[1], {}, {}])
    assert transfers is not None
    assert {(t.key, t.dst) for t in transfers} == {("param/layers.0.weight", 0),
                                                   ("param/layers.1.weight", 1)}
    assert all(t.key in have[t.src] for t in transfers)
    owns = [set(stage[0]), set(stage[1])]
    assert unfilled({**stage[0], **stage[1]}, owns) == []
    assert unfilled(stage[0], owns) == ["param/layers.1.weight"]  # stage 1 lost
    assert unfilled({**stage[0], "optim/layers.9.weight/exp_avg": _whole(1)}, [set(stage[0])]) \
        == ["optim/layers.9.weight/exp_avg (not in the new model)"]
    # each rank alone (the peer copies' test): the other stage's keys have no place
    assert unfilled({**stage[0], **stage[1]}, [owns[0]]) == [
        "param/layers.1.weight (not in the new model)"]


@pytest.mark.timeout(90)
def test_a_two_stage_pipeline_trains_like_the_model_unpipelined(tmp_path):
    """pp_equivalence_peer.py on two gloo ranks: pp_train.py's model trained
    4 steps as a 2-stage GPipe pipeline (2 micro-batches) ends where the
    same model trained whole on the same batches ends, so activations reach
    the next stage and gradients come back to the one before."""
    script = str(Path(__file__).with_name("pp_equivalence_peer.py"))
    result = run_gloo_peers(script, 2, str(tmp_path / "store"))[0]
    split, whole = result["split"], result["whole"]
    assert sorted(split) == sorted(whole) and "layers.0.weight" in split
    for name in whole:
        assert torch.allclose(torch.tensor(split[name]), torch.tensor(whole[name]),
                              atol=1e-5), name
    applied = torch.zeros(256, dtype=torch.float64)
    applied[:48] = 1  # 4 steps of 12 samples, each applied once
    assert torch.equal(torch.tensor(split["counter.weight"], dtype=torch.float64), applied)


def assert_stages_bit_identical(root: Path, world: int) -> None:
    """The full state gathered at the start of each generation of `world`
    ranks equals, tensor by tensor, what the ranks of earlier generations
    held after that step (pp_train.py's records): every key, every digest."""
    records = []
    for path in sorted((root / "audit").glob("digest-g*-r*.jsonl")):
        generation = int(path.stem.split("-")[1].removeprefix("g"))
        records += [{**json.loads(line), "generation": generation}
                    for line in path.read_text().splitlines()]
    starts = [r for r in records if r["when"] == "start" and r["world_size"] == world
              and r["step"] > 0]
    assert starts, f"no generation of {world} ranks started from a trained state"
    for start in starts:
        earlier: dict[str, set[str]] = {}
        for r in records:
            if r["step"] == start["step"] and r["generation"] < start["generation"]:
                for key, digest in r["keys"].items():
                    earlier.setdefault(key, set()).add(digest)
        assert earlier == {k: {d} for k, d in start["keys"].items()}, (start, earlier)


def held_stages(root: Path) -> dict[int, dict[int, dict]]:
    """generation -> rank -> the layers pp_train.py recorded holding at its start."""
    out: dict[int, dict[int, dict]] = {}
    for path in (root / "audit").glob("stage-g*-r*.json"):
        generation, rank = (int(p[1:]) for p in path.stem.split("-")[1:])
        out.setdefault(generation, {})[rank] = json.loads(path.read_text())
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cluster", [PP], indirect=True)
def test_pipeline_node_loss_then_join_refill_the_stages_in_memory_bit_identical(cluster):
    """Four single-rank nodes, pp = 2 x dp = 2: ranks 0-1 (a, b) hold layers
    0-1, ranks 2-3 (c, d) layers 2-3 (and the counter). SIGKILL of rank 3's
    node (d): the planner keeps pp = 2 and takes a world of 2 with a survivor
    of each stage on it (a 0, c 1; b waits as a spare), where the first two
    survivors (a, b: both stage 0) would have left the last stage to no one.
    A fifth node joins: world 4 again, a and b on stage 0, c and e on stage 1
    (e taking it from c)."""
    pp = {"script": PP_TRAIN, "nproc": 1, "env": {"TINY_STEP_SLEEP_S": "0.2"}}
    a = cluster.start("a", **pp)
    b = cluster.start("b", **pp)
    c = cluster.start("c", **pp)
    d = cluster.start("d", **pp)
    cluster.wait_world(4, min_step=12, timeout_s=150)
    d.signal_node(signal.SIGKILL)
    cluster.wait_world(2, min_step=max(r["step"] for r in steps(cluster.root)) + 2,
                       timeout_s=90)
    e = cluster.start("e", **pp)  # with the spare b: 2 -> 4 ranks
    cluster.wait_world(4, min_step=max(r["step"] for r in steps(cluster.root)) + 3,
                       timeout_s=120)
    cluster.fast_forward()  # the last fault is past: no more slow steps
    job = cluster.wait_succeeded(timeout_s=150)
    for agent in (a, b, c, e):
        assert agent.wait(30) == 0, agent.log()
    logs = "".join(agent.log() for agent in (a, b, c, e))
    # from memory (nothing else exists): no state lost, no step redone, each
    # stage had a live replica
    assert job.status.num_state_losses == 0 and job.status.steps_redone == 0, job.status
    assert job.status.num_restores == 0 and not job.status.last_checkpoint.uri, job.status
    assert "restoring checkpoint" not in logs, logs  # num_state_losses above: no state lost
    assert_stages_bit_identical(cluster.root, world=2)  # after the loss
    assert_stages_bit_identical(cluster.root, world=4)  # after the join
    # every generation split the 4 layers over pp = 2 by the rank's pp coordinate
    generations = held_stages(cluster.root)
    assert {h["world_size"] for g in generations.values() for h in g.values()} == {2, 4}
    for held in generations.values():
        for rank, h in held.items():
            stage = rank // (h["world_size"] // 2)
            assert h["pp"] == 2 and h["layers"] == [2 * stage, 2 * stage + 1], held
    cluster.audit()  # exactly once: sampler records and the applied counter


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cluster", [PP_COPIES], indirect=True)
def test_a_lost_stage_without_a_replica_comes_back_from_its_peer_copy_on_a_spare(cluster):
    """Two single-rank nodes, pp = 2 x dp = 1 (a: layers 0-1, b: layers 2-3
    and the counter), peer copies every 2 steps (b's stage kept on a), c a
    spare. SIGKILL of b: c takes stage 1, filled from a's copy of b's stage
    (every rank judges the fill over both stages' keys), rolled back to the
    copy step: no checkpoint, no state lost, each tensor bit-identical to the
    step it resumed from, every sample applied once."""
    pp = {"script": PP_TRAIN, "nproc": 1, "env": {"TINY_STEP_SLEEP_S": "0.2"}}
    a = cluster.start("a", **pp)
    b = cluster.start("b", **pp)
    cluster.wait_world(2, min_step=8, timeout_s=150)
    c = cluster.start("c", **pp)  # a spare: max_workers is 2
    b.signal_node(signal.SIGKILL)
    cluster.fast_forward()  # the last fault is past: no more slow steps
    job = cluster.wait_succeeded(timeout_s=180)
    for agent in (a, c):
        assert agent.wait(30) == 0, agent.log()
    assert job.status.num_state_losses == 0 and job.status.num_restores == 0, job.status
    assert not job.status.last_checkpoint.uri, job.status
    assert "peer copies" in a.log() + c.log()
    assert_stages_bit_identical(cluster.root, world=2)
    cluster.audit()  # exactly once: the steps after the copy step were trained again


PP_SHRINK = {**PP, "name": "pipeline-repartition", "max_workers": 4, "max_steps": 150,
             "layout": {"pp": 4, "min_pp": 2}, "peer_copies": {"every_steps": 2}}
"""pp = 4 x dp = 1, allowed down to 2 stages; the peer copies hold each stage
on the next node. max_steps leaves the joiner ~25 s of slow steps to start
in (its ranks' imports took 8 s on a loaded machine: with 50 the job ended
before it was admitted); `fast_forward` ends them once it is."""


def _layers(stage: int, pp: int, num_layers: int = 4) -> list[int]:
    base, extra = divmod(num_layers, pp)
    first = stage * base + min(stage, extra)
    return list(range(first, first + base + (stage < extra)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cluster", [PP_SHRINK], indirect=True)
def test_a_pipeline_re_partitions_over_the_surviving_stages_and_grows_back(cluster):
    """Four single-rank nodes, one layer each (pp = 4 x dp = 1, min_pp 2),
    no spare. SIGKILL of the third stage's node: no world fits four stages,
    so the planner runs three and the ranks split the four layers 2-1-1,
    filled from the survivors' snapshots and the lost stage's peer copy
    (rolled back to the copy step). A join: four stages again, each layer
    moved from where it lives. No checkpoint, no state lost, bit-identical,
    exactly once."""
    pp = {"script": PP_TRAIN, "nproc": 1, "env": {"TINY_STEP_SLEEP_S": "0.2"}}
    agents = [cluster.start(n, **pp) for n in ("a", "b", "c", "d")]
    cluster.wait_world(4, min_step=8, timeout_s=150)
    agents[2].signal_node(signal.SIGKILL)
    cluster.wait_world(3, min_step=max(r["step"] for r in steps(cluster.root)) + 2,
                       timeout_s=120)
    agents.append(cluster.start("e", **pp))
    cluster.wait_world(4, min_step=max(r["step"] for r in steps(cluster.root)) + 2,
                       timeout_s=120)
    cluster.fast_forward()  # the last fault is past: no more slow steps
    job = cluster.wait_succeeded(timeout_s=180)
    live = [agents[i] for i in (0, 1, 3, 4)]
    for agent in live:
        assert agent.wait(30) == 0, agent.log()
    assert job.status.num_state_losses == 0 and job.status.num_restores == 0, job.status
    assert not job.status.last_checkpoint.uri, job.status
    assert "peer copies" in "".join(agent.log() for agent in live)
    assert_stages_bit_identical(cluster.root, world=3)  # re-partitioned 4 -> 3
    assert_stages_bit_identical(cluster.root, world=4)  # and back
    held = held_stages(cluster.root)
    # from the first four-stage generation on (a loaded start may run fewer
    # stages until every node joined): 4, re-partitioned to 3, back to 4
    first_full = min(g for g, ranks in held.items() if len(ranks) == 4)
    assert {h["pp"] for g, ranks in held.items() if g >= first_full
            for h in ranks.values()} == {3, 4}, held
    for generation in held.values():
        for rank, h in generation.items():
            assert h["layers"] == _layers(rank, h["pp"]), generation
    cluster.audit()


PP_INFLIGHT = {**PP, "name": "pipeline-inflight", "max_workers": 6, "max_steps": 60}


@pytest.mark.soak
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cluster", [PP_INFLIGHT], indirect=True)
def test_pipeline_a_holder_sigkilled_while_joiners_receive_their_stages_keeps_them_in_memory(
        cluster):
    """Issue 50's second fault with teeth, pipelined: four single-rank nodes,
    pp = 2 x dp = 2, each layer carrying a frozen ballast (PP_BALLAST_MB, so
    each stage holds half of it); e and f join (world 6, dp = 3), and while
    the joiners' stages are in flight from their holders, node d is SIGKILLed
    from outside, timed by the bytes the joiners have received. No checkpoint
    and no peer copies: the stages can only come from the live replicas."""
    ballast = 256 * 2**20  # each joiner's stage holds half of it
    pp = {"script": PP_TRAIN, "nproc": 1,
          "env": {"TINY_STEP_SLEEP_S": "0.2", "PP_BALLAST_MB": str(ballast // 2**20)}}
    holders = [cluster.start(n, *SLOW_COLLECTIVES, **pp) for n in ("a", "b", "c", "d")]
    cluster.wait_world(4, min_step=3, timeout_s=150)
    e, f = (cluster.start(n, *SLOW_COLLECTIVES, **pp) for n in ("e", "f"))
    joiners = wait_for(lambda: len(ranks := ranks_of(e.pid) + ranks_of(f.pid)) == 2 and ranks,
                       60, "the joiners' ranks")
    kill_mid_transfer(holders[3], holders, joiners, ballast, "stages", percent=20)
    cluster.fast_forward()
    job = cluster.wait_succeeded(timeout_s=180)
    assert holders[3].wait(30) == -signal.SIGKILL
    for agent in (*holders[:3], e, f):
        assert agent.wait(30) == 0, agent.log()
    assert job.status.num_state_losses == 0 and job.status.num_restores == 0, job.status
    assert not job.status.last_checkpoint.uri, job.status
    assert sorted(r["step"] for r in steps(cluster.root)) == list(range(1, 61))
    assert_stages_bit_identical(cluster.root, world=4)  # after the kill: a, b, c and a joiner
    cluster.audit()
