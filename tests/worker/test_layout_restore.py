"""A checkpoint restores across tensor-parallel layout changes, bit-identical:
four real gloo ranks, the library's own checkpoint writer and restore hook."""

from __future__ import annotations

import os

import pytest

from sbtest import run_gloo_peers

PEER = os.path.join(os.path.dirname(__file__), "layout_restore_peer.py")
PP_PEER = os.path.join(os.path.dirname(__file__), "pp_restore_peer.py")


@pytest.mark.timeout(150)
def test_saved_at_tp2_x_shard2_restores_at_shard4_and_at_replicate2_x_tp2_bit_identical(tmp_path):
    results = run_gloo_peers(PEER, 4, str(tmp_path / "store"), timeout_s=120)
    saved = results[0]["digests"]["tp2-shard2"]
    for r in results:
        assert r["digests"] == {"tp2-shard2": saved, "shard4": saved, "replicate2-tp2": saved}, r


@pytest.mark.timeout(150)
def test_a_pipeline_checkpoint_saved_at_pp2_x_dp2_restores_at_pp1_x_dp4_bit_identical(tmp_path):
    results = run_gloo_peers(PP_PEER, 4, str(tmp_path / "store"), timeout_s=120)
    saved = results[0]["digests"]["pp2-dp2"]
    assert any(key.startswith("optim/layers.3.") for key in saved)  # both stages, optimizer too
    for r in results:
        assert r["digests"] == {"pp2-dp2": saved, "pp1-dp4": saved, "pp2-dp2-again": saved}, r
        assert r["weight_decay"] == pytest.approx(0.01 * (r["stage"] + 1))
