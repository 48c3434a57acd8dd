"""Hugging Face ``Trainer`` under Springback (restart mode).

The recipe (docs/trainers.md has it whole)::

    from springback.integrations import per_rank_batch_size
    from springback.integrations.hf import SpringbackCallback

    args = TrainingArguments(output_dir="out", max_steps=1000, save_strategy="no",
                             per_device_train_batch_size=per_rank_batch_size(64),
                             logging_steps=1)
    springback = SpringbackCallback(every_steps=100)   # $SPRINGBACK_CHECKPOINT_URI
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[springback])
    trainer.train(resume_from_checkpoint=springback.resume(trainer))

`SpringbackCallback.resume` loads the newest checkpoint committed under the
job's ``checkpoint.uri`` (the one `springback.storage.resume` picks: the
newest intact commit, at most the plan's step when the plan names one) into
the trainer's model, optimizer and LR scheduler, and writes it out as a
Trainer checkpoint directory on local disk, so that ``Trainer.train`` resumes
from it the way it always does: the global step, the scheduler, and the data
loader fast-forwarded past the batches of the current epoch already trained.

The callback then saves a Springback checkpoint (DCP shards, a manifest with
checksums; any world size restores it) every `every_steps` steps, at the end
of training, and when the ranks are told to stop (SIGTERM from the agent, the
drain marker): every rank agrees on the step (a one-int all-reduce per step),
the checkpoint is committed, the Trainer logs that step and ends its loop,
and ``train()`` raises ``SystemExit(DRAINED_EXIT_CODE)``: the script stops
there instead of running what follows a finished training (in restart mode
every rank exiting 0 means the job is done).
Each step and the logged loss reach the coordinator through the agent, each
commit is recorded (CommitCheckpoint), and the restored step tells the
coordinator how many steps a restart redid (``job get``: ``restores``,
``steps_redone``).

Failure semantics: `resume` is collective (every rank calls it after the
``Trainer`` exists, i.e. after the process group is up); it raises what the
restore raised (`CorruptCheckpoint` when every candidate is damaged). A save
that fails in storage is logged and training goes on (the next one is tried);
the final save's failure raises from ``train()``. A rank SIGKILLed mid-save
leaves a partial checkpoint that is never restored.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from springback.integrations.drain import DRAINED_EXIT_CODE, DrainWatch
from springback.storage.resume import RestartCheckpoints

log = logging.getLogger(__name__)

SCHEDULER_KEY = "lr_scheduler"
"""Name of the LR scheduler's entry in the checkpoint's ``extra_state``."""


def _inner(obj: Any, attr: str) -> Any:
    """Accelerate's wrappers (AcceleratedOptimizer.optimizer,
    AcceleratedScheduler.scheduler) around the torch object."""
    return getattr(obj, attr, obj) if obj is not None else None


class SpringbackCallback(TrainerCallback):
    """See the module docstring. `uri` defaults to $SPRINGBACK_CHECKPOINT_URI
    (set by the agent from the job spec); `every_steps` 0 saves only at the
    end and on a drain. Use one instance per ``Trainer``."""

    def __init__(self, uri: str | None = None, *, every_steps: int = 0,
                 storage_options: dict[str, Any] | None = None,
                 resume_dir: str | None = None) -> None:
        if every_steps < 0:
            raise ValueError(f"SpringbackCallback: every_steps must be >= 0, got {every_steps}")
        self.uri = uri
        self.every_steps = every_steps
        self.storage_options = storage_options
        self.resume_dir = resume_dir
        """Where `resume` writes the Trainer checkpoint it hands to ``train``
        (default: a fresh temporary directory per process)."""
        self.restored_step = 0
        self.drained: str | None = None
        self._ckpt: RestartCheckpoints | None = None
        self._watch = DrainWatch()
        self._saved_step = 0
        self._last_loss = math.nan

    # -- set-up --------------------------------------------------------------------

    def _checkpoints(self) -> RestartCheckpoints:
        if self._ckpt is None:  # after init_process_group: it reads rank and world size
            self._ckpt = RestartCheckpoints(self.uri, storage_options=self.storage_options)
        return self._ckpt

    def resume(self, trainer: Any) -> str | None:
        """Restores the newest commit into `trainer` and returns a checkpoint
        directory for ``trainer.train(resume_from_checkpoint=...)``; None when
        nothing is committed (a fresh start). Collective. Needs
        ``args.max_steps`` > 0 (the scheduler is built for it)."""
        args: TrainingArguments = trainer.args
        if args.max_steps <= 0:
            raise ValueError("SpringbackCallback.resume: set TrainingArguments.max_steps "
                             "(the job's max_steps): the LR schedule and the commit at the "
                             "end are sized by it")
        ckpt = self._checkpoints()
        trainer.create_optimizer()
        trainer.create_scheduler(num_training_steps=args.max_steps, optimizer=trainer.optimizer)
        optimizer = _inner(trainer.optimizer, "optimizer")
        scheduler = _inner(trainer.lr_scheduler, "scheduler")
        step = ckpt.restore(trainer.model, optimizer, extra_state={SCHEDULER_KEY: scheduler})
        self.restored_step = self._saved_step = step
        if step == 0:
            return None
        directory = os.path.join(self.resume_dir or tempfile.mkdtemp(prefix="springback-hf-"),
                                 f"checkpoint-{step}")
        _write_trainer_checkpoint(directory, trainer, optimizer, scheduler, step)
        log.info("resuming the Trainer at step %d (%s)", step, directory)
        return directory

    # -- callbacks -----------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        self._checkpoints()
        self._watch.install()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self._last_loss = float(logs["loss"])
            self._checkpoints().report(state.global_step, loss=self._last_loss)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    model: torch.nn.Module | None = None, optimizer: Any = None,
                    lr_scheduler: Any = None, **kwargs: Any) -> None:
        step = state.global_step
        ckpt = self._checkpoints()
        ckpt.report(step, loss=self._last_loss)
        reason = self._watch.agreed()
        if reason or self.every_steps and step % self.every_steps == 0:
            self._save(step, model, optimizer, lr_scheduler, wait=bool(reason))
        if reason:  # the Trainer logs this step, then ends in on_train_end
            self.drained = reason
            control.should_training_stop = True

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     model: torch.nn.Module | None = None, optimizer: Any = None,
                     lr_scheduler: Any = None, **kwargs: Any) -> None:
        """The final state, committed before ``train()`` returns (close waits)."""
        ckpt = self._checkpoints()
        if state.global_step > self._saved_step:
            self._save(state.global_step, model, optimizer, lr_scheduler, wait=True)
        ckpt.report(state.global_step, loss=self._last_loss)
        ckpt.close()
        self._watch.uninstall()
        if self.drained:
            log.warning("stopped at step %d (%s): drain checkpoint committed",
                        state.global_step, self.drained)
            raise SystemExit(DRAINED_EXIT_CODE)

    def _save(self, step: int, model: torch.nn.Module | None, optimizer: Any,
              lr_scheduler: Any, *, wait: bool) -> None:
        assert model is not None, "the Trainer passes its model to callbacks"
        extra = {SCHEDULER_KEY: _inner(lr_scheduler, "scheduler")} if lr_scheduler else None
        self._checkpoints().save(step, model, _inner(optimizer, "optimizer"), wait=wait,
                                 extra_state=extra)
        self._saved_step = step


def _write_trainer_checkpoint(directory: str, trainer: Any, optimizer: torch.optim.Optimizer,
                              scheduler: Any, step: int) -> None:
    """What ``Trainer.train(resume_from_checkpoint=directory)`` reads: the
    weights, optimizer.pt, scheduler.pt and trainer_state.json (its global
    step decides how far the data loader is fast-forwarded). Local to this
    process; written by every rank."""
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME

    from safetensors.torch import save_model
    from transformers.utils import SAFE_WEIGHTS_NAME

    os.makedirs(directory, exist_ok=True)
    # Not ``save_pretrained``: once torch.distributed is initialized it writes
    # on global rank 0 only (transformers 5: should_save_on_this_rank), and
    # every other rank's directory would lack the weights ("Can't find a valid
    # checkpoint"). The Trainer loads model.safetensors (non-strict: a tied
    # weight written once is enough); `save_model` drops tied duplicates.
    save_model(trainer.model, os.path.join(directory, SAFE_WEIGHTS_NAME))
    torch.save(optimizer.state_dict(), os.path.join(directory, OPTIMIZER_NAME))
    torch.save(scheduler.state_dict(), os.path.join(directory, SCHEDULER_NAME))
    state = TrainerState(global_step=step, max_steps=trainer.args.max_steps,
                         logging_steps=trainer.args.logging_steps,
                         save_steps=trainer.args.save_steps,
                         train_batch_size=trainer._train_batch_size)  # noqa: SLF001
    state.save_to_json(os.path.join(directory, TRAINER_STATE_NAME))
