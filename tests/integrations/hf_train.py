"""Test script: a 2-layer GPT-2 built from a config, trained by Hugging Face's
``Trainer`` under ``springback run`` with `SpringbackCallback` (the recipe of
docs/trainers.md, plus an audit for the test).

Environment: TRAIN_AUDIT (a JSON-lines file: every rank writes the sample ids
of each step it starts, global rank 0 the loss of each step it finishes),
MAX_STEPS, CKPT_EVERY, STEP_SLEEP_S, GLOBAL_BATCH."""

from __future__ import annotations

import json
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from springback.integrations import per_rank_batch_size
from springback.integrations.hf import SpringbackCallback

NUM_SAMPLES, SEQ, VOCAB = 64, 16, 32
GENERATION = int(os.environ.get("SPRINGBACK_GENERATION", "0"))
RANK = int(os.environ.get("RANK", "0"))


def audit(**record) -> None:
    with open(os.environ["TRAIN_AUDIT"], "a", encoding="utf-8") as f:
        f.write(json.dumps({"gen": GENERATION, "rank": RANK, **record}) + "\n")


class Patterns(torch.utils.data.Dataset):
    """Sample i: an arithmetic sequence mod VOCAB (learnable: the loss falls)."""

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> dict:
        start, stride = (i * 7) % VOCAB, 1 + i % 3
        ids = torch.tensor([(start + k * stride) % VOCAB for k in range(SEQ)])
        return {"input_ids": ids, "labels": ids, "idx": i}


class AuditedTrainer(Trainer):
    def compute_loss(self, model, inputs, *args, **kwargs):
        audit(step=self.state.global_step + 1, idx=inputs.pop("idx").tolist())
        time.sleep(float(os.environ.get("STEP_SLEEP_S", "0")))
        return super().compute_loss(model, inputs, *args, **kwargs)


class LossAudit(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if RANK == 0 and logs and "loss" in logs:
            audit(step=state.global_step, loss=logs["loss"])


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), f"hf-out-{os.getpid()}"),
        max_steps=int(os.environ["MAX_STEPS"]), learning_rate=3e-3, warmup_steps=5,
        per_device_train_batch_size=per_rank_batch_size(int(os.environ.get("GLOBAL_BATCH", "8"))),
        save_strategy="no", logging_steps=1, report_to=[], remove_unused_columns=False,
        dataloader_drop_last=True, use_cpu=True, disable_tqdm=True, seed=0)
    springback = SpringbackCallback(every_steps=int(os.environ["CKPT_EVERY"]))
    trainer = AuditedTrainer(model=model, args=args, train_dataset=Patterns(),
                             callbacks=[springback, LossAudit()])
    resume = springback.resume(trainer)
    if RANK == 0:
        print(f"rank 0/{args.world_size}: starting at step {springback.restored_step}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    if RANK == 0:
        print(f"done at step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
