"""The planner as a pure function: ranks, layout, spares, restore choice."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from springback.service.policy.planner import Progress, make_plan
from springback.v1 import types_pb2 as pb

pytestmark = pytest.mark.timeout(60)


def job(min_workers=1, max_workers=8, tp=1, pp=1, ep=1, state=pb.JOB_STATE_RUNNING) -> pb.Job:
    spec = pb.JobSpec(name="j", min_workers=min_workers, max_workers=max_workers,
                      layout=pb.Layout(tp=tp, pp=pp, ep=ep),
                      data=pb.DataSpec(num_samples=100, global_batch_size=10), max_steps=10)
    return pb.Job(id="j", spec=spec, status=pb.JobStatus(state=state))


def members(*ids: str, ranks: int = 1) -> list[pb.Member]:
    return [pb.Member(id=i, host=f"h{i}", rendezvous_port=1000 + n, num_local_ranks=ranks, join_order=n)
            for n, i in enumerate(ids)]


def plan(j, ms, previous=None, **kw) -> pb.Plan:
    kw.setdefault("progress", Progress(step=7, cursor=pb.DataCursor(offset=70)))
    kw.setdefault("newest_checkpoint", None)
    return make_plan(j, ms, previous, **kw)


class TestRanks:
    def test_survivors_keep_their_ranks_and_joiners_fill_the_holes(self):
        first = plan(job(), members("a", "b", "c", "d"))
        second = plan(job(), members("a", "c", "d", "e"), first)
        assert [(m.member_id, m.node_rank) for m in second.members] == [
            ("a", 0), ("e", 1), ("c", 2), ("d", 3)]
        assert [m.first_rank for m in second.members] == [0, 1, 2, 3]

    def test_a_shrinking_world_moves_only_the_out_of_range_survivors(self):
        first = plan(job(), members("a", "b", "c", "d"))
        second = plan(job(), members("a", "c", "d"), first)
        assert [(m.member_id, m.node_rank) for m in second.members] == [("a", 0), ("d", 1), ("c", 2)]

    def test_multi_rank_nodes_get_contiguous_global_ranks(self):
        p = plan(job(), members("a", "b", ranks=4))
        assert [(m.first_rank, m.num_local_ranks) for m in p.members] == [(0, 4), (4, 4)]
        assert p.world_size == 8 and (p.master_addr, p.master_port) == ("ha", 1000)


class TestPipelineStages:
    def test_a_lost_node_leaves_every_stage_one_of_its_survivors(self):
        # pp 2 over 4 nodes: a, b hold stage 0, c, d stage 1; d is lost
        first = plan(job(pp=2), members("a", "b", "c", "d"))
        second = plan(job(pp=2), members("a", "b", "c"), first)
        assert [(m.member_id, m.node_rank) for m in second.members] == [("a", 0), ("c", 1)]
        assert list(second.spares) == ["b"]  # not c: stage 1 would have no holder

    def test_a_join_grows_each_stage_with_its_survivors_kept_on_it(self):
        first = plan(job(pp=2), members("a", "b", "c", "d"))
        second = plan(job(pp=2), members("a", "b", "c"), first)
        third = plan(job(pp=2), members("a", "b", "c", "e"), second)
        stage = {m.member_id: m.node_rank // 2 for m in third.members}
        assert stage["a"] == 0 and stage["c"] == 1 and third.world_size == 4
        assert [m.first_rank for m in third.members] == [0, 1, 2, 3]

    def test_survivors_keep_their_node_rank_inside_their_stage(self):
        first = plan(job(pp=2), members("a", "b", "c", "d", "e", "f"))
        second = plan(job(pp=2), members("a", "b", "c", "d", "e", "f", "g", "h"), first)
        assert [(m.member_id, m.node_rank) for m in second.members][:3] == [
            ("a", 0), ("b", 1), ("c", 2)]  # stage 0 of 6 nodes: 0-2, of 8: 0-3
        assert {m.member_id: m.node_rank // 4 for m in second.members}["d"] == 1


class TestShardsOverSingleRankNodes:
    def test_a_lost_node_leaves_one_holder_of_each_shard(self):
        # replicate 2 x shard 2 on four one-rank nodes: a, c hold shard 0; b, d shard 1
        j = sharded_job(shard=2)
        first = plan(j, members("a", "b", "c", "d"))
        assert [(m.member_id, m.node_rank % 2) for m in first.members] == [
            ("a", 0), ("b", 1), ("c", 0), ("d", 1)]
        second = plan(j, members("a", "c", "d"), first)  # b lost: shard 2 x replicate 1
        assert [(m.member_id, m.node_rank) for m in second.members] == [("a", 0), ("d", 1)]
        assert list(second.spares) == ["c"]  # not d: shard 1 would have no holder

    def test_nodes_that_hold_every_shard_keep_the_prefix_rule(self):
        j = sharded_job(shard=2)
        first = plan(j, members("a", "b", "c", ranks=2))  # each node: both shards
        second = plan(j, members("a", "c", ranks=2), first)
        assert [(m.member_id, m.node_rank) for m in second.members] == [("a", 0), ("c", 1)]


class TestRepartition:
    def test_a_pipeline_that_may_shrink_runs_fewer_stages_and_grows_back(self):
        j = job(pp=4)
        j.spec.layout.min_pp = 2
        first = plan(j, members("a", "b", "c", "d"))
        assert (first.layout.pp, first.world_size) == (4, 4)
        second = plan(j, members("a", "b", "d"), first)  # c's stage lost, no spare
        assert second.action == pb.PLAN_ACTION_RUN and (second.layout.pp, second.layout.dp) == (3, 1)
        assert second.spec.layout.pp == 4  # the job's spec is unchanged
        third = plan(j, members("a", "b", "d", "e"), second)
        assert (third.layout.pp, third.world_size) == (4, 4)

    def test_a_fixed_stage_count_waits_naming_the_layout(self):
        first = plan(job(pp=4), members("a", "b", "c", "d"))
        second = plan(job(pp=4), members("a", "b", "d"), first)
        assert second.action == pb.PLAN_ACTION_WAIT and "layout.tp * layout.pp" in second.reason

    def test_it_never_goes_below_min_pp(self):
        j = job(pp=4)
        j.spec.layout.min_pp = 3
        p = plan(j, members("a", "b"))
        assert p.action == pb.PLAN_ACTION_WAIT


@settings(max_examples=200, deadline=None)
@given(
    alive=st.lists(st.sampled_from("abcdefghij"), unique=True, max_size=10),
    survivors=st.lists(st.sampled_from("abcdefghij"), unique=True, max_size=10),
    pp=st.sampled_from([2, 3]),
)
def test_a_pipeline_plan_keeps_a_survivor_on_every_stage_that_has_one(alive, survivors, pp):
    j = job(pp=pp, max_workers=10)
    previous = plan(j, members(*survivors)) if survivors else None
    p = plan(j, members(*alive), previous)
    if p.action != pb.PLAN_ACTION_RUN:
        return
    planned = [m.member_id for m in p.members]
    assert sorted(m.node_rank for m in p.members) == list(range(len(planned)))
    assert set(planned) | set(p.spares) == set(alive) and len(planned) % pp == 0
    if previous is None or previous.action != pb.PLAN_ACTION_RUN:
        return
    per_old, per_new = len(previous.members) // pp, len(planned) // pp
    old = {m.member_id: m.node_rank // per_old for m in previous.members}
    new = {m.member_id: m.node_rank // per_new for m in p.members}
    for stage in range(pp):
        if any(old.get(a) == stage for a in alive):  # a live member held it
            assert any(old.get(m) == stage and new[m] == stage for m in planned), stage


class TestLayoutAndLimits:
    def test_tp_times_pp_must_divide_the_world_and_the_rest_are_spares(self):
        p = plan(job(tp=2, pp=2), members("a", "b", "c", "d", "e", "f"))
        assert p.world_size == 4 and list(p.spares) == ["e", "f"]
        assert (p.layout.dp, p.layout.tp, p.layout.pp) == (1, 2, 2)

    def test_ep_must_divide_dp(self):
        p = plan(job(ep=2), members("a", "b", "c"))
        assert p.world_size == 2 and p.layout.dp == 2 and list(p.spares) == ["c"]

    def test_max_workers_caps_the_world(self):
        p = plan(job(max_workers=2), members("a", "b", "c"))
        assert p.world_size == 2 and list(p.spares) == ["c"]

    def test_below_min_workers_the_plan_waits(self):
        p = plan(job(min_workers=3), members("a", "b"))
        assert p.action == pb.PLAN_ACTION_WAIT and p.world_size == 0

    def test_draining_members_are_not_planned(self):
        ms = members("a", "b")
        ms[1].draining = True
        assert [m.member_id for m in plan(job(), ms).members] == ["a"]

    def test_a_paused_job_waits_and_keeps_its_state_holders(self):
        first = plan(job(), members("a", "b"))
        paused = plan(job(state=pb.JOB_STATE_PAUSED), members("a", "b"), first,
                      holders={"a", "b"})
        assert paused.action == pb.PLAN_ACTION_WAIT and [m.member_id for m in paused.members] == ["a", "b"]
        resumed = plan(job(), members("a", "b"), paused, holders={"a", "b"})
        assert resumed.restore.kind == pb.RESTORE_KIND_PEERS

    def test_a_terminal_job_stops(self):
        assert plan(job(state=pb.JOB_STATE_CANCELLED), members("a")).action == pb.PLAN_ACTION_STOP


class TestRestoreChoice:
    ref = pb.CheckpointRef(step=5, uri="file:///c/5", cursor=pb.DataCursor(offset=50))

    def test_fresh_jobs_start_from_scratch(self):
        p = plan(job(), members("a"))
        assert p.restore.kind == pb.RESTORE_KIND_NONE and p.step == 0

    def test_survivors_serve_state_from_the_lowest_new_rank(self):
        first = plan(job(), members("a", "b", "c"))
        p = plan(job(), members("b", "c", "d"), first, holders={"a", "c"},
                 newest_checkpoint=self.ref)
        assert p.restore.kind == pb.RESTORE_KIND_PEERS
        assert p.restore.source_rank == 2  # c kept node rank 2; b holds no state, a is gone
        assert (p.step, p.cursor.offset) == (7, 70)
        # the ranks fall back to the newest commit if c turns out to hold nothing
        assert p.restore.checkpoint.uri == self.ref.uri

    def test_members_of_the_previous_plan_are_not_holders_until_proven(self):
        # the previous generation never started: being planned proves nothing
        first = plan(job(), members("a", "b"))
        p = plan(job(), members("a", "b"), first, newest_checkpoint=self.ref)
        assert p.restore.kind == pb.RESTORE_KIND_CHECKPOINT and p.step == 5

    def test_without_survivors_the_newest_checkpoint_is_restored(self):
        first = plan(job(), members("a"))
        p = plan(job(), members("z"), first, newest_checkpoint=self.ref)
        assert p.restore.kind == pb.RESTORE_KIND_CHECKPOINT
        assert (p.step, p.cursor.offset, p.restore.checkpoint.uri) == (5, 50, "file:///c/5")

    def test_an_operator_chosen_checkpoint_wins_over_peers(self):
        first = plan(job(), members("a"))
        p = plan(job(), members("a"), first, requested_checkpoint=self.ref)
        assert p.restore.kind == pb.RESTORE_KIND_CHECKPOINT and p.step == 5


@settings(max_examples=200, deadline=None)
@given(
    alive=st.lists(st.sampled_from("abcdefghij"), unique=True, max_size=10),
    survivors=st.lists(st.sampled_from("abcdefghij"), unique=True, max_size=10),
    tp=st.sampled_from([1, 2, 4]), min_workers=st.integers(1, 4), max_workers=st.integers(4, 10),
)
def test_every_plan_is_consistent(alive, survivors, tp, min_workers, max_workers):
    j = job(min_workers=min_workers, max_workers=max_workers, tp=tp)
    previous = plan(j, members(*survivors)) if survivors else None
    p = plan(j, members(*alive), previous)
    planned = [m.member_id for m in p.members]
    assert len(set(planned) | set(p.spares)) == len(planned) + len(p.spares)
    if p.action == pb.PLAN_ACTION_RUN:
        assert sorted(m.node_rank for m in p.members) == list(range(len(planned)))
        assert p.world_size % tp == 0 and min_workers <= len(planned) <= max_workers
        assert set(planned) | set(p.spares) == set(alive)
        old = {m.member_id: m.node_rank for m in previous.members} if previous else {}
        for m in p.members:  # a survivor keeps its rank whenever it is still in range
            if m.member_id in old and old[m.member_id] < len(planned):
                assert m.node_rank == old[m.member_id]


def sharded_job(shard: int = 0, tp: int = 1, **kw) -> pb.Job:
    j = job(tp=tp, **kw)
    j.spec.layout.shard = shard
    return j


class TestMeshLayout:
    def test_shard_inside_a_node_and_replicate_across_nodes(self):
        p = plan(sharded_job(), members("a", "b", ranks=2))
        assert (p.layout.dp, p.layout.replicate, p.layout.shard) == (4, 2, 2)

    def test_tp_takes_its_ranks_from_the_node_first(self):
        p = plan(sharded_job(tp=2), members("a", "b", ranks=4))
        assert (p.layout.dp, p.layout.tp, p.layout.replicate, p.layout.shard) == (4, 2, 2, 2)

    def test_unequal_nodes_keep_a_full_replica_on_every_dp_rank(self):
        ms = members("a", "b", ranks=2)
        ms[1].num_local_ranks = 1
        p = plan(sharded_job(), ms)
        assert (p.layout.replicate, p.layout.shard) == (3, 1)

    def test_the_specs_shard_degree_wins_and_limits_the_active_set(self):
        p = plan(sharded_job(shard=4), members("a", "b", "c", ranks=2))
        assert p.world_size == 4 and list(p.spares) == ["c"]
        assert (p.layout.replicate, p.layout.shard) == (1, 4)

    def test_a_layout_the_live_members_cannot_satisfy_waits_naming_the_field(self):
        p = plan(sharded_job(shard=4), members("a", ranks=2), reason="member a joined")
        assert p.action == pb.PLAN_ACTION_WAIT
        assert "layout.shard = 4" in p.reason and "data-parallel size 2" in p.reason

    def test_too_few_members_waits_without_blaming_the_layout(self):
        p = plan(sharded_job(shard=4, min_workers=2), members("a", ranks=2), reason="r")
        assert p.action == pb.PLAN_ACTION_WAIT and p.reason == "r"

    def test_tp_that_no_world_satisfies_names_tp(self):
        p = plan(sharded_job(tp=4, min_workers=1, max_workers=1), members("a", ranks=2))
        assert p.action == pb.PLAN_ACTION_WAIT and "layout.tp" in p.reason
