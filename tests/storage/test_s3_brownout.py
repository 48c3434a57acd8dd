"""A restore through an S3 brown-out -- an ordinary throttling episode, not an
outage -- succeeds: every request is retried on its own, so a few failed
requests cost a few requests, never the whole load on every rank.

The brown-out is the fault proxy's rate mode in front of a real moto server,
on for the whole restore: 15 % of requests answered 503 SlowDown, 5 % reset
before they reach the server, 5 % reset after it answered, 10 % of GET bodies
cut short (full Content-Length, half the bytes). The checkpoint has several
shard files (written by more ranks than restore it), so a restore makes
dozens of requests; retrying the whole load on any failure (issue 43) failed
every time here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from sbtest import start_python
from springback.storage import Checkpointer, RetryPolicy, restore
from springback.storage.store import ObjectStore

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

WORKER = Path(__file__).with_name("dist_worker.py")
NUM_TENSORS = 16  # about 4.6 MiB in all
NUM_WRITERS = 4
RETRY = {"max_attempts": 12, "initial_backoff_s": 0.01, "max_backoff_s": 0.1, "deadline_s": 60.0}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{i:02d}": torch.randn(64 + i, 1024, generator=g) for i in range(NUM_TENSORS)}


def _save_committed(base: str, opts: dict) -> dict[str, torch.Tensor]:
    """Save `_state()` as step 5 by NUM_WRITERS ranks (one shard file each), straight to moto."""
    sd = _state()
    store = ObjectStore(base, storage_options=opts)
    ckpts = [Checkpointer(base, rank=r, world_size=NUM_WRITERS, store=store, commit_timeout_s=60,
                          poll_interval_s=0.05) for r in range(NUM_WRITERS)]
    futs = [c.save(5, sd, generation=1) for c in ckpts]
    futs[0].result(timeout=60)
    for c in ckpts:
        c.close()
    return sd


def _assert_restored(sd: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
    assert set(out) == set(sd)
    for k in sd:
        assert torch.equal(out[k], sd[k]), f"{k} differs"


def _restore_in_process(s3_bucket, faulty_s3, make_s3_options) -> None:
    bucket, opts = s3_bucket
    endpoint, injector = faulty_s3
    base = f"{bucket}/job"
    sd = _save_committed(base, opts)
    store = ObjectStore(base, storage_options=make_s3_options(endpoint), retry=RetryPolicy(**RETRY))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    injector.rate(seed=4)
    result = restore(base, out, store=store)
    injector.clear()
    _assert_restored(sd, out)
    assert result.step == 5 and not result.skipped
    num_requests = injector.forwarded + sum(m == "reset" for m, _, _ in injector.injected)
    assert num_requests >= 24, num_requests  # dozens of requests met the brown-out
    assert injector.injected, "no fault was injected"
    assert store.stats.retries >= 1  # each failed request retried on its own ...
    assert store.stats.collective_retries == 0 and store.stats.gave_up == 0  # ... never the whole load


class TestRestoreThroughABrownOut:
    @pytest.mark.timeout(120)
    def test_a_single_process_restore_retries_the_failed_requests_alone_and_is_bit_identical(
            self, s3_bucket, faulty_s3, make_s3_options):
        _restore_in_process(s3_bucket, faulty_s3, make_s3_options)

    @pytest.mark.timeout(240)
    def test_a_restore_beside_busy_processes_retries_the_failed_requests_alone_and_is_bit_identical(
            self, s3_bucket, faulty_s3, make_s3_options, loaded):
        _restore_in_process(s3_bucket, faulty_s3, make_s3_options)

    @pytest.mark.timeout(300)
    def test_a_two_rank_restore_retries_the_failed_requests_alone_and_both_ranks_are_bit_identical(
            self, s3_bucket, faulty_s3, make_s3_options, tmp_path):
        bucket, opts = s3_bucket
        endpoint, injector = faulty_s3
        base = f"{bucket}/job"
        sd = _save_committed(base, opts)
        world = 2
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        args = {"mode": "brownout", "base": base, "storage_options": make_s3_options(endpoint), "retry": RETRY,
                "shapes": {k: list(v.shape) for k, v in sd.items()}, "out": str(tmp_path / "out"), "world": world,
                "rendezvous": str(tmp_path / "rdzv")}
        injector.rate(seed=4)
        procs = []
        for rank in range(world):
            with open(tmp_path / f"rank{rank}.log", "w") as log:
                procs.append(start_python([str(WORKER), json.dumps({**args, "rank": rank})],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            for rank, p in enumerate(procs):
                rc = p.wait(timeout=240)
                assert rc == 0, f"rank {rank} exited {rc}:\n{(tmp_path / f'rank{rank}.log').read_text()[-3000:]}"
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        injector.clear()
        results = [torch.load(tmp_path / f"out-{rank}.pt") for rank in range(world)]
        for res in results:
            _assert_restored(sd, res["state"])
            assert res["step"] == 5 and not res["skipped"]
            assert res["gave_up"] == 0
        num_requests = injector.forwarded + sum(m == "reset" for m, _, _ in injector.injected)
        assert num_requests >= 24, num_requests
        assert injector.injected, "no fault was injected"
        assert sum(r["retries"] for r in results) >= 1  # failed requests retried on their own ...
        assert sum(r["collective_retries"] for r in results) == 0  # ... never the whole load
