"""Test script: a linear-regression LightningModule trained by ``lightning.pytorch``
under ``springback run`` with `SpringbackCallback` and `SpringbackSampler`
(the recipe of docs/trainers.md, plus an audit for the test).

Environment: as hf_train.py (TRAIN_AUDIT, MAX_STEPS, CKPT_EVERY,
STEP_SLEEP_S, GLOBAL_BATCH)."""

from __future__ import annotations

import json
import os
import time

import lightning.pytorch as pl
import torch

from springback.integrations.lightning import SpringbackCallback, SpringbackSampler

NUM_SAMPLES, DIM = 64, 8
GENERATION = int(os.environ.get("SPRINGBACK_GENERATION", "0"))
RANK = int(os.environ.get("RANK", "0"))


def audit(**record) -> None:
    with open(os.environ["TRAIN_AUDIT"], "a", encoding="utf-8") as f:
        f.write(json.dumps({"gen": GENERATION, "rank": RANK, **record}) + "\n")


class Points(torch.utils.data.Dataset):
    """Sample i: x_i and y = x_i . w (learnable: the loss falls)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(NUM_SAMPLES, DIM, generator=g)
        self.y = self.x @ torch.randn(DIM, 1, generator=g)

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(DIM, 1)  # fits exactly: the loss falls smoothly to 0

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        audit(step=self.trainer.global_step + 1, idx=idx.tolist())
        time.sleep(float(os.environ.get("STEP_SLEEP_S", "0")))
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.02)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LossAudit(pl.Callback):
    def __init__(self, springback: SpringbackCallback) -> None:
        self.springback = springback

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if RANK == 0:  # after SpringbackCallback's hook: its loss is the ranks' mean
            audit(step=trainer.global_step, loss=self.springback.last_loss)


def main() -> None:
    torch.manual_seed(0)
    max_steps = int(os.environ["MAX_STEPS"])
    springback = SpringbackCallback(every_steps=int(os.environ["CKPT_EVERY"]))
    sampler = SpringbackSampler(springback, NUM_SAMPLES,
                                global_batch_size=int(os.environ.get("GLOBAL_BATCH", "8")),
                                max_steps=max_steps)
    loader = torch.utils.data.DataLoader(Points(), batch_size=sampler.per_rank_batch_size,
                                         sampler=sampler)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(max_steps=max_steps, max_epochs=-1, accelerator="cpu", devices=local,
                         num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local,
                         strategy="ddp", use_distributed_sampler=False,
                         callbacks=[springback, LossAudit(springback)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Regression(), loader)
    if RANK == 0:
        print(f"done at step {trainer.global_step} (restored {springback.restored_step})",
              flush=True)


if __name__ == "__main__":
    main()
