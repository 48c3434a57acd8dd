"""Multi-process checkpoints on real torch.distributed (gloo): N writers -> M readers for
DDP and FSDP2 with bit-identical state, and a rank SIGKILLed mid-upload."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from sbtest import start_python, wait_for
from springback.worker.agent.rankprocess import RankProcess
from springback.storage import clean_partial, list_checkpoints, restore

WORKER = Path(__file__).with_name("dist_worker.py")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def launch(world: int, args: dict, tmp: Path, tag: str) -> list[RankProcess]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for rank in range(world):
        a = {**args, "rank": rank, "world": world, "rendezvous": str(tmp / f"rdzv-{tag}")}
        log = open(tmp / f"{tag}-rank{rank}.log", "w")
        procs.append(start_python([str(WORKER), json.dumps(a)], env=env, stdout=log,
                                  stderr=subprocess.STDOUT))
    return procs


def join_all(procs: list[RankProcess], tmp: Path, tag: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    for rank, p in enumerate(procs):
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert rc == 0, f"{tag} rank {rank} exited {rc}:\n{(tmp / f'{tag}-rank{rank}.log').read_text()[-3000:]}"


def assert_tree_equal(a, b, path="") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {set(a) ^ set(b)}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{path} differs"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def plant_corrupt_copy(root: Path, step: int) -> str:
    """Copy the only checkpoint under ``root`` to a newer step and corrupt its rank-1 shard."""
    (src,) = [p for p in root.iterdir() if p.name.startswith("step-")]
    name = f"step-{step:08d}-g1"
    shutil.copytree(src, root / name)
    manifest = json.loads((root / name / "manifest.json").read_text())
    manifest["step"] = step
    (root / name / "manifest.json").write_text(json.dumps(manifest))
    shard = root / name / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x5A
    shard.write_bytes(bytes(data))
    return name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_saved_by_two_ranks_restores_bit_identical_on_three_and_one(parallel, tmp_path):
    base = f"file://{tmp_path}/ckpts"
    ref = tmp_path / "ref.pt"
    join_all(launch(2, {"mode": "save", "parallel": parallel, "base": base, "out": str(ref)}, tmp_path, "save"), tmp_path, "save")
    expected = torch.load(ref, weights_only=False)
    # A newer committed checkpoint with one corrupt shard: only one restoring rank reads
    # that file, so all ranks must agree to skip it (or they would load different steps).
    bad = plant_corrupt_copy(tmp_path / "ckpts", step=4)
    for world in (3, 1):
        out = tmp_path / f"restored-{world}.pt"
        tag = f"restore{world}"
        join_all(launch(world, {"mode": "restore", "parallel": parallel, "base": base, "out": str(out)}, tmp_path, tag), tmp_path, tag)
        got = torch.load(out, weights_only=False)
        assert (got["step"], got["cursor"], got["writers"]) == (3, [1, 96], 2)
        assert got["skipped"] == [f"{base}/{bad}"]
        assert_tree_equal(expected["model"], got["model"], "model")
        assert_tree_equal(expected["optim"], got["optim"], "optim")


@pytest.mark.timeout(300)
def test_saved_with_shard_4_restores_bit_identical_as_replicate_2_by_shard_1(tmp_path):
    base = f"file://{tmp_path}/ckpts"
    ref = tmp_path / "ref.pt"
    save = {"mode": "save", "parallel": "fsdp", "base": base, "out": str(ref), "mesh": [1, 4]}
    join_all(launch(4, save, tmp_path, "save"), tmp_path, "save")
    out = tmp_path / "restored.pt"
    restore = {"mode": "restore", "parallel": "fsdp", "base": base, "out": str(out), "mesh": [2, 1]}
    join_all(launch(2, restore, tmp_path, "restore"), tmp_path, "restore")
    expected, got = torch.load(ref, weights_only=False), torch.load(out, weights_only=False)
    assert (got["step"], got["writers"]) == (3, 4)
    assert_tree_equal(expected["model"], got["model"], "model")
    assert_tree_equal(expected["optim"], got["optim"], "optim")


@pytest.mark.timeout(120)
def test_every_pipeline_stages_fsdp_shards_are_in_the_checkpoint(tmp_path):
    """FSDP2 on each stage's slice of a (pp, shard) mesh: the stage at pp
    coordinate 1 writes its layer too (the slices along pp are no replicas),
    and the checkpoint holds both stages' layers, bit for bit."""
    from springback.storage import restore

    base = f"file://{tmp_path}/ckpts"
    out = tmp_path / "stage"
    join_all(launch(4, {"mode": "stages", "base": base, "out": str(out)}, tmp_path, "stages"),
             tmp_path, "stages")
    expected = {f"model.{k}": v for s in (0, 1)
                for k, v in torch.load(f"{out}-{s}.pt", weights_only=False).items()}
    assert len(expected) == 4  # two layers, weight and bias
    got = {"model": {k.removeprefix("model."): torch.zeros_like(v) for k, v in expected.items()}}
    assert restore(base, got).step == 1
    assert_tree_equal({k.removeprefix("model."): v for k, v in expected.items()}, got["model"])


@pytest.mark.timeout(120)
def test_rank_killed_mid_upload_leaves_no_committed_half_checkpoint_and_it_is_cleaned(tmp_path):
    base = f"file://{tmp_path}/ckpts"
    outcome = tmp_path / "outcome.json"
    procs = launch(2, {"mode": "hang", "base": base, "hang_rank": 1, "commit_timeout_s": 4.0, "out": str(outcome)}, tmp_path, "hang")
    try:
        shard = tmp_path / "ckpts" / "step-00000002-g1" / "__1_0.distcp"
        deadline = time.monotonic() + 60
        while not (shard.exists() and shard.stat().st_size >= 65536):
            assert time.monotonic() < deadline, "rank 1 never started uploading step 2"
            assert procs[1].poll() is None, (tmp_path / "hang-rank1.log").read_text()
            time.sleep(0.02)
        procs[1].send_signal(signal.SIGKILL)
        assert procs[1].wait(timeout=30) == -signal.SIGKILL
        assert procs[0].wait(timeout=60) == 0, (tmp_path / "hang-rank0.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert json.loads(outcome.read_text()) == {"committed": False, "error": "CommitTimeout", "missing": [1]}
    assert [(c.step, c.state) for c in list_checkpoints(base)] == [(1, "committed"), (2, "partial")]
    assert not (tmp_path / "ckpts" / "step-00000002-g1" / "manifest.json").exists()
    sd = {"w": torch.zeros(512, 512), "b": torch.zeros(512), "x": torch.zeros(300, 300)}
    assert restore(base, sd).step == 1
    # the next generation cleans what the killed one left behind
    assert clean_partial(base, current_generation=2) == [f"{base}/step-00000002-g1"]
    assert [(c.step, c.state) for c in list_checkpoints(base)] == [(1, "committed")]


@pytest.mark.timeout(120)
def test_a_committer_killed_after_every_shard_is_durable_commits_nothing_and_is_cleaned(tmp_path):
    base = f"file://{tmp_path}/ckpts"
    at_commit = tmp_path / "at-commit"
    procs = launch(2, {"mode": "die_before_commit", "base": base, "out": str(at_commit)}, tmp_path, "die")
    try:
        wait_for(lambda: at_commit.exists() or procs[0].poll() is not None, 60, "rank 0 about to commit step 2")
        assert procs[0].poll() is None, (tmp_path / "die-rank0.log").read_text()
        procs[0].send_signal(signal.SIGKILL)
        assert procs[0].wait(timeout=30) == -signal.SIGKILL
        assert procs[1].wait(timeout=60) == 0, (tmp_path / "die-rank1.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    step2 = tmp_path / "ckpts" / "step-00000002-g1"
    assert {p.name for p in step2.iterdir()} >= {"__0_0.distcp", "__1_0.distcp"}  # every shard landed
    assert [(c.step, c.state) for c in list_checkpoints(base)] == [(1, "committed"), (2, "partial")]
    sd = {"w": torch.zeros(256, 256), "b": torch.zeros(256)}
    assert restore(base, sd).step == 1 and torch.equal(sd["w"], torch.full((256, 256), 1.0))
    assert clean_partial(base) == []  # nothing proves the writers dead yet
    assert clean_partial(base, current_generation=2) == [f"{base}/step-00000002-g1"]
    assert [(c.step, c.state) for c in list_checkpoints(base)] == [(1, "committed")]
