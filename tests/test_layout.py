"""The layout module (client/layout.py): defaults, which worlds fit, the dp
split, rank <-> coordinate <-> piece, the stages' layers. Pure: no torch."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from springback.client import layout as L
from springback.client.errors import InvalidArgument
from springback.v1 import types_pb2 as pb

pytestmark = pytest.mark.timeout(60)


def test_the_module_imports_no_torch():
    import subprocess

    code = ("import sys; import springback.client.layout, springback.client.spec; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"


class TestDefaults:
    def test_degrees_default_to_1_and_min_pp_to_pp(self):
        lay = pb.Layout(pp=4)
        L.validate(lay)
        assert (lay.tp, lay.pp, lay.ep, lay.shard, lay.min_pp) == (1, 4, 1, 0, 4)

    def test_an_explicit_min_pp_is_kept(self):
        lay = pb.Layout(pp=4, min_pp=2)
        L.validate(lay)
        assert lay.min_pp == 2

    def test_min_pp_above_pp_is_refused_naming_the_field(self):
        with pytest.raises(InvalidArgument) as e:
            L.validate(pb.Layout(pp=2, min_pp=3))
        assert e.value.field == "layout.min_pp"
        assert e.value.problem == "3 is above layout.pp 2 (the most stages)"

    def test_fewer_stages_runs_from_pp_minus_1_down_to_min_pp(self):
        assert list(L.fewer_stages(pb.Layout(pp=4, min_pp=2))) == [3, 2]
        assert list(L.fewer_stages(pb.Layout(pp=4, min_pp=4))) == []
        assert list(L.fewer_stages(pb.Layout(pp=4))) == []  # 0: fixed at pp


class TestWhichWorldsFit:
    @pytest.mark.parametrize(("world", "layout", "field"), [
        (0, pb.Layout(), "layout.tp * layout.pp = 1"),
        (6, pb.Layout(tp=2, pp=2), "layout.tp * layout.pp = 4 does not divide the world of 6"),
        (4, pb.Layout(tp=2, ep=4), "layout.ep = 4 does not divide the data-parallel size 2"),
        (6, pb.Layout(shard=4), "layout.shard = 4 does not divide the data-parallel size 6"),
    ])
    def test_a_world_that_does_not_fit_names_the_field(self, world, layout, field):
        assert L.fault(world, layout).startswith(field)

    @pytest.mark.parametrize(("world", "layout"), [
        (1, pb.Layout()), (8, pb.Layout(tp=2, pp=2)), (8, pb.Layout(tp=2, ep=2, shard=4)),
        (12, pb.Layout(pp=3, shard=2)),
    ])
    def test_a_world_that_fits_has_no_fault(self, world, layout):
        assert L.fault(world, layout) == ""


class TestTheDpSplit:
    def test_shard_inside_a_node_and_replicate_across_nodes(self):
        assert L.resolve(pb.Layout(), [2, 2]) == L.MeshLayout(replicate=2, shard=2)

    def test_tp_takes_its_ranks_from_the_node_first(self):
        assert L.resolve(pb.Layout(tp=2), [4, 4]) == L.MeshLayout(replicate=2, shard=2, tp=2)

    def test_unequal_nodes_or_tp_not_dividing_a_node_keep_a_full_replica_per_dp_rank(self):
        assert L.resolve(pb.Layout(), [2, 1]) == L.MeshLayout(replicate=3, shard=1)
        assert L.resolve(pb.Layout(tp=2), [3, 3]) == L.MeshLayout(replicate=3, shard=1, tp=2)

    def test_the_specs_shard_wins(self):
        assert L.resolve(pb.Layout(shard=4), [2, 2]) == L.MeshLayout(replicate=1, shard=4)

    def test_the_message_records_dp_and_every_degree(self):
        lay = L.resolve(pb.Layout(tp=2, pp=2, ep=2), [4, 4, 4, 4])
        assert lay.message() == pb.ParallelLayout(dp=4, tp=2, pp=2, ep=2, replicate=2, shard=2)
        assert L.MeshLayout.of(lay.message()) == lay
        assert L.MeshLayout.of(pb.ParallelLayout()) == L.MeshLayout()

    @settings(max_examples=200, deadline=None)
    @given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 8), st.integers(1, 6),
           st.sampled_from([0, 1, 2, 4]), st.sampled_from([1, 2]))
    def test_a_world_that_fits_resolves_to_a_layout_that_covers_it(self, tp, pp, per_node,
                                                                    nodes, shard, ep):
        spec = pb.Layout(tp=tp, pp=pp, shard=shard, ep=ep)
        world = per_node * nodes
        if L.fault(world, spec):
            return
        lay = L.resolve(spec, [per_node] * nodes)
        assert lay.world_size == world and lay.dp % lay.ep == 0
        plan = pb.Plan(world_size=world, layout=lay.message())
        assert L.MeshLayout.from_plan(plan) == lay


class TestRanks:
    def test_rank_order_is_pp_then_replicate_then_shard_then_tp(self):
        lay = L.MeshLayout(pp=2, replicate=2, shard=2, tp=2)
        assert lay.coordinates(13) == {"pp": 1, "replicate": 1, "shard": 0, "tp": 1}
        for rank in range(lay.world_size):
            c = lay.coordinates(rank)
            assert rank == ((c["pp"] * 2 + c["replicate"]) * 2 + c["shard"]) * 2 + c["tp"]
        assert [lay.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]

    def test_a_rank_outside_the_world_is_refused(self):
        with pytest.raises(ValueError, match="rank 4 is outside world size 4"):
            L.MeshLayout(shard=4).coordinates(4)

    def test_expert_groups_are_consecutive_dp_ranks(self):
        lay = L.MeshLayout(replicate=2, shard=2, ep=2)
        assert [lay.expert_coordinates(r) for r in range(4)] == [
            {"edp": 0, "ep": 0}, {"edp": 0, "ep": 1}, {"edp": 1, "ep": 0}, {"edp": 1, "ep": 1}]

    def test_pieces_are_the_stage_and_shard_coordinates_of_a_nodes_ranks(self):
        lay = L.MeshLayout(pp=2, replicate=1, shard=2, tp=2)
        for first in range(0, 8, 2):
            c = [lay.coordinates(r) for r in range(first, first + 2)]
            assert lay.pieces(first, 2) == {(x["pp"], x["shard"]) for x in c}
        assert lay.pieces(0, 8) == {(0, 0), (0, 1), (1, 0), (1, 1)}
        assert lay.pieces(4, 2) == {(1, 0)}

    def test_which_layouts_hold_pieces(self):
        assert not L.MeshLayout(replicate=4).holds_pieces
        assert all(L.MeshLayout(**{d: 2}).holds_pieces for d in ("pp", "shard", "tp", "ep"))


class TestFromPlan:
    def test_a_plan_without_a_layout_is_plain_data_parallel(self):
        assert L.MeshLayout.from_plan(pb.Plan(world_size=3)) == L.MeshLayout(replicate=3)

    def test_a_layout_that_does_not_cover_the_world_is_refused_naming_the_field(self):
        plan = pb.Plan(world_size=4, layout=pb.ParallelLayout(dp=2, tp=1, pp=1, replicate=1,
                                                              shard=1))
        with pytest.raises(InvalidArgument) as e:
            L.MeshLayout.from_plan(plan)
        assert e.value.field == "plan.layout" and "does not cover world_size 4" in e.value.problem

    def test_an_ep_that_does_not_divide_dp_is_refused_naming_the_field(self):
        plan = pb.Plan(world_size=2, layout=pb.ParallelLayout(dp=2, ep=4, replicate=1, shard=2))
        with pytest.raises(InvalidArgument) as e:
            L.MeshLayout.from_plan(plan)
        assert (e.value.field, e.value.problem) == (
            "plan.layout", "ep=4 does not divide the data-parallel size 2")


class TestStageLayers:
    def test_the_first_stages_take_one_layer_more(self):
        assert [list(L.stage_layers(7, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]

    def test_fewer_layers_than_stages_is_refused(self):
        with pytest.raises(ValueError, match="num_layers=2 is fewer than the pp=3 stages"):
            L.stage_layers(2, 3, 0)
