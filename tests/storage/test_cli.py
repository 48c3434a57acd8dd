"""``springback ckpt verify`` / ``list`` (cli/checkpoints.py): exit codes and output name the bad shard."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import torch

from springback.storage import Checkpointer
from springback.cli.checkpoints import ckpt_list_uri, ckpt_verify, format_rows
from springback.storage.store import ObjectStore, join


def _commit(base: str, step: int) -> str:
    c = Checkpointer(base, rank=0, world_size=1)
    info = c.save(step, {"w": torch.arange(1000.0)}, generation=2).result(timeout=30)
    c.close()
    return info.uri


def test_verify_exits_zero_when_intact_and_one_naming_the_corrupt_shard(tmp_path):
    base = str(tmp_path / "ck")
    uri = _commit(base, 1)
    out = io.StringIO()
    assert ckpt_verify(uri, out=out) == 0 and out.getvalue().startswith("OK")
    shard = join(uri, "__0_0.distcp")
    data = bytearray(ObjectStore(base).get_bytes(shard))
    data[-10] ^= 1
    ObjectStore(base).put_bytes(shard, bytes(data))
    out = io.StringIO()
    assert ckpt_verify(uri, json_out=True, out=out) == 1
    report = json.loads(out.getvalue())
    assert report["ok"] is False and "__0_0.distcp" in report["checkpoints"][0]["problems"][0]
    proc = subprocess.run([sys.executable, "-m", "springback.cli", "ckpt", "verify", base], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "__0_0.distcp" in proc.stdout


def test_verify_of_an_empty_base_exits_two(tmp_path, capsys):
    assert ckpt_verify(str(tmp_path), out=io.StringIO()) == 2
    assert ckpt_verify(str(tmp_path), json_out=True) == 2
    assert json.loads(capsys.readouterr().out) == {"ok": False, "checkpoints": []}


def test_list_shows_committed_and_partial_with_size_and_world(tmp_path):
    base = str(tmp_path / "ck")
    _commit(base, 1)
    ObjectStore(base).put_bytes(join(base, "step-00000002-g2", "__0_0.distcp"), b"x")
    rows = ckpt_list_uri(base)
    assert [(r["step"], r["state"], r["world_size"]) for r in rows] == [(1, "committed", 1), (2, "partial", 0)]
    assert rows[0]["size_bytes"] > 4000 and rows[0]["time"]
    assert "committed" in format_rows(rows)
