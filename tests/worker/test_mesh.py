"""The generation's layout as coordinates: which ranks share batches."""

from __future__ import annotations

import pytest

from springback.v1 import types_pb2 as pb
from springback.worker.state.mesh import MeshLayout
from springback.worker.train.sampler import SampleStream

pytestmark = pytest.mark.timeout(30)


def layout_plan(world: int, **degrees: int) -> pb.Plan:
    return pb.Plan(world_size=world, layout=pb.ParallelLayout(**degrees))


def test_tp_and_pp_peers_get_identical_batches_and_dp_ranks_split_the_step():
    lay = MeshLayout.from_plan(layout_plan(8, dp=2, tp=2, pp=2, replicate=1, shard=2))
    stream = SampleStream(num_samples=64, global_batch_size=8, seed=3)
    batches = {r: stream.batch(5, lay.dp, lay.dp_rank(r)).indices.tolist() for r in range(8)}
    by_dp: dict[int, list[int]] = {}
    for r, idx in batches.items():
        assert by_dp.setdefault(lay.dp_rank(r), idx) == idx  # peers: the same batch
    assert sorted(by_dp) == [0, 1]
    assert sorted(by_dp[0] + by_dp[1]) == sorted(stream.batch(5, 1, 0).indices.tolist())
    assert [lay.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_rank_order_is_pp_then_replicate_then_shard_then_tp():
    lay = MeshLayout.from_plan(layout_plan(8, dp=4, tp=2, pp=1, replicate=2, shard=2))
    assert lay.coordinates(5) == {"pp": 0, "replicate": 1, "shard": 0, "tp": 1}
    assert [lay.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert lay.as_dict() == {"dp": 4, "replicate": 2, "shard": 2, "tp": 2, "pp": 1, "ep": 1}


def test_a_plan_without_a_layout_is_plain_data_parallel():
    lay = MeshLayout.from_plan(pb.Plan(world_size=3))
    assert (lay.dp, lay.replicate, lay.shard) == (3, 3, 1)
    assert [lay.dp_rank(r) for r in range(3)] == [0, 1, 2]


def test_a_layout_that_does_not_cover_the_world_is_refused():
    with pytest.raises(ValueError, match="world_size 4"):
        MeshLayout.from_plan(layout_plan(4, dp=2, tp=1, pp=1, replicate=1, shard=1))


@pytest.mark.timeout(120)
def test_the_two_ranks_of_a_tp_group_train_on_the_same_whole_batch(fake_job):
    from collections import defaultdict

    from springback.worker.train.audit import read_records

    for m in ("a", "b"):
        fake_job.spawn(m)
    fake_job.publish(["a", "b"], "tp=2", layout=pb.ParallelLayout(
        dp=1, tp=2, pp=1, ep=1, replicate=1, shard=1))
    fake_job.finish(["a", "b"])
    by_step: dict[int, dict[int, list]] = defaultdict(dict)
    for r in read_records(fake_job.audit_dir):
        by_step[r["step"]][r["rank"]] = r["samples"]
    stream = SampleStream(num_samples=256, global_batch_size=12, seed=0)
    assert sorted(by_step) == list(range(1, 41))
    for step, ranks in by_step.items():
        assert ranks[0] == ranks[1], step  # TP peers: the same batch
        assert [i for _, i in ranks[0]] == stream.batch(step, 1, 0).indices.tolist()


def test_a_checkpoint_manifest_records_the_generations_layout(tmp_path):
    from types import SimpleNamespace

    import torch

    from springback.storage import committed_checkpoints, job_checkpoint_uri
    from springback.worker.train.checkpointing import GenerationCheckpoints

    plan = layout_plan(1, dp=1, tp=1, pp=1, ep=1, replicate=1, shard=1)
    plan.job_id, plan.generation = "job-l", 1
    plan.spec.checkpoint.uri = f"file://{tmp_path}/ck"
    ctx = SimpleNamespace(state={"model": torch.nn.Linear(2, 1)}, reporter=None,
                          env=SimpleNamespace(job_id="job-l"))
    checkpoints = GenerationCheckpoints(ctx=ctx, plan=plan, rank=0)
    assert checkpoints.save(1, (0, 2), wait=True)
    checkpoints.close(wait_for_commit=True)
    (ckpt,) = committed_checkpoints(job_checkpoint_uri(plan.spec.checkpoint.uri, "job-l"))
    assert ckpt.manifest.layout == {"dp": 1, "replicate": 1, "shard": 1, "tp": 1, "pp": 1,
                                    "ep": 1}


def test_expert_groups_are_consecutive_dp_ranks_and_their_replicas_the_other_groups():
    lay = MeshLayout.from_plan(layout_plan(8, dp=4, tp=2, pp=1, ep=2, replicate=2, shard=2))
    coords = [lay.expert_coordinates(r) for r in range(8)]
    assert [c["ep"] for c in coords] == [0, 0, 1, 1, 0, 0, 1, 1]  # TP peers: the same slice
    assert [c["edp"] for c in coords] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert lay.coordinates(5) == {"pp": 0, "replicate": 1, "shard": 0, "tp": 1}  # unchanged
    assert MeshLayout.from_plan(layout_plan(4, dp=4, replicate=4, shard=1)).expert_coordinates(
        3) == {"edp": 3, "ep": 0}  # no ep: one expert group per dp rank


def test_an_ep_that_does_not_divide_the_data_parallel_size_is_refused():
    with pytest.raises(ValueError, match="ep=4 does not divide the data-parallel size 2"):
        MeshLayout.from_plan(layout_plan(2, dp=2, ep=4, replicate=1, shard=2))


@pytest.mark.timeout(90)
def test_the_expert_mesh_is_a_dp_by_ep_view_over_real_groups_and_leaves_the_mesh_as_it_was(
        tmp_path):
    """Four gloo ranks (expert_mesh_peer.py) build three layouts: with ep = 2
    the view (edp, ep) is made with the mesh, its ep group is the expert
    group of the docstring's rank order (all-gather, all-to-all) and an
    expert stack Shard(0) over it gathers whole; the generation mesh is the
    same as without ep; with ep = 1 the view is made on request."""
    from pathlib import Path

    from sbtest import run_gloo_peers

    script = str(Path(__file__).with_name("expert_mesh_peer.py"))
    results = run_gloo_peers(script, 4, str(tmp_path / "store"))
    for rank, res in enumerate(results):
        hsdp, tp, plain = res["hsdp-ep2"], res["tp2-ep2"], res["hsdp-ep1"]
        assert hsdp["dims"] == plain["dims"] == ["pp", "replicate", "shard", "tp"]
        assert hsdp["mesh"] == plain["mesh"] and tp["mesh"] == [[[[0, 1], [2, 3]]]]
        assert hsdp["view_dims"] == ["edp", "ep"]
        assert hsdp["view"] == [[0, 1], [2, 3]] and hsdp["made_with_mesh"] and hsdp["cached"]
        assert hsdp["ep_peers"] == hsdp["all_to_all"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert hsdp["coordinates"] == {"edp": rank // 2, "ep": rank % 2}
        assert tp["view"] == [[rank % 2, rank % 2 + 2]]  # the dp ranks of this tp index
        assert tp["ep_peers"] == [rank % 2, rank % 2 + 2]
        assert plain["view"] == [[0], [1], [2], [3]] and not plain["made_with_mesh"]
        assert plain["ep_peers"] == [rank]
        assert hsdp["full_experts"] == tp["full_experts"] == plain["full_experts"] == [0, 1, 2, 3]

