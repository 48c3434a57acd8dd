"""The tinylm example in 3-D: pipeline stages x tensor parallel x FSDP2.

The same data and loss as train.py, on a TinyLM whose attention and MLP are
built from separate linear layers so they can be split:

* pipeline (``mesh["pp"]``, across nodes): the blocks ``layers.0`` ..
  ``layers.{N_LAYERS-1}`` are split into contiguous stages by
  `springback.worker.stage_layers`; stage 0 also holds the embeddings, the
  last stage the final norm and the output head. `build` returns this rank's
  stage, the full model less the other stages' layers, so the state keeps the
  global names whichever stage holds a layer. A step runs GPipe
  (`torch.distributed.pipelining.ScheduleGPipe`) with `MICROBATCHES`
  micro-batches of this data-parallel rank's share of the batch.
* tensor parallel (``mesh["tp"]``, inside a node): in every block q, k, v and
  the first MLP layer are column-wise, the attention output and the second
  MLP layer row-wise (Megatron style: each tp rank runs N_HEADS / tp heads).
* FSDP2 over the data-parallel dims (``mesh["replicate", "shard"]``): every
  block and the stage as a whole. With job_3d.yaml's two nodes of two ranks
  (tp 2 x pp 2) dp is 1 and FSDP2 holds whole tensors; with more nodes (dp > 1)
  it shards them.

With ``layout.min_pp: 1`` a node lost with no spare re-partitions the
pipeline: the survivors run pp 1 (every layer on one node, still tp 2), the
lost stage's layers filled in memory from its peer copy on the surviving
node (the steps since that copy are trained again on the same samples); a
joining node grows it back to pp 2. The demo shows this:
``deploy/local/demo.sh --3d``.

    springback job submit examples/tinylm/job_3d.yaml
    springback run --job JOB --nproc-per-node 2 -- python examples/tinylm/train_3d.py
    python examples/tinylm/train_3d.py                  # standalone: one rank, pp 1, tp 1

Failure semantics are the library's: a dead peer in a pipeline send, a
tensor-parallel or FSDP collective raises what a failed collective raises,
which ends the generation (``with gen:``) so the ranks start the next plan
from the state they hold; any other error (a bad corpus, a bug) ends the rank.

Set TINYLM_MAX_STEPS to shorten a standalone run.
"""

from __future__ import annotations

import logging
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from springback.worker import Session, stage_layers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import SEQ_LEN, VOCAB, load_windows  # noqa: E402 - the DDP example's data

D_MODEL, N_HEADS, N_LAYERS = 96, 4, 4
MICROBATCHES = 2


class Block(nn.Module):
    """A pre-norm causal transformer block whose projections are separate
    linear layers (tensor-parallel friendly). Under TP, q/k/v hold this
    rank's heads, so the head count is read from the local width."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = D_MODEL // N_HEADS
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.q, self.k, self.v = (nn.Linear(D_MODEL, D_MODEL) for _ in range(3))
        self.o = nn.Linear(D_MODEL, D_MODEL)
        self.fc1, self.fc2 = nn.Linear(D_MODEL, 4 * D_MODEL), nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = (proj(h).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).flatten(2))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM3D(nn.Module):
    """The full model; a pipeline stage is this with the other stages'
    parts set to None / deleted (`stage_of`)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok: nn.Embedding | None = nn.Embedding(VOCAB, D_MODEL)
        self.pos: nn.Parameter | None = nn.Parameter(torch.zeros(SEQ_LEN, D_MODEL))
        self.layers = nn.ModuleDict({str(i): Block() for i in range(N_LAYERS)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(D_MODEL)
        self.head: nn.Linear | None = nn.Linear(D_MODEL, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:  # the first stage: tokens in
            x = self.tok(x) + self.pos[: x.shape[1]]
        for block in self.layers.values():
            x = block(x)
        if self.head is not None:  # the last stage: logits out
            x = self.head(self.norm(x))
        return x


def stage_of(model: TinyLM3D, mesh) -> TinyLM3D:  # noqa: ANN001
    """`model` less what the other pipeline stages hold."""
    kept = stage_layers(mesh, N_LAYERS)
    for i in range(N_LAYERS):
        if i not in kept:
            del model.layers[str(i)]
    if kept.start != 0:
        model.tok = model.pos = None
    if kept.stop != N_LAYERS:
        model.norm = model.head = None
    return model


def build(mesh):  # noqa: ANN001, ANN201 - (DeviceMesh) -> (this rank's stage, its optimizer)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = stage_of(TinyLM3D(), mesh)
    if mesh["tp"].size() > 1:
        for block in model.layers.values():
            parallelize_module(block, mesh["tp"], {
                "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                "o": RowwiseParallel(), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    dp = mesh["replicate", "shard"]
    for block in model.layers.values():
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross entropy of each sequence."""
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                                reduction="none")
    return per_token.view(len(targets), -1).mean(dim=1)


class Pipeline:
    """This rank's stage over ``mesh["pp"]`` and a GPipe schedule of it,
    made once per generation (a generation has new process groups)."""

    def __init__(self, model: TinyLM3D, mesh, loss_scale: float) -> None:  # noqa: ANN001
        pp = mesh["pp"]
        self.last = pp.get_local_rank() == pp.size() - 1
        self.first = pp.get_local_rank() == 0
        self.loss_scale = loss_scale
        stage = PipelineStage(model, pp.get_local_rank(), pp.size(), torch.device("cpu"),
                              group=pp.get_group())

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return per_sample_loss(logits, targets).sum() * loss_scale

        self.schedule = ScheduleGPipe(stage, MICROBATCHES, loss_fn=loss_fn, scale_grads=False)

    def step(self, seqs: torch.Tensor) -> float:
        """Forward and backward of one batch (collective over the stages);
        on the last stage the sum of the per-sample losses, elsewhere NaN."""
        if self.first:
            self.schedule.step(seqs[:, :-1])
            return float("nan")
        if not self.last:
            self.schedule.step()
            return float("nan")
        losses: list[torch.Tensor] = []
        self.schedule.step(target=seqs[:, 1:], losses=losses)
        return sum(loss.item() for loss in losses) / self.loss_scale


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(levelname)s %(message)s")
    torch.set_num_threads(1)
    windows = load_windows()
    max_steps = int(os.environ.get("TINYLM_MAX_STEPS", "300"))
    session = Session(build=build, num_samples=len(windows), global_batch_size=24, seed=0,
                      max_steps=max_steps)
    for gen in session.generations():
        with gen:
            if gen.stream.num_samples > len(windows):
                raise ValueError(f"data.num_samples={gen.stream.num_samples} but corpus.txt "
                                 f"has only {len(windows)} windows of {SEQ_LEN + 1} chars")
            model, opt, mesh = gen.model, gen.optimizer, gen.mesh
            pp, tp = mesh["pp"], mesh["tp"]
            # the step's loss is this rank's report when it is its dp rank's last
            # stage's first tp rank (gen.report's rule); logged by dp rank 0's
            counts_loss = pp.get_local_rank() == pp.size() - 1 and tp.get_local_rank() == 0
            pipeline: Pipeline | None = None
            for batch in gen.batches():
                seqs = windows[torch.as_tensor(batch.indices)]
                if pp.size() > 1:
                    pipeline = pipeline or Pipeline(model, mesh, batch.loss_scale)
                    loss_sum = pipeline.step(seqs)
                else:
                    per_sample = per_sample_loss(model(seqs[:, :-1]), seqs[:, 1:])
                    (per_sample.sum() * batch.loss_scale).backward()
                    loss_sum = per_sample.sum().item()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if counts_loss:
                    loss = loss_sum / max(len(seqs), 1)
                    gen.report(loss=loss)
                    if gen.dp_rank == 0 and batch.step % 25 == 0:
                        logging.info("step %d loss %.3f (ppl %.1f) on dp rank 0, world %d "
                                     "(pp %d x dp %d x tp %d) generation %d", batch.step, loss,
                                     math.exp(loss), gen.world_size, gen.layout.pp,
                                     gen.dp_size, gen.layout.tp, gen.generation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
