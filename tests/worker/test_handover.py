"""The DDP form's striped hand-over (worker/state/handover.py): the transfer
plan (which holder sends which chunk to whom), the skeleton round trip, and
real gloo ranks running the library's own `StateAgreement.agree`
(handover_peer.py): three holders and one joiner, the joiner bit-identical
and each holder sending about a third; a holder killed mid hand-over leaves
the joiner's state untouched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sbtest import result_line, run_gloo_peers, run_python_all
from springback.worker.state.handover import (
    Chunk,
    Segment,
    join,
    placeholders,
    plan_handover,
    same_layout,
    split,
)
from springback.worker.state.peerobjects import decode, encode

PEER = str(Path(__file__).with_name("handover_peer.py"))
MIB = 2**20


class TestThePlan:
    def test_a_large_tensor_is_cut_into_pieces_and_small_ones_are_packed(self):
        plan = plan_handover([10 * MIB, 100, 200, 0, 4 * MIB - 200], holders=[0], receivers=[1],
                             chunk_bytes=4 * MIB)
        assert [c.segments for c in plan.chunks] == [
            (Segment(0, 0, 4 * MIB),), (Segment(0, 4 * MIB, 8 * MIB),),
            (Segment(0, 8 * MIB, 10 * MIB),),
            (Segment(1, 0, 100), Segment(2, 0, 200)),  # packed; the empty tensor sends nothing
            (Segment(4, 0, 4 * MIB - 200),),  # would overflow the packed chunk: the next one
        ]
        assert sum(c.nbytes for c in plan.chunks) == 14 * MIB + 100

    def test_chunk_i_is_served_by_holder_i_mod_h_to_every_receiver(self):
        plan = plan_handover([8 * MIB] * 3, holders=[0, 2, 3], receivers=[1, 4], chunk_bytes=MIB)
        assert [c.holder for c in plan.chunks] == [0, 2, 3] * 8
        assert plan.sends(2) == [(c, dst) for c in plan.chunks[1::3] for dst in (1, 4)]
        assert plan.sends(1) == []
        assert [plan.sent_bytes(r) for r in (0, 2, 3)] == [16 * MIB] * 3

    def test_the_plan_is_a_pure_function_of_its_inputs(self):
        args = ([5 * MIB, 7, 3 * MIB, 11], [1, 0], [2, 3])
        assert plan_handover(*args, chunk_bytes=MIB) == plan_handover(*args, chunk_bytes=MIB)
        assert plan_handover(*args, chunk_bytes=MIB).chunks[0] == Chunk(0, (Segment(0, 0, MIB),), 1)

    @pytest.mark.parametrize(("holders", "receivers", "chunk", "field"), [
        ([], [1], MIB, "holders"), ([0], [1], 0, "chunk_bytes"), ([0, 1], [1], MIB, "receivers")])
    def test_bad_input_names_the_field(self, holders, receivers, chunk, field):
        with pytest.raises(ValueError, match=field):
            plan_handover([MIB], holders, receivers, chunk_bytes=chunk)


def test_the_skeleton_carries_no_tensor_bytes_and_joins_back_bit_identical():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(300, 7))], lr=0.1)
    opt.param_groups[0]["params"][0].grad = torch.ones(300, 7)
    opt.step()
    state = {"optimizer": opt.state_dict(), "extra": [torch.arange(5), (torch.ones(()), "x")]}
    skeleton, tensors = split(state)
    wire = encode(skeleton)
    assert wire.numel() < 4000  # shapes and dtypes only: 2 x 2,100 floats stay out
    back = decode(wire.numpy().tobytes(), peer=0)
    assert same_layout(tensors, back) and not same_layout(tensors[1:], back)
    joined = join(back, [t.clone() for t in tensors])
    assert joined["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert all(torch.equal(a, b) for a, b in zip(split(joined)[1], tensors))
    assert [m.shape for m in placeholders(back)] == [t.shape for t in tensors]


@pytest.mark.timeout(120)
def test_three_holders_hand_a_joiner_bit_identical_state_each_serving_a_third(tmp_path):
    results = run_gloo_peers(PEER, 4, str(tmp_path / "store"))
    trained = results[0]["before"]
    assert all(r["before"] == trained for r in results[:3])
    joiner = results[3]
    assert joiner["before"] != trained and (joiner["digest"], joiner["step"]) == (trained, 3)
    assert all(r["digest"] == trained and "error" not in r for r in results)
    sent = [r["sent"] for r in results[:3]]
    total = sum(sent)
    assert total > 18 * MIB and joiner["sent"] == 0
    assert all(abs(s - total / 3) < 0.1 * total for s in sent), sent


@pytest.mark.timeout(120)
def test_a_holder_killed_mid_hand_over_leaves_the_joiner_with_what_it_held(tmp_path):
    codes, outs = run_python_all([[PEER, str(r), "4", str(tmp_path / "store"), "1"]
                                  for r in range(4)],
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout_s=100)
    assert codes == [0, 9, 0, 0], outs
    joiner = result_line(outs[3])
    assert "error" in joiner, joiner  # holder 1 lost after its first chunk
    assert (joiner["digest"], joiner["step"]) == (joiner["before"], -1), joiner
    for out in (outs[0], outs[2]):  # the other holders keep their own state
        r = result_line(out)
        assert r["digest"] == r["before"] and r["step"] == 3, r
