"""FSDP x TP x PP kept live: a 3-D parallel script (tests/worker/pp3d_train.py:
pp_train.py's four layers split over pp = 2 stages, each stage's layers
tensor parallel over tp = 2 inside a node and fully_shard'ed over the
data-parallel dims, GPipe over gloo) on real agents, coordinator and etcd.

Nodes of two ranks, layout ``{tp: 2, pp: 2}``: a world of 8 is
pp 2 x dp 2 x tp 2 (global ranks ordered pp, dp, tp: node a = stage 0 dp 0,
b = stage 0 dp 1, c = stage 1 dp 0, d = stage 1 dp 1; the planner's default
shard is the dp ranks of one node, 1 here, so FSDP's dp mesh is
replicate 2 x shard 1: HSDP with each stage's DTensor shards replicated on
two nodes). A node's loss leaves every (stage, tp slice) a live holder on
the survivors; the state moves in memory, never from storage (the job has
no checkpoint at all, so a fill that failed would be a state loss, which
the test refuses).

Red-checks (done once, by hand, in a copy of the tree):
* the in-memory reshard disabled (`worker/train/agreement.py`: the
  transfers from the live holders forced to None): the survivors' state is
  not used, it is lost, every rank fails on pp3d_train's applied-step check
  and the job FAILS; the test times out waiting for the world of 4.
* `worker/rank/rendezvous.is_collective_failure` without its walk of
  ``__cause__``: the gloo error of an FSDP reduction inside the stage's
  backward reaches the script wrapped by torch's pipelining ("Failed to run
  stage backward"), is taken for a user error and ends the surviving ranks
  of the killed node's stage; their state is lost ("the held state does not
  fill param/layers.2.weight, ...") and the job FAILS."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from cluster import steps
from sbtest import wait_for
from springback.v1 import types_pb2 as pb
from test_elastic import cluster  # noqa: F401 - the fixture
from test_pipeline_parallel import PP, assert_stages_bit_identical, held_stages

PP3D_TRAIN = str(Path(__file__).with_name("pp3d_train.py"))
SPEC_3D = {**PP, "name": "fsdp-tp-pp", "max_workers": 4, "max_steps": 100,
           "layout": {"tp": 2, "pp": 2}}
"""No checkpoint: memory is the only source (as test_pipeline_parallel.PP)."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cluster", [SPEC_3D], indirect=True)
def test_fsdp_tp_pp_node_loss_then_join_keep_the_state_in_memory_bit_identical(cluster):
    """Four nodes of two ranks, pp 2 x dp 2 x tp 2 (8 ranks). SIGKILL of d
    (stage 1, dp 1): the planner keeps pp = 2 and tp = 2 and takes a world of
    4 with a survivor of each stage (a on stage 0, c on stage 1; b waits as a
    spare), each rank's stage and TP slices taken from its own or a
    survivor's memory. A fifth node joins: world 8 again, b and e taking the
    stages' second dp replicas. Checks: no restore, no state lost, no step
    redone, no storage read; the full state gathered at each new
    generation's start equals, key by key (SHA-256), the state the earlier
    generations held at the step it resumes from; every generation really was
    FSDP x TP x PP (DTensors over the dp and tp dims, pp 2, tp 2); exactly
    once (sampler records and the applied counter).

    Failure semantics: any of the waits raising TimeoutError (world never
    reached, job never succeeded) fails the test with the agents' logs left
    under the test's tmp_path."""
    started = time.monotonic()
    node = {"script": PP3D_TRAIN, "nproc": 2, "env": {"TINY_STEP_SLEEP_S": "0.25"}}
    a, b, c, d = (cluster.start(n, **node) for n in ("a", "b", "c", "d"))
    cluster.wait_world(8, min_step=6, timeout_s=150)
    d.signal_node(signal.SIGKILL)
    cluster.wait_world(4, min_step=max(r["step"] for r in steps(cluster.root)) + 2,
                       timeout_s=90)
    e = cluster.start("e", **node)  # with the spare b: 4 -> 8 ranks
    cluster.wait_world(8, min_step=max(r["step"] for r in steps(cluster.root)) + 2,
                       timeout_s=120)
    cluster.fast_forward()  # the last fault is past: no more slow steps
    job = cluster.wait_succeeded(timeout_s=120)
    for agent in (a, b, c, e):
        assert agent.wait(30) == 0, agent.log()
    logs = "".join(agent.log() for agent in (a, b, c, e))
    assert job.status.num_state_losses == 0 and job.status.steps_redone == 0, job.status
    assert job.status.num_restores == 0 and not job.status.last_checkpoint.uri, job.status
    assert "restoring checkpoint" not in logs, logs  # num_state_losses above: no state lost
    assert_stages_bit_identical(cluster.root, world=4)  # after the loss
    assert_stages_bit_identical(cluster.root, world=8)  # after the join
    generations = held_stages(cluster.root)
    assert {h["world_size"] for g in generations.values() for h in g.values()} >= {4, 8}
    for held in generations.values():
        for rank, h in held.items():
            stage = rank // (h["world_size"] // 2)
            assert (h["pp"], h["tp"], h["shard"]) == (2, 2, 1), held
            assert h["replicate"] == h["world_size"] // 4, held
            assert h["layers"] == [2 * stage, 2 * stage + 1], held
            # every trained parameter a DTensor over the dp dims and tp
            assert sorted(h["dtensors"]) == sorted(
                f"layers.{i}.{w}" for i in h["layers"] for w in ("weight", "bias")), held
            assert all(dims == ["replicate", "shard", "tp"] for dims in h["dtensors"].values()), held
    cluster.audit()
    print(f"3-D scenario wall {time.monotonic() - started:.1f} s")


SPEC_3D_SHARDED = {**SPEC_3D, "name": "fsdp-tp-pp-sharded", "max_steps": 60,
                   "layout": {"tp": 2, "pp": 2, "shard": 2}, "peer_copies": {"every_steps": 2}}
"""FSDP shards across nodes (shard 2, replicate 1): no node's shards have a
replica, only their peer copies on the next node."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cluster", [SPEC_3D_SHARDED], indirect=True)
def test_fsdp_tp_pp_with_shards_across_nodes_a_spare_takes_a_lost_shard_from_its_peer_copy(
        cluster):
    """Four nodes of two ranks, pp 2 x shard 2 x tp 2 (node a = stage 0
    shard 0, b = stage 0 shard 1, c = stage 1 shard 0, d = stage 1 shard 1:
    every parameter is a DTensor sharded over the dp dim *and* tp), peer
    copies every 2 steps, e a spare. SIGKILL of d: its (stage 1, shard 1)
    rows live on only in their peer copy; e takes d's place, filled from
    that copy and the survivors' snapshots, every rank rolled back to the
    copy step, with no WAIT between. Checks: no restore, no state lost, no checkpoint at all, the
    full state gathered at the new start equals (SHA-256 per key) the state
    held at the copy step, every generation FSDP (shard 2) x TP x PP,
    exactly once (the steps after the copy step trained again on the same
    samples).

    Failure semantics: as the test above. Red-check (once, in a copy of the
    tree): the fill from peer copies disabled (`worker/state/peercopy.py`:
    its transfers forced to None): the lost shard has no source, the
    survivors' ranks fail on the applied-step check, the job never succeeds."""
    hold = cluster.root / "hold"  # the job waits at step 8 for the spare (tests/worker/pace.py)
    hold.touch()
    node = {"script": PP3D_TRAIN, "nproc": 2, "env": {
        "TINY_STEP_SLEEP_S": "0.25", "TINY_HOLD_AT_STEP": "8", "TINY_HOLD_FILE": str(hold)}}
    a, b, c, d = (cluster.start(n, **node) for n in ("a", "b", "c", "d"))
    cluster.wait_world(8, min_step=6, timeout_s=150)
    e = cluster.start("e", **node)  # a spare: max_workers is 4
    wait_for(lambda: len(cluster.job().status.spares) == 1, 90, "e to be a spare")
    hold.unlink()
    d.signal_node(signal.SIGKILL)
    cluster.fast_forward()  # the last fault is past: no more slow steps
    job = cluster.wait_succeeded(timeout_s=180)
    for agent in (a, b, c, e):
        assert agent.wait(30) == 0, agent.log()
    logs = "".join(agent.log() for agent in (a, b, c, e))
    assert job.status.num_state_losses == 0 and job.status.num_restores == 0, job.status
    assert not job.status.last_checkpoint.uri, job.status
    assert "restoring checkpoint" not in logs and "came from peer copies" in logs, logs
    _, events = cluster.api.list_job_events(cluster.job_id)
    formed = next(i for i, e in enumerate(events)
                  if e.action == pb.PLAN_ACTION_RUN and e.world_size == 8)
    # the spare took the place at once: no generation waited once the world had formed
    assert all(e.action != pb.PLAN_ACTION_WAIT for e in events[formed:]), events
    assert_stages_bit_identical(cluster.root, world=8)
    generations = held_stages(cluster.root)
    assert len(generations) >= 2, generations  # the first world and the one after the kill
    for held in generations.values():
        for rank, h in held.items():
            assert (h["pp"], h["tp"], h["shard"], h["replicate"]) == (2, 2, 2, 1), held
            assert h["layers"] == [2 * (rank // 4), 2 * (rank // 4) + 1], held
    cluster.audit()
