"""The tinylm example as a mixture of experts, the experts sharded over ep.

The same data and loss as train.py; in every block the MLP is replaced by
`NUM_EXPERTS` expert MLPs and a router that sends each token to its top
`TOP_K` experts, weighted by the router's softmax gates. Balancing is
aux-loss free: a per-expert routing bias (a buffer) steers the choice
towards the less loaded experts, not the gates.

Expert parallel: each layer's experts are stacked ``[E, ...]`` parameters
placed ``(Replicate(), Shard(0))`` on `springback.worker.expert_mesh`'s
``("edp", "ep")`` view of the data-parallel ranks, so each rank of an
expert group (ep consecutive dp ranks, inside a node with job_moe.yaml)
holds ``E / ep`` of them and the groups are replicas. A token goes to the
rank holding its expert and its output comes back by ``all_to_all_single``
over the ``ep`` group (the functional collectives' autograd form carries the
gradients back the same way). The rest of the model (embeddings, attention,
norms, routers, head) is plain tensors, the same on every rank and declared
``Session(replicated=...)``.

Gradients are summed, not averaged: the loss is scaled by 1 / global batch
size, the plain parameters' gradients are all-reduced over the dp ranks
(the whole generation group: no tp, no pp) and the experts' are reduced
over ``edp`` (each local gradient a ``Partial`` there) before the optimizer
step. A node lost keeps every expert on the survivors' replicas and a join
takes them from there, in memory (``deploy/local/demo.sh --moe``).

    springback job submit examples/tinylm/job_moe.yaml
    springback run --job JOB --nproc-per-node 2 -- python examples/tinylm/train_moe.py
    python examples/tinylm/train_moe.py                 # standalone: one rank, ep 1

Failure semantics are the library's: a dead peer in a dispatch or a
reduction raises what a failed collective raises, which ends the generation
(``with gen:``) so the ranks start the next plan from the state they hold;
a layout with tp or pp > 1 raises ValueError at the generation's start (this
script is data x expert parallel only), as does a corpus too short for the
job's num_samples.

Set TINYLM_MAX_STEPS to shorten a standalone run.
"""

from __future__ import annotations

import logging
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from springback.worker import Session, expert_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import SEQ_LEN, VOCAB, load_windows  # noqa: E402 - the DDP example's data

D_MODEL, N_HEADS, N_LAYERS = 96, 4, 2
NUM_EXPERTS, TOP_K, EXPERT_HIDDEN = 4, 2, 2 * D_MODEL  # top-2 of half-width experts:
BALANCE_RATE = 0.01  # the bias step per expert and step          the dense MLP's compute


EXPERT_PARAMS = ("w1", "b1", "w2", "b2")
"""Each `Experts` module's stacked ``[E, ...]`` parameters, sharded over ep."""


def shard_experts(model: nn.Module, mesh) -> None:  # noqa: ANN001 - the expert view
    """Replaces every `Experts` module's stacked parameters (the same on
    every rank: seeded) by DTensors placed ``(Replicate(), Shard(0))``:
    this rank keeps its slice of the experts. No collective (so it also
    runs on the meta device)."""
    for module in model.modules():
        if isinstance(module, Experts):
            for name in EXPERT_PARAMS:
                full = getattr(module, name).detach()
                mine = full.chunk(mesh.size(1), dim=0)[mesh.get_local_rank(1)]
                setattr(module, name, nn.Parameter(DTensor.from_local(
                    mine.contiguous(), mesh, (Replicate(), Shard(0)), run_check=False)))


def local(p: DTensor) -> torch.Tensor:
    """`p`'s local data; its gradient a Partial over edp, reduced before the step."""
    return p.to_local(grad_placements=(Partial(), Shard(0)))


class Experts(nn.Module):
    """A top-k routed mixture of expert MLPs; `forward` dispatches tokens to
    the ranks of the ``ep`` group that hold their experts and back (after
    `shard_experts`)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D_MODEL, NUM_EXPERTS, bias=False)
        self.w1 = nn.Parameter(torch.randn(NUM_EXPERTS, D_MODEL, EXPERT_HIDDEN)
                               / math.sqrt(D_MODEL))
        self.b1 = nn.Parameter(torch.zeros(NUM_EXPERTS, EXPERT_HIDDEN))
        self.w2 = nn.Parameter(torch.randn(NUM_EXPERTS, EXPERT_HIDDEN, D_MODEL)
                               / math.sqrt(EXPERT_HIDDEN))
        self.b2 = nn.Parameter(torch.zeros(NUM_EXPERTS, D_MODEL))
        self.register_buffer("bias", torch.zeros(NUM_EXPERTS))
        self.step_load = torch.zeros(NUM_EXPERTS)  # this rank's routed tokens, last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.w1.device_mesh
        group, ep, ep_rank = mesh.get_group("ep"), mesh.size(1), mesh.get_local_rank(1)
        per_rank = NUM_EXPERTS // ep
        tokens = x.reshape(-1, D_MODEL)
        scores = torch.softmax(self.router(tokens), dim=1)
        choice = torch.topk(scores.detach() + self.bias, TOP_K, dim=1).indices  # [n, K]
        gates = scores.gather(1, choice)
        expert = choice.reshape(-1)
        order = torch.argsort(expert, stable=True)  # by expert, so by the rank holding it
        sent_expert = expert[order]
        sent = tokens[torch.arange(len(tokens)).repeat_interleave(TOP_K)[order]]
        counts = torch.bincount(sent_expert // per_rank, minlength=ep)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        out_splits, in_splits = received.tolist(), counts.tolist()
        their_tokens = funcol.all_to_all_single_autograd(sent, out_splits, in_splits, group)
        their_expert = torch.empty(sum(out_splits), dtype=torch.long)
        dist.all_to_all_single(their_expert, sent_expert, out_splits, in_splits, group=group)
        mine = their_expert - ep_rank * per_rank
        w1, b1, w2, b2 = (local(p) for p in (self.w1, self.b1, self.w2, self.b2))
        outputs = torch.zeros_like(their_tokens)
        for e in range(per_rank):
            rows = (mine == e).nonzero().squeeze(1)
            hidden = F.gelu(their_tokens[rows] @ w1[e] + b1[e])
            outputs = outputs.index_add(0, rows, hidden @ w2[e] + b2[e])
        returned = funcol.all_to_all_single_autograd(outputs, in_splits, out_splits, group)
        per_choice = returned[torch.argsort(order)].view(len(tokens), TOP_K, D_MODEL)
        self.step_load = torch.bincount(expert, minlength=NUM_EXPERTS).float()
        return (gates.unsqueeze(2) * per_choice).sum(dim=1).view_as(x)


class Block(nn.Module):
    """A pre-norm causal transformer block with a mixture of experts as its MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attn = nn.MultiheadAttention(D_MODEL, N_HEADS, batch_first=True)
        self.moe = Experts()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)[0]
        return x + self.moe(self.ln2(x))


class TinyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.zeros(SEQ_LEN, D_MODEL))
        self.layers = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ_LEN),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.layers:
            x = block(x, self.mask)
        return self.head(self.norm(x))




REPLICATED = [name for name, _ in TinyMoE().named_parameters()
              if not (".moe." in name and name.rsplit(".", 1)[1] in EXPERT_PARAMS)]
"""The plain parameters: the same on every rank (seeded, gradients summed over dp)."""


def build(mesh):  # noqa: ANN001, ANN201 - (DeviceMesh) -> (model, optimizer)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyMoE()
    shard_experts(model, expert_mesh(mesh))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def reduce_gradients(model: TinyMoE, group: dist.ProcessGroup | None) -> None:
    """Sums the gradients over the data-parallel ranks (collective): the
    plain parameters' in one flat all-reduce over `group`, the experts'
    Partial gradients over edp."""
    plain = [p.grad for p in model.parameters()
             if p.grad is not None and not isinstance(p, DTensor)]
    if group is not None and plain:
        flat = torch.cat([g.reshape(-1) for g in plain])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in plain:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
    for p in model.parameters():
        if p.grad is not None and isinstance(p, DTensor):
            p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)


@torch.no_grad()
def balance(model: TinyMoE, group: dist.ProcessGroup | None) -> None:
    """Moves every layer's routing bias towards its mean load, the loads
    summed over the dp ranks (one collective), so the bias stays the same
    on every rank."""
    loads = torch.stack([block.moe.step_load for block in model.layers])
    if group is not None:
        dist.all_reduce(loads, group=group)
    for block, load in zip(model.layers, loads):
        block.moe.bias += BALANCE_RATE * torch.sign(load.mean() - load)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(levelname)s %(message)s")
    torch.set_num_threads(1)
    windows = load_windows()
    max_steps = int(os.environ.get("TINYLM_MAX_STEPS", "300"))
    session = Session(build=build, num_samples=len(windows), global_batch_size=24, seed=0,
                      max_steps=max_steps, replicated=REPLICATED)
    for gen in session.generations():
        with gen:
            if gen.layout.tp > 1 or gen.layout.pp > 1:
                raise ValueError(f"train_moe.py is data x expert parallel only: the plan's "
                                 f"layout has tp={gen.layout.tp}, pp={gen.layout.pp}")
            if gen.stream.num_samples > len(windows):
                raise ValueError(f"data.num_samples={gen.stream.num_samples} but corpus.txt "
                                 f"has only {len(windows)} windows of {SEQ_LEN + 1} chars")
            model, opt = gen.model, gen.optimizer
            dp_group = gen.group if gen.world_size > 1 else None  # tp = pp = 1: dp is everyone
            for batch in gen.batches():
                seqs = windows[torch.as_tensor(batch.indices)]
                logits = model(seqs[:, :-1])
                per_token = F.cross_entropy(logits.reshape(-1, VOCAB), seqs[:, 1:].reshape(-1),
                                            reduction="none").view(len(seqs), SEQ_LEN)
                per_sample = per_token.mean(dim=1)
                (per_sample.sum() / batch.global_batch_size).backward()
                reduce_gradients(model, dp_group)
                opt.step()
                opt.zero_grad(set_to_none=True)
                balance(model, dp_group)
                loss = per_sample.mean().item() if len(per_sample) else 0.0
                gen.report(loss=loss)
                if gen.rank == 0 and batch.step % 25 == 0:
                    logging.info("step %d loss %.3f (ppl %.1f) world %d (dp %d, ep %d) "
                                 "generation %d", batch.step, loss, math.exp(loss),
                                 gen.world_size, gen.dp_size, gen.layout.ep, gen.generation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
