"""A second fault inside a recovery loses nothing (recovery_peer.py): a rank
killed in the state agreement's all-gather, in the reshard exchange, in a
peer-copy roll back, in a checkpoint restore and in a DDP hand-over (the
joiner itself, then a holder); the next generation's state is, bit for bit,
the state of the step it resumed from. Tensor-parallel state under FSDP2
resharded through joins, a layout change and a loss; a rank killed in a
tensor-parallel, a pipeline, a pipeline re-partition, an expert-parallel
and an FSDP x TP x PP reshard; an FSDP x TP x PP commit restored at pp 1
and at tp 1. And the agreement's decisions: a plain parameter, a fill that
must carry non-tensor optimizer state, a lost state said as lost.
Real multi-process gloo, the library's own `StateAgreement`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from sbtest import run_python_all

SCRIPT = Path(__file__).with_name("recovery_peer.py")


def run(tmp_path: Path, scenario: str, world: int, victims: tuple[int, ...] = ()) -> list[dict]:
    """Runs `scenario` on `world` ranks; the victims' exit status is theirs
    (killed), every other rank must end cleanly. Returns each survivor's
    result (None for a victim)."""
    codes, outs = run_python_all([[str(SCRIPT), str(r), str(tmp_path), scenario]
                                  for r in range(world)],
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout_s=150)
    out = "\n".join(f"--- rank {r}\n" + outs[r][-3000:] for r in range(world))
    assert [c for r, c in enumerate(codes) if r not in victims] == \
        [0] * (world - len(victims)), out
    assert all(codes[v] == 9 for v in victims), (codes, out)
    return [None if r in victims else json.loads((tmp_path / f"result-{r}.json").read_text())
            for r in range(world)]


def generation(result: dict, n: int) -> dict:
    return next(g for g in result["generations"] if g["generation"] == n)


def assert_step_2_restored(results: list[dict], *, in_both: int, recorded: str) -> None:
    """Every rank's restores (generations 2 and 3 for the first `in_both`
    ranks, 3 for the others) read step 2 from the checkpoint, and the state
    they hold (`recorded`: ``digest`` or ``keys``) is step 2's as trained."""
    for rank, res in enumerate(results):
        for gen in (2, 3) if rank < in_both else (3,):
            g = generation(res, gen)
            assert (g.get("error"), g["step"], g["kind"]) == \
                (None, 2, "RESTORE_KIND_CHECKPOINT"), (rank, res)
            assert g[recorded] == res["trained"]["2"], (rank, gen)


def assert_the_survivors_hold_step_2(results: list[dict], survivors: tuple[int, ...],
                                     field: str = "digest") -> None:
    """Generation 2 failed on the survivors (a victim died in its exchange)
    and generation 3 holds step 2's state, from peers, bit for bit (`field`:
    the whole state's digest, or each key's)."""
    for rank in survivors:
        res = results[rank]
        assert generation(res, 2)["error"] == "RuntimeError", res
        last = generation(res, 3)
        assert (last.get("error"), last["step"], last["kind"]) == \
            (None, 2, "RESTORE_KIND_PEERS"), res
        assert last[field] == res["trained"]["2"], (rank, field)


@pytest.mark.timeout(200)
def test_killed_in_the_exchange_then_in_the_all_gather_the_last_two_hold_the_trained_state(
        tmp_path):
    results = run(tmp_path, "second_fault", 4, victims=(1, 2))
    for r in (0, 3):
        res = results[r]
        assert generation(res, 2)["error"] == "RuntimeError"  # rank 1 died in the exchange
        assert generation(res, 3)["error"] == "RuntimeError"  # rank 2 died in the all-gather
        last = generation(res, 4)
        assert (last["step"], last["kind"]) == (2, "RESTORE_KIND_PEERS"), res
        assert last["digest"] == res["trained"]["2"], "generation 4 does not hold step 2's state"


@pytest.mark.timeout(200)
def test_a_joiner_killed_mid_hand_over_then_a_holder_the_survivors_hold_the_trained_state(
        tmp_path):
    results = run(tmp_path, "handover", 4, victims=(1, 3))
    expected = results[0]["trained"]["2"]
    for r in (0, 2):
        res = results[r]
        # joiner 3 died receiving: the broadcast may still complete for the
        # others (gloo's tree sends on), but no rank may hold anything else
        assert [g for g in res["generations"] if "error" not in g
                and g["digest"] != expected] == [], res
        assert generation(res, 3)["error"] == "RuntimeError", res  # holder 1 died sending
        last = generation(res, 4)
        assert last["step"] == 2 and last["digest"] == expected, res


@pytest.mark.timeout(200)
def test_a_rank_killed_in_a_checkpoint_restore_the_others_restore_it_next_time(tmp_path):
    results = run(tmp_path, "restore", 3, victims=(2,))
    for r in (0, 1):
        res = results[r]
        assert generation(res, 2)["error"] == "RuntimeError", res
        last = generation(res, 3)
        assert (last["step"], last["kind"]) == (2, "RESTORE_KIND_CHECKPOINT"), res
        assert last["digest"] == res["trained"]["2"]


@pytest.mark.timeout(200)
def test_a_rank_killed_in_a_peer_copy_roll_back_the_others_roll_back_next_time(tmp_path):
    results = run(tmp_path, "rollback", 4, victims=(1, 3))
    for r in (0, 2):
        res = results[r]
        assert generation(res, 2)["error"] == "RuntimeError", res
        last = generation(res, 3)
        assert (last["step"], last["kind"]) == (2, "RESTORE_KIND_PEER_COPY"), res
        assert last["digest"] == res["trained"]["2"]


@pytest.mark.timeout(150)
def test_tensor_parallel_state_under_fsdp_is_resharded_in_memory_through_joins_a_layout_change_and_a_loss(
        tmp_path):
    results = run(tmp_path, "tensor_parallel", 4)
    trained = results[0]["trained"] | results[2]["trained"]  # steps 1-2 on ranks 0-1 only
    for rank, res in enumerate(results):
        for gen, step in ((2, 2), (3, 3), (4, 4)) if rank >= 2 else ((2, 2), (3, 3)):
            g = generation(res, gen)
            assert (g.get("error"), g["step"], g["kind"]) == \
                (None, step, "RESTORE_KIND_PEERS"), (rank, res)
            # the joiners held nothing: what they hold came over the wire
            assert g["digest"] == trained[str(step)], (rank, gen)


@pytest.mark.timeout(150)
def test_a_rank_killed_in_a_tensor_parallel_reshard_leaves_its_node_peer_the_trained_state(
        tmp_path):
    # rank 3 dies in the exchange
    assert_the_survivors_hold_step_2(run(tmp_path, "tp_second_fault", 4, victims=(3,)), (0, 1))


@pytest.mark.timeout(150)
def test_a_rank_killed_in_a_pipeline_reshard_leaves_a_holder_of_each_stage_the_trained_state(
        tmp_path):
    # rank 0 dies in the exchange; both stages compared, every tensor
    assert_the_survivors_hold_step_2(run(tmp_path, "pp_second_fault", 4, victims=(0,)), (1, 2),
                                     "keys")


@pytest.mark.timeout(150)
def test_a_rank_killed_as_a_pipeline_re_partitions_leaves_a_holder_of_each_stage_the_trained_state(
        tmp_path):
    # pp 2 -> 1: rank 1, a holder of stage 0, dies in the exchange; all tensors of both stages
    assert_the_survivors_hold_step_2(
        run(tmp_path, "repartition_second_fault", 4, victims=(1,)), (0, 2, 3), "keys")


@pytest.mark.timeout(150)
def test_a_rank_killed_in_an_expert_parallel_reshard_leaves_a_holder_of_each_expert_the_trained_state(
        tmp_path):
    # rank 0, a holder of rank 1's new experts, dies in the exchange
    assert_the_survivors_hold_step_2(run(tmp_path, "ep_second_fault", 4, victims=(0,)), (1, 2))


@pytest.mark.timeout(200)
def test_a_node_killed_in_an_fsdp_tp_pp_reshard_leaves_a_holder_of_each_stage_the_trained_state(
        tmp_path):
    # node 0 (ranks 0-1), a holder of node 2's new rows, dies in the exchange
    assert_the_survivors_hold_step_2(run(tmp_path, "pp3d_second_fault", 8, victims=(0, 1)),
                                     (2, 3, 4, 5), "keys")


@pytest.mark.timeout(120)
def test_a_lost_nodes_tensor_parallel_slices_come_back_from_their_peer_copies(tmp_path):
    for res in run(tmp_path, "tp_copies", 4, victims=(2, 3))[:2]:
        last = generation(res, 2)
        assert (last.get("error"), last["step"], last["kind"]) == \
            (None, 2, "RESTORE_KIND_PEER_COPY"), res
        assert last["digest"] == res["trained"]["2"]


@pytest.mark.timeout(120)
def test_a_tensor_parallel_commit_restores_bit_identical_at_other_tp_sizes(tmp_path):
    assert_step_2_restored(run(tmp_path, "tp_restore", 4), in_both=2, recorded="digest")


@pytest.mark.timeout(120)
def test_a_plain_parameter_is_never_handed_to_a_joiner_as_if_replicated(tmp_path):
    for res in run(tmp_path, "plain", 2):
        refused = generation(res, 2)
        assert refused["error"] == "StateUnrecoverable", res
        assert "parameter 'own' is a plain tensor" in refused["message"], refused


@pytest.mark.timeout(120)
def test_a_step_applied_on_one_survivor_and_broken_in_its_wait_on_the_other_is_held_whole(
        tmp_path):
    """A gloo all-reduce can complete on one rank and fail on another: rank
    0 applied step 3, rank 1 broke in the wait before its optimizer step.
    The next agreement applies rank 1's pending update, so the two hold step
    3 whole (without it: no holder of rank 1's rows of step 3, no commit, the
    state lost)."""
    results = run(tmp_path, "guard_split", 4, victims=(2, 3))
    twins = {0: json.loads((tmp_path / "local-2.json").read_text()),
             1: json.loads((tmp_path / "local-3.json").read_text())}
    for r in (0, 1):
        last = generation(results[r], 2)
        assert (last.get("error"), last["step"], last["kind"], last["state_lost"]) == \
            (None, 3, "RESTORE_KIND_PEERS", ""), results[r]
        assert results[r]["local_after"] == twins[r], f"rank {r} does not hold step 3's pieces"
    assert results[1]["local"] != twins[1], "rank 1 held step 3 before the agreement"
    assert results[0]["local"] == twins[0]


@pytest.mark.timeout(120)
def test_non_tensor_optimizer_state_is_carried_and_a_lost_state_is_said_and_built_afresh(
        tmp_path):
    for res in run(tmp_path, "fill", 2):
        resharded = generation(res, 2)
        assert resharded["kind"] == "RESTORE_KIND_PEERS" and resharded["step"] == 2
        # every parameter's non-tensor entry came along (DCP's state-dict
        # calls may take an extra zero-gradient step: compare, not count)
        assert res["counts"] == res["counts_trained"] and -1 not in res["counts"], res
        assert resharded["digest"] == res["trained"]["2"]
        lost = generation(res, 4)
        assert (lost["step"], lost["kind"]) == (0, "RESTORE_KIND_NONE"), res
        assert "no live holder" in lost["state_lost"] and "nothing was committed" in \
            lost["state_lost"], lost
        assert lost["optimizer_entries"] == 0  # nothing a failed fill made is kept
        assert lost["digest"] == res["fresh"]  # the build's own model, as on a fresh start
        assert res["applied"] == [], res  # the survivor's state= entry starts afresh too


@pytest.mark.timeout(200)
def test_an_fsdp_tp_pp_commit_restores_bit_identical_without_the_pipeline_and_without_tp(
        tmp_path):
    # every tensor of every stage, key by key
    assert_step_2_restored(run(tmp_path, "pp3d_restore", 8), in_both=4, recorded="keys")
