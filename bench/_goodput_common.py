"""Shared by the goodput benchmark's two training scripts (bench/goodput.py):
the same model, data, step and simulated compute for Springback and for the
torchrun + DCP baseline, so the two differ only in how they survive failures;
`Blocks` is the sharded form's model (goodput.py --sharded), same data and step.

The model is a small MLP regression whose samples are a fixed function of their
index (any rank can build any batch). A step sleeps GOODPUT_STEP_SLEEP_S
(default 0.06 s) to stand in for compute without loading the 2-core machine.
GOODPUT_COMPUTE_SLEEP_S, set on one node only, sleeps that much more in every
step from step GOODPUT_COMPUTE_SLEEP_FROM_STEP on, before the forward pass
(i.e. in the compute before the step's first collective): a node that becomes
slow mid-run (goodput.py --straggler; tests/worker/tiny_train.py's
TINY_COMPUTE_SLEEP_S is the same injection).
"""

from __future__ import annotations

import os
import time

import torch

NUM_SAMPLES = 4096
GLOBAL_BATCH = 24
SEED = 0
STEP_SLEEP_S = float(os.environ.get("GOODPUT_STEP_SLEEP_S", "0.06"))
MAX_STEPS = int(os.environ.get("GOODPUT_MAX_STEPS", "1000"))
COMPUTE_SLEEP_S = float(os.environ.get("GOODPUT_COMPUTE_SLEEP_S", "0"))
COMPUTE_SLEEP_FROM_STEP = int(os.environ.get("GOODPUT_COMPUTE_SLEEP_FROM_STEP", "0"))


def slow_compute(step: int) -> None:
    """A slow node's extra compute in `step` (GOODPUT_COMPUTE_SLEEP_S from
    GOODPUT_COMPUTE_SLEEP_FROM_STEP on; nothing on the other nodes)."""
    if COMPUTE_SLEEP_S and step >= COMPUTE_SLEEP_FROM_STEP:
        time.sleep(COMPUTE_SLEEP_S)


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def features(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.stack([torch.sin(indices * 0.05 * k) for k in range(1, 17)], dim=1)
    w_true = torch.arange(1, 17, dtype=torch.float32) / 16
    return x, x @ w_true + 0.5


def train_step(ddp: torch.nn.Module, opt: torch.optim.Optimizer, indices,  # noqa: ANN001
               loss_scale: float) -> float:
    """One step on this rank's `indices`: sum of per-sample losses x loss_scale."""
    x, y = features(torch.as_tensor(indices, dtype=torch.float32))
    per_sample = (ddp(x).squeeze(1) - y) ** 2
    (per_sample.sum() * loss_scale).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if STEP_SLEEP_S:
        time.sleep(STEP_SLEEP_S)  # stand-in for compute
    return per_sample.mean().item() if len(per_sample) else 0.0


def step_indices(step: int, world: int, rank: int) -> torch.Tensor:
    """This rank's share of the global batch of `step` (1-based): the step's
    window of a per-epoch seeded permutation, split across ranks (the torchrun
    and torchft baselines; Springback's Session serves its own batches)."""
    first = (step - 1) * GLOBAL_BATCH
    perms: dict[int, torch.Tensor] = {}
    out = []
    for pos in range(first, first + GLOBAL_BATCH):
        epoch, i = divmod(pos, NUM_SAMPLES)
        if epoch not in perms:
            perms[epoch] = torch.randperm(NUM_SAMPLES,
                                          generator=torch.Generator().manual_seed(SEED + epoch))
        out.append(int(perms[epoch][i]))
    return torch.tensor_split(torch.tensor(out), world)[rank]


HIDDEN = int(os.environ.get("GOODPUT_HIDDEN", "1024"))
BLOCKS = int(os.environ.get("GOODPUT_BLOCKS", "6"))


class Blocks(torch.nn.Module):
    """The sharded goodput bench's model (bench/goodput.py --sharded): the
    same 16 features in, BLOCKS x Linear(HIDDEN, HIDDEN) + ReLU, one output.
    6 x 1024 by default: 6.3 M parameters, 72 MiB with AdamW's two moments,
    so the state takes a visible time to move; each block is one FSDP unit."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, HIDDEN)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(BLOCKS))
        self.out = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.out(h)


def make_blocks() -> Blocks:
    """The sharded model, seeded alike on every rank (as FSDP2 expects)."""
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    return Blocks()


def make_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)
