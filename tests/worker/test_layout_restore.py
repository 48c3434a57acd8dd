"""A checkpoint restores across tensor-parallel layout changes, bit-identical:
four real gloo ranks, the library's own checkpoint writer and restore hook."""

from __future__ import annotations

import os

import pytest

from sbtest import run_gloo_peers

PEER = os.path.join(os.path.dirname(__file__), "layout_restore_peer.py")


@pytest.mark.timeout(150)
def test_saved_at_tp2_x_shard2_restores_at_shard4_and_at_replicate2_x_tp2_bit_identical(tmp_path):
    results = run_gloo_peers(PEER, 4, str(tmp_path / "store"), timeout_s=120)
    saved = results[0]["digests"]["tp2-shard2"]
    for r in results:
        assert r["digests"] == {"tp2-shard2": saved, "shard4": saved, "replicate2-tp2": saved}, r
