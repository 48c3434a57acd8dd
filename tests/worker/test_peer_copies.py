"""Peer copies (worker/state/peercopy.py): pure FSDP across nodes, a node lost,
its shards taken from the copy its partner kept in host memory: no checkpoint
read, at most K steps redone on the same samples, the state bit-identical to
the copy step's. Real agents, coordinator, etcd and multi-process gloo."""

from __future__ import annotations

import signal

import pytest
import torch
from cluster import steps
from sbtest import wait_for
from springback.client import plans
from springback.v1 import types_pb2 as pb
from springback.worker.state.peercopy import (
    PeerCopyStore,
    index_of,
    partners,
    replicated_elsewhere,
    take_snapshot,
)
from springback.worker.state.reshard import Box
from test_elastic import cluster  # noqa: F401 - the fixture
from test_sharded import FSDP_TRAIN, SPEC, assert_resharded_bit_identical, digests, member_id

K = 4
COPIES = {**SPEC, "name": "peer-copies", "min_workers": 2, "max_workers": 3,
          "layout": {"shard": 2}, "max_steps": 60, "peer_copies": {"every_steps": K},
          "checkpoint": {"uri": "set by the fixture", "every_steps": 10}}


def lose_an_active_node_after_a_commit(cluster) -> tuple[int, int]:  # noqa: ANN001
    """Three one-rank agents, shard=2 (the third a hot spare); SIGKILLs an
    active one once a commit exists. Returns (commit step, step at the kill)."""
    agents = [cluster.start(n, script=FSDP_TRAIN) for n in ("a", "b", "c")]
    cluster.wait_world(2, min_step=12, timeout_s=120)
    committed = wait_for(lambda: cluster.job().status.last_checkpoint.step, 30, "a commit")
    active = set(cluster.job().status.members)
    victim = next(a for a in agents if member_id(a) in active)
    killed_at = max(r["step"] for r in steps(cluster.root))
    victim.signal_node(signal.SIGKILL)
    cluster.agents = [a for a in agents if a is not victim]
    return committed, killed_at


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cluster", [COPIES], indirect=True)
def test_a_lost_fsdp_node_is_recovered_from_its_peer_copy_without_reading_a_checkpoint(cluster):
    committed, killed_at = lose_an_active_node_after_a_commit(cluster)
    cluster.fast_forward()  # the last fault is past: no more slow steps
    job = cluster.wait_succeeded(timeout_s=150)
    for agent in cluster.agents:  # SUCCEEDED comes at the last step's report: the
        assert agent.wait(30) == 0, agent.log()  # ranks' clean-end records come after it
    assert job.status.num_restores == 0, job.status  # no checkpoint read ...
    for agent in cluster.agents:
        assert "restoring checkpoint" not in agent.log(), agent.log()
    assert "came from peer copies: rolled back to step" in "".join(a.log() for a in cluster.agents)
    assert job.status.steps_redone <= K, job.status  # ... but at most K steps redone
    _, events = cluster.api.list_job_events(cluster.job_id)
    rolled_back = [e for e in events if e.restore == pb.RESTORE_KIND_PEER_COPY]
    assert len(rolled_back) == 1, events  # what the coordinator learnt: the kind, the redo
    assert rolled_back[0].start_step % K == 0 and rolled_back[0].steps_redone == \
        job.status.steps_redone, rolled_back
    rolled = [r for r in digests(cluster.root) if r["when"] == "start" and r["step"] > 0]
    assert rolled and all(r["step"] % K == 0 and r["step"] >= committed for r in rolled), rolled
    assert_resharded_bit_identical(cluster.root, world=2)  # the copy step's state, bit for bit
    cluster.audit()  # each sample applied once through the replay


@pytest.mark.soak  # ~60 s: the control run of the test above, copies off
@pytest.mark.timeout(180)
@pytest.mark.parametrize("cluster", [{**COPIES, "peer_copies": {"every_steps": 0}}],
                         indirect=True)
def test_without_peer_copies_the_same_loss_restores_the_newest_commit(cluster):
    committed, _ = lose_an_active_node_after_a_commit(cluster)
    cluster.fast_forward()  # the last fault is past: no more slow steps
    job = cluster.wait_succeeded(timeout_s=150)
    assert job.status.num_restores >= 1, job.status
    cluster.audit()


def plan_of(*ranks_per_member: int, shard: int, ep: int = 1) -> pb.Plan:
    plan = pb.Plan(world_size=sum(ranks_per_member))
    first = 0
    for i, n in enumerate(ranks_per_member):
        plan.members.add(member_id=f"m{i}", node_rank=i, first_rank=first, num_local_ranks=n)
        first += n
    plan.layout.dp, plan.layout.shard = plan.world_size, shard
    plan.layout.replicate = plan.world_size // shard
    plan.layout.ep = ep
    return plans.set_nodes(plan)


class TestPartners:
    def test_each_rank_is_copied_to_the_same_local_rank_of_the_next_member(self):
        assert partners(plan_of(2, 2, shard=4)) == {0: 2, 1: 3, 2: 0, 3: 1}
        assert partners(plan_of(1, 1, 1, shard=3)) == {0: 1, 1: 2, 2: 0}

    def test_one_member_makes_no_copies(self):
        assert partners(plan_of(2, shard=2)) == {}

    def test_hsdp_with_replicas_on_other_nodes_needs_no_copies(self):
        assert replicated_elsewhere(plan_of(2, 2, shard=2))  # replicate 2 across the nodes
        assert not replicated_elsewhere(plan_of(2, 2, shard=4))  # pure FSDP across them
        assert not replicated_elsewhere(plan_of(1, 1, shard=2))

    def test_a_replica_that_holds_other_experts_is_no_replica_of_the_expert_slice(self):
        # one rank per node, replicate 2: the dense rows have a replica on the
        # other node, but its expert group coordinate differs (ep = 2 over both)
        assert replicated_elsewhere(plan_of(1, 1, shard=1))
        assert not replicated_elsewhere(plan_of(1, 1, shard=1, ep=2))
        # two ranks per node, ep = 2 inside each: the other node holds the same experts
        assert replicated_elsewhere(plan_of(2, 2, shard=2, ep=2))


def test_a_snapshot_holds_the_shards_at_its_step_and_the_store_offers_them_by_step():
    held = {"param/w": (torch.arange(6, dtype=torch.float32).reshape(3, 2), Box((6, 2), "float32", (3, 0), (6, 2))),
            "optim/w/step": (torch.tensor([7.0]), Box((), "float32", (0,), (1,))),
            "param/c": (torch.ones(5, dtype=torch.float64), Box((10,), "float64", (5,), (10,)))}
    snap = take_snapshot(held, 8, {"hyper": [], "extra": {}})
    held["param/w"][0].add_(100)  # training goes on: the snapshot keeps step 8's values
    data, rows = snap.piece("param/w")
    assert torch.equal(data, torch.arange(6, dtype=torch.float32).reshape(3, 2)) and rows.start == (3, 0)
    assert torch.equal(snap.piece("param/c")[0], torch.ones(5, dtype=torch.float64))
    assert snap.flat.numel() == index_of(held)[1]
    store = PeerCopyStore()
    store.own.append(snap)
    store.copies.append(take_snapshot(held, 8, None))
    assert store.offer()[8]["own"] and len(store.offer()[8]["rows"]) == 2
    store.keep_from(12)
    assert store.offer() == {}


def test_a_replaced_pieces_buffer_is_filled_by_the_next_copy_and_one_of_another_size_let_go():
    held = {"param/w": (torch.arange(6, dtype=torch.float32).reshape(3, 2), Box((6, 2), "float32", (3, 0), (6, 2)))}
    store = PeerCopyStore()
    store.own.append(take_snapshot(held, 4, None, store.buffer))
    first = store.own[0].flat  # (referenced here too: its memory cannot be handed out again)
    store.own.append(take_snapshot(held, 8, None, store.buffer))  # 4's is held while 8's travels
    assert store.own[1].flat.data_ptr() != first.data_ptr()
    store.keep_from(8)
    held["param/w"][0].add_(1)
    third = take_snapshot(held, 12, None, store.buffer)
    assert third.flat.data_ptr() == first.data_ptr()  # step 4's buffer, filled again ...
    assert torch.equal(third.piece("param/w")[0], held["param/w"][0])  # ... with step 12's values
    store.own.append(third)
    store.keep_from(12)
    wider = {"param/w": (torch.zeros(3, 40), Box((6, 40), "float32", (3, 0), (6, 40)))}  # another layout
    store.own.append(take_snapshot(wider, 16, None, store.buffer))
    store.keep_from(16)
    assert store.nbytes() == index_of(wider)[1]  # the old size's buffers are given back


@pytest.mark.timeout(120)
def test_a_node_lost_mid_transfer_rolls_back_to_the_previous_complete_copy(tmp_path):
    """peercopy_peer.py: step 2's copies complete, node 1 dies before sending
    step 4's; the survivors' step-4 snapshots do not cover its rows, so they
    roll back to step 2, bit for bit, instead of to a checkpoint. The failed
    step-4 transfer stays in flight for `abandon`, which keeps its buffers
    past the group (gloo may still write into them)."""
    import json
    import os
    from pathlib import Path

    from sbtest import run_python_all

    script = Path(__file__).with_name("peercopy_peer.py")
    codes, outs = run_python_all([[str(script), str(r), str(tmp_path)] for r in range(4)],
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout_s=100)
    out = "\n".join(o[-2000:] for o in outs)
    assert codes == [0, 0, 0, 0], out
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["step"], result["kind"]) == (2, "RESTORE_KIND_PEER_COPY"), out
    assert result["digest"] == result["digests"]["2"] != result["digests"]["4"]
