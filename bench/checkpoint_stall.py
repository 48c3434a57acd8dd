"""Checkpoint stall: how long save() blocks the step loop, in one run on the same state.

Compares, on a CPU model + AdamW state (default ~200 MB):
  (a) springback Checkpointer.save()      -- returns after the host-memory snapshot
  (b) torch.distributed.checkpoint.async_save() -- time until it returns its future
  (c) a plain in-memory copy of the state into preallocated buffers
and prints yours/copy (target <= 2) and yours/async_save (target <= 0.1), medians of
several repetitions (the first, buffer-allocating save is reported separately).

    .venv/bin/python bench/checkpoint_stall.py [--mb 200] [--reps 5] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from springback.storage import Checkpointer, model_state_dict


def build_state(mb: int, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    # params + 2 Adam moments = 3 x 4 bytes per parameter
    width = 1024
    n_layers = max(1, round(mb * 2**20 / (3 * 4 * width * width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(n_layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width, device=device)).sum().backward()
    opt.step()
    return model, opt, model_state_dict(model, opt)


def tensors(sd: object) -> list[torch.Tensor]:
    if isinstance(sd, torch.Tensor):
        return [sd]
    if isinstance(sd, dict):
        return [t for v in sd.values() for t in tensors(v)]
    if isinstance(sd, (list, tuple)):
        return [t for v in sd for t in tensors(v)]
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default="cpu", help="where the state lives (cpu, or cuda: snapshots go to pinned host memory)")
    ap.add_argument("--dp", type=int, default=2, help="also report rank 0's stall as one of DP ranks sharing replicated state")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir, removed)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="sb-stall-")
    os.makedirs(root, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{root}/rdzv", rank=0, world_size=1)
    model, opt, sd = build_state(args.mb, args.device)
    cuda = args.device.startswith("cuda")
    ts = tensors(sd)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    print(f"state: {len(ts)} tensors, {nbytes / 2**20:.0f} MiB, torch {torch.__version__}, {torch.get_num_threads()} threads")

    # The three are interleaved in each repetition so that they see the same machine
    # conditions (these machines are shared); rep 0 allocates and is reported apart.
    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in ts]
    ck = Checkpointer(f"{root}/springback", rank=0, world_size=1, keep_last=1)
    # one rank of a DP job: replicated tensors are split across ranks, so it snapshots
    # ~1/dp of the state (no collective is involved, so one process measures it
    # faithfully; rank 1 is used because it does not wait to commit).
    share = Checkpointer(f"{root}/share", rank=1, world_size=args.dp)
    share_s: list[float] = []
    copy_s: list[float] = []
    ours_s: list[float] = []
    async_s: list[float] = []
    for i in range(args.reps + 1):
        # (c) plain copy into preallocated buffers
        t0 = time.perf_counter()
        for b, t in zip(bufs, ts):
            b.copy_(t, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        copy_s.append(time.perf_counter() - t0)
        # (a) springback: blocked until the snapshot is taken
        t0 = time.perf_counter()
        ck.save(i, sd, generation=1)
        ours_s.append(time.perf_counter() - t0)
        ck.wait()
        t0 = time.perf_counter()
        share.save(i, sd, generation=1)
        share_s.append(time.perf_counter() - t0)
        share.wait()
        # (b) dcp.async_save: blocked until it returns its future
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=f"{root}/dcp/step-{i}")
        async_s.append(time.perf_counter() - t0)
        fut.result()
        shutil.rmtree(f"{root}/dcp/step-{i}", ignore_errors=True)
    ck.close()
    share.close()
    del bufs

    med = {k: statistics.median(v[1:]) for k, v in (("copy", copy_s), ("ours", ours_s), ("async", async_s))}
    print(f"first call (allocating): copy {copy_s[0]*1e3:.1f} ms, springback {ours_s[0]*1e3:.1f} ms, dcp.async_save {async_s[0]*1e3:.1f} ms")
    print(f"median of {args.reps}:  copy {med['copy']*1e3:.1f} ms, springback {med['ours']*1e3:.1f} ms, dcp.async_save {med['async']*1e3:.1f} ms")
    print(f"springback / copy       = {med['ours'] / med['copy']:.2f}   (target <= 2)")
    print(f"springback / async_save = {med['ours'] / med['async']:.3f}  (target <= 0.1)")
    share_med = statistics.median(share_s[1:])
    print(f"as one rank of dp={args.dp} (replicated state split): springback {share_med*1e3:.1f} ms -> "
          f"/copy {share_med / med['copy']:.2f}, /async_save {share_med / med['async']:.3f}")
    dist.destroy_process_group()
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
