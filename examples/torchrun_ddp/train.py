"""The usual torchrun DDP example, unmodified for Springback.

    torchrun --nproc-per-node 2 examples/torchrun_ddp/train.py --checkpoint-uri file:///tmp/ddp
    springback run --job JOB --nproc-per-node 2 -- python examples/torchrun_ddp/train.py

It reads RANK, WORLD_SIZE, LOCAL_RANK (and, through ``init_process_group``'s
``env://``, MASTER_ADDR / MASTER_PORT), shards a synthetic regression data
set with ``DistributedSampler``, trains a small model under DDP (NCCL on
``cuda:<LOCAL_RANK>`` when CUDA is visible, else gloo on CPU), and
checkpoints with `springback.storage.resume.RestartCheckpoints`: after a
restart (torchrun's ``--max-restarts`` or a Springback generation) it
resumes from the newest committed step, including the epoch and the
position within it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from springback.storage.resume import RestartCheckpoints


def dataset(num_samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(num_samples, 16, generator=g)
    w = torch.linspace(-1, 1, 16)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(num_samples, generator=g))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--num-samples", type=int, default=2048)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint-uri", default=None,
                   help="default: $SPRINGBACK_CHECKPOINT_URI (the job's checkpoint.uri)")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--step-sleep-s", type=float, default=0.0, help="slow the loop down")
    args = p.parse_args()

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    torch.manual_seed(0)

    data = dataset(args.num_samples)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1)).to(device)
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    ckpt = RestartCheckpoints(args.checkpoint_uri, every_steps=args.checkpoint_every)
    step = ckpt.restore(model, opt)          # 0 on the first start
    steps_per_epoch = len(loader)
    if rank == 0:
        print(f"rank 0/{world_size}: starting at step {step}", flush=True)
    while step < args.steps:
        epoch, skip = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < skip:                     # resume mid-epoch
                continue
            loss = torch.nn.functional.mse_loss(ddp(x.to(device)).squeeze(1), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            ckpt.step_done(step, model, opt, loss=loss.item())
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            if step >= args.steps:
                break
    ckpt.save(step, model, opt, wait=True)   # the final state, committed before exit
    ckpt.close()
    if rank == 0:
        print(f"done at step {step}, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
