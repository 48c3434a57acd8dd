"""The GPU path: NCCL for the user's tensors, gloo for the library's own small
collectives, one CUDA device per local rank. The CUDA tests skip cleanly on
machines without a GPU; the backend choice is checked everywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from springback.worker.rank.device import group_backend, rank_device
from springback.worker.train.session import Session

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "torchrun_ddp" / "train.py")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class TestBackendChoice:
    def test_nccl_groups_keep_a_gloo_side_for_the_librarys_cpu_collectives(self):
        assert group_backend("nccl") == "cpu:gloo,cuda:nccl"
        assert group_backend("gloo") == "gloo"
        assert rank_device("gloo", 1) == torch.device("cpu")

    @pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
    def test_nccl_without_a_gpu_says_so(self):
        with pytest.raises(RuntimeError, match="needs CUDA"):
            rank_device("nccl", 0)


@needs_cuda
class TestOnGpu:
    def test_a_standalone_session_trains_ddp_over_nccl_on_its_local_device(self):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = torch.nn.Linear(4, 1).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        session = Session(model=model, optimizer=opt, num_samples=32, global_batch_size=8,
                          max_steps=3, backend="nccl")
        assert session.device == torch.device("cuda", 0)
        for gen in session.generations():
            with gen:
                ddp = DDP(model, process_group=gen.group, device_ids=[0])
                for batch in gen.batches():
                    loss = ddp(torch.ones(len(batch.indices), 4, device="cuda")).sum()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
        assert session.step == 3

    @pytest.mark.timeout(180)
    def test_the_torchrun_example_runs_on_nccl_under_springback(self, tmp_path):
        nproc = min(2, torch.cuda.device_count())
        out = subprocess.run(
            [sys.executable, "-m", "springback.cli", "run", "--standalone",
             "--nproc-per-node", str(nproc), "--", sys.executable, EXAMPLE, "--steps", "10",
             "--checkpoint-every", "5", "--checkpoint-uri", f"file://{tmp_path}/ckpt"],
            capture_output=True, text=True, timeout=170)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "done at step 10" in out.stdout + out.stderr
