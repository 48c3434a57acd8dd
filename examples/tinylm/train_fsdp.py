"""The tinylm example in the sharded-model form: FSDP2 / HSDP with `fully_shard`.

The same model and data as train.py; the library builds the model on each
generation's mesh (replicate x shard: the planner shards inside a node and
replicates across nodes unless the job's ``layout.shard`` says otherwise) and
reshards its state in memory when nodes leave or join.

    springback job submit examples/tinylm/job_fsdp.yaml
    springback run --job JOB --nproc-per-node 2 -- python examples/tinylm/train_fsdp.py
    python examples/tinylm/train_fsdp.py                  # standalone, one rank

Set TINYLM_MAX_STEPS to shorten a standalone run.
"""

from __future__ import annotations

import logging
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from springback.worker import Session

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import SEQ_LEN, VOCAB, TinyLM, load_windows  # noqa: E402 - the DDP example's model


def build(mesh):  # noqa: ANN001, ANN201 - (DeviceMesh) -> (model, optimizer)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyLM()
    dp = mesh["replicate", "shard"]
    for block in model.blocks.layers:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(levelname)s %(message)s")
    torch.set_num_threads(1)
    windows = load_windows()
    max_steps = int(os.environ.get("TINYLM_MAX_STEPS", "300"))
    session = Session(build=build, num_samples=len(windows), global_batch_size=24, seed=0,
                      max_steps=max_steps)
    for gen in session.generations():
        with gen:
            model, opt = gen.model, gen.optimizer
            for batch in gen.batches():
                seqs = windows[torch.as_tensor(batch.indices)]
                logits = model(seqs[:, :-1])
                per_token = F.cross_entropy(logits.reshape(-1, VOCAB), seqs[:, 1:].reshape(-1),
                                            reduction="none").view(len(seqs), SEQ_LEN)
                per_sample = per_token.mean(dim=1)
                (per_sample.sum() * batch.loss_scale).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                loss = per_sample.mean().item() if len(per_sample) else 0.0
                gen.report(loss=loss)
                if gen.rank == 0 and batch.step % 25 == 0:
                    logging.info("step %d loss %.3f (ppl %.1f) world %d (replicate %d x shard "
                                 "%d) generation %d", batch.step, loss, math.exp(loss),
                                 gen.world_size, gen.layout.replicate, gen.layout.shard,
                                 gen.generation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
