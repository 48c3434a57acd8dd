"""Lightning (``lightning.pytorch``) under Springback (restart mode).

The recipe (docs/trainers.md has it whole)::

    from springback.integrations.lightning import SpringbackCallback, SpringbackSampler

    springback = SpringbackCallback(every_steps=100)   # $SPRINGBACK_CHECKPOINT_URI
    sampler = SpringbackSampler(springback, len(data), global_batch_size=64, max_steps=1000)
    loader = DataLoader(data, batch_size=sampler.per_rank_batch_size, sampler=sampler)
    trainer = L.Trainer(max_steps=1000, callbacks=[springback], use_distributed_sampler=False,
                        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
                        devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp")
    trainer.fit(module, loader)

In ``on_fit_start`` (the optimizers and LR schedulers exist, the data loader
is not iterated yet) the callback restores the newest checkpoint committed
under the job's ``checkpoint.uri`` (`springback.storage.resume`) into the
module, its optimizer and its LR scheduler, and sets the Trainer's global
step to the restored one (so ``max_steps`` counts from there). Lightning
cannot fast-forward a plain data loader mid-epoch, so the data order is
Springback's: `SpringbackSampler` yields this rank's share of global batch
``k`` (positions ``[k*G, (k+1)*G)`` of epoch ``k*G // N``'s seeded
permutation) for the steps after the restored one; any world size that
divides ``G`` takes the same samples at the same step.

The callback saves a Springback checkpoint every `every_steps` steps, at the
end of training, and when the ranks are told to stop (SIGTERM, the agent's
drain marker; its handler replaces Lightning's, which would raise
``SIGTERMException`` without a checkpoint): every rank agrees on the step,
the checkpoint is committed, the Trainer stops, and ``fit`` raises
``SystemExit(DRAINED_EXIT_CODE)``. Each step and its loss (averaged over the
ranks) reach the coordinator through the agent, each commit is recorded.

Limits: one optimizer and at most one LR scheduler (automatic optimization);
no gradient accumulation (``accumulate_grad_batches=1``); validation and
other loops are not resumed mid-way. Failure semantics are those of the
Hugging Face callback (`springback.integrations.hf`).
"""

from __future__ import annotations

import logging
import os
import math
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from springback.integrations.data import per_rank_batch_size
from springback.integrations.drain import DRAINED_EXIT_CODE, DrainWatch
from springback.storage.resume import RestartCheckpoints

log = logging.getLogger(__name__)

SCHEDULER_KEY = "lr_scheduler"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class SpringbackCallback(pl.Callback):
    """See the module docstring. One instance per ``Trainer``."""

    def __init__(self, uri: str | None = None, *, every_steps: int = 0,
                 storage_options: dict[str, Any] | None = None) -> None:
        if every_steps < 0:
            raise ValueError(f"SpringbackCallback: every_steps must be >= 0, got {every_steps}")
        self.uri = uri
        self.every_steps = every_steps
        self.storage_options = storage_options
        self.restored_step = 0
        self.last_loss = math.nan
        self.drained: str | None = None
        self._ckpt: RestartCheckpoints | None = None
        self._watch = DrainWatch()
        self._saved_step = 0

    def _checkpoints(self) -> RestartCheckpoints:
        if self._ckpt is None:  # after the process group exists
            self._ckpt = RestartCheckpoints(self.uri, storage_options=self.storage_options)
        return self._ckpt

    @staticmethod
    def _objects(trainer: pl.Trainer) -> tuple[torch.optim.Optimizer, dict[str, Any] | None]:
        if len(trainer.optimizers) != 1 or len(trainer.lr_scheduler_configs) > 1:
            raise ValueError("springback.integrations.lightning: one optimizer and at most "
                             "one LR scheduler")
        extra = ({SCHEDULER_KEY: trainer.lr_scheduler_configs[0].scheduler}
                 if trainer.lr_scheduler_configs else None)
        return trainer.optimizers[0], extra

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError("springback.integrations.lightning: accumulate_grad_batches "
                             "must be 1")
        optimizer, extra = self._objects(trainer)
        step = self._checkpoints().restore(pl_module, optimizer, extra_state=extra)
        self.restored_step = self._saved_step = step
        loop = trainer.fit_loop.epoch_loop
        loop.automatic_optimization.optim_progress.optimizer.step.total.ready = step
        loop.automatic_optimization.optim_progress.optimizer.step.total.completed = step
        loop._batches_that_stepped = step  # noqa: SLF001 (what the loggers count)
        if step:
            log.info("resuming the Lightning Trainer at step %d", step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._watch.install()  # after Lightning's own SIGTERM handler: replaces it

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            value = loss.detach().float().reshape(1).cpu()
            if _world()[1] > 1:
                dist.all_reduce(value)
                value /= _world()[1]
            self.last_loss = float(value.item())
        ckpt = self._checkpoints()
        ckpt.report(step, loss=self.last_loss)
        reason = self._watch.agreed()
        if reason or self.every_steps and step % self.every_steps == 0:
            self._save(trainer, pl_module, step, wait=bool(reason))
        if reason:
            self.drained = reason
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ckpt = self._checkpoints()
        if trainer.global_step > self._saved_step:
            self._save(trainer, pl_module, trainer.global_step, wait=True)
        ckpt.report(trainer.global_step, loss=self.last_loss)
        ckpt.close()
        self._watch.uninstall()
        if self.drained:
            log.warning("stopped at step %d (%s): drain checkpoint committed",
                        trainer.global_step, self.drained)
            raise SystemExit(DRAINED_EXIT_CODE)

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, *,
              wait: bool) -> None:
        optimizer, extra = self._objects(trainer)
        self._checkpoints().save(step, pl_module, optimizer, wait=wait, extra_state=extra)
        self._saved_step = step


class SpringbackSampler(torch.utils.data.Sampler[int]):
    """This rank's sample indices for the steps after `callback`'s restored
    step, up to `max_steps`: global batch ``k`` is positions ``[k*G, (k+1)*G)``
    of the permutation of epoch ``k*G // num_samples`` (seeded by `seed` and
    the epoch), rank ``r`` takes its ``r``-th ``G/world`` slice. Needs
    `num_samples` a multiple of `global_batch_size`. Reads the restored step
    when iterated (after ``on_fit_start``)."""

    def __init__(self, callback: SpringbackCallback, num_samples: int, *,
                 global_batch_size: int, max_steps: int, seed: int = 0,
                 world_size: int | None = None, rank: int | None = None) -> None:
        if num_samples % global_batch_size:
            raise ValueError(f"SpringbackSampler: {num_samples} samples do not split into "
                             f"global batches of {global_batch_size}")
        self.callback = callback
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.max_steps, self.seed = max_steps, seed
        self.world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
        self.per_rank_batch_size = per_rank_batch_size(global_batch_size,
                                                       world_size=self.world_size)

    def __len__(self) -> int:
        return max(0, self.max_steps - self.callback.restored_step) * self.per_rank_batch_size

    def __iter__(self) -> Iterator[int]:
        per_epoch = self.num_samples // self.global_batch_size
        b = self.per_rank_batch_size
        perm: list[int] = []
        epoch = -1
        for k in range(self.callback.restored_step, self.max_steps):
            if k // per_epoch != epoch:
                epoch = k // per_epoch
                g = torch.Generator().manual_seed(self.seed + epoch)
                perm = torch.randperm(self.num_samples, generator=g).tolist()
            start = (k % per_epoch) * self.global_batch_size + self.rank * b
            yield from perm[start:start + b]
