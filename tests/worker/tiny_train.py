"""A tiny DDP training script for the worker tests: a linear regression whose
samples are a fixed function of their index, so any rank can build any batch.

Environment knobs (test-only): TINY_STEP_SLEEP_S slows each step so faults land
mid-run; TINY_CRASH_AT_STEP=N makes global rank 1 exit(3) before step N, once
per marker file TINY_CRASH_MARKER; TINY_PRINT_STEPS=1 prints a line per step
(for the rank-log tests).
"""

import faulthandler
import os
import signal
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from springback.worker import Session


def features(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.stack([torch.sin(indices * 0.1 * k) for k in range(1, 9)], dim=1)
    w_true = torch.arange(1, 9, dtype=torch.float32) / 8
    return x, x @ w_true + 0.5


def main() -> int:
    faulthandler.register(signal.SIGUSR1)  # stack dump of a hung rank, for debugging
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    session = Session(model=model, optimizer=opt, num_samples=256, global_batch_size=12,
                      max_steps=40)
    sleep_s = float(os.environ.get("TINY_STEP_SLEEP_S", "0"))
    crash_at = int(os.environ.get("TINY_CRASH_AT_STEP", "0"))
    marker = os.environ.get("TINY_CRASH_MARKER", "")
    say_steps = os.environ.get("TINY_PRINT_STEPS") == "1"
    for gen in session.generations():
        with gen:
            ddp = DDP(model, process_group=gen.group)
            for batch in gen.batches():
                if (crash_at and batch.step == crash_at and gen.rank == 1 and marker
                        and not os.path.exists(marker)):
                    open(marker, "w").close()
                    os._exit(3)
                x, y = features(torch.as_tensor(batch.indices, dtype=torch.float32))
                per_sample = (ddp(x).squeeze(1) - y) ** 2
                (per_sample.sum() * batch.loss_scale).backward()
                opt.step()
                opt.zero_grad()
                gen.report(loss=per_sample.mean().item() if len(per_sample) else 0.0)
                if say_steps:
                    print(f"trained step {batch.step} in generation {gen.generation}", flush=True)
                if sleep_s:
                    time.sleep(sleep_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
