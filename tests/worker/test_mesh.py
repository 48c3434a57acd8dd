"""The generation's layout as coordinates: which ranks share batches."""

from __future__ import annotations

import pytest

from springback.v1 import types_pb2 as pb
from springback.worker.mesh import MeshLayout
from springback.worker.sampler import SampleStream

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
