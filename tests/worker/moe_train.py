"""A tiny mixture-of-experts training script for the expert-parallel tests,
in the library's sharded-model form (`Session(build=...)`), next to
fsdp_train.py and with its audit records.

The model: a router (a ``[8, E]`` weight, replicated on every rank) picks
the top-``K`` of ``E`` experts for each sample (aux-loss-free balancing: a
per-expert bias, a persistent buffer, steers the choice, not the gates);
the experts are two-layer MLPs stacked as ``[E, ...]`` parameters placed
``(Replicate(), Shard(0))`` on `springback.worker.expert_mesh`'s
``("edp", "ep")`` view, so each rank of an expert group holds ``E / ep`` of
them and the groups are replicas. A sample goes to the rank holding its
expert and its output comes back by ``all_to_all_single`` over the ``ep``
group (gloo on CPU; the functional collectives' autograd form carries the
gradients back the same way).

Every parameter is a DTensor and the gradients are summed, not averaged:
each local gradient is a ``Partial`` over the dimensions the parameter is
replicated on and is reduced (``redistribute``) before the optimizer step,
so the loss is scaled by 1 / global batch size. Like fsdp_train.py it trains
a per-sample *counter* (replicated, float64) by plain SGD with the learning
rate equal to the global batch size (+1 per applied sample), records the
SHA-256 of the gathered full model and optimizer state at a generation's
start and at its clean end (``digest-g<generation>-r<rank>.jsonl``) and its
own pieces of the state after every step (tests/worker/pieces.py), checks its `AppliedSteps` entry
against the session's step, and writes the gathered counter as
``applied-*.json`` at the end; and which experts it holds at a start
(``experts-g<generation>-r<rank>.json``).

Failure semantics are the library's: a dead peer in a dispatch, a reduction
or the digests' gathers raises what a failed collective raises, which ends
the generation (``with gen:``) for the next plan.

Environment knobs: TINY_STEP_SLEEP_S slows each step; MOE_BALLAST_MB=N adds
a frozen, seeded N MiB parameter stacked per expert and sharded like the
experts (``ballast.``: ``[E, ...]``, ``(Replicate(), Shard(0))``), so each
rank of an expert group holds N / ep MiB: state large enough that a
reshard's transfer can be cut by a kill from outside. Never trained, it is
left out of the digests and pieces.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from draws import record_draw
from fsdp_train import NUM_COUNTED, AppliedSteps, features, record, record_applied
from pace import StepPace
from pieces import record_pieces
from springback.client.env import AUDIT_DIR
from springback.worker import Session, expert_mesh

NUM_EXPERTS, TOP_K, HIDDEN = 4, 2, 8
BALANCE_RATE = 0.01  # the bias step per expert and step, towards the mean load


def _on(mesh, full: torch.Tensor, placements) -> torch.nn.Parameter:  # noqa: ANN001
    """`full` (the same on every rank: seeded) as a DTensor parameter; no
    collective, so it works under the meta device too."""
    local = full
    for dim, p in enumerate(placements):
        if isinstance(p, Shard):
            local = local.chunk(mesh.size(dim), dim=p.dim)[mesh.get_local_rank(dim)]
    return torch.nn.Parameter(DTensor.from_local(local.contiguous(), mesh, placements,
                                                 run_check=False))


class Moe(torch.nn.Module):
    """Router and experts; `forward` dispatches over the mesh's ``ep`` group."""

    def __init__(self, mesh) -> None:  # noqa: ANN001 - the expert view
        super().__init__()
        replicated, experts = (Replicate(), Replicate()), (Replicate(), Shard(0))
        self.router = _on(mesh, torch.randn(8, NUM_EXPERTS) * 0.5, replicated)
        self.w1 = _on(mesh, torch.randn(NUM_EXPERTS, 8, HIDDEN) * 0.3, experts)
        self.b1 = _on(mesh, torch.zeros(NUM_EXPERTS, HIDDEN), experts)
        self.w2 = _on(mesh, torch.randn(NUM_EXPERTS, HIDDEN) * 0.3, experts)
        self.register_buffer("bias", torch.zeros(NUM_EXPERTS))
        self.register_buffer("load", torch.zeros(NUM_EXPERTS, dtype=torch.float64))
        self.step_load: torch.Tensor | None = None  # the last forward's, summed over dp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.w1.device_mesh
        group, ep, ep_i = mesh.get_group("ep"), mesh.size(1), mesh.get_local_rank(1)
        per_rank = NUM_EXPERTS // ep
        n = x.shape[0]
        scores = torch.softmax(x @ local(self.router), dim=1)
        choice = torch.topk(scores.detach() + self.bias, TOP_K, dim=1).indices  # [n, K]
        gates = scores.gather(1, choice)
        expert = choice.reshape(-1)
        order = torch.argsort(expert, stable=True)  # by expert, so by the rank holding it
        sent_expert = expert[order]
        sent = x[torch.arange(n).repeat_interleave(TOP_K)[order]]
        counts = torch.bincount(sent_expert // per_rank, minlength=ep)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        out_splits, in_splits = received.tolist(), counts.tolist()
        their_x = funcol.all_to_all_single_autograd(sent, out_splits, in_splits, group)
        their_expert = torch.empty(sum(out_splits), dtype=torch.long)
        dist.all_to_all_single(their_expert, sent_expert, out_splits, in_splits, group=group)
        mine = their_expert - ep_i * per_rank
        w1, b1, w2 = (local(p) for p in (self.w1, self.b1, self.w2))
        hidden = torch.tanh(torch.bmm(their_x.unsqueeze(1), w1[mine]).squeeze(1) + b1[mine])
        outputs = funcol.all_to_all_single_autograd((hidden * w2[mine]).sum(dim=1), in_splits,
                                                    out_splits, group)
        per_choice = outputs[torch.argsort(order)].view(n, TOP_K)
        # the step's load over every dp rank (a sum), for `balance`
        routed = torch.bincount(expert, minlength=NUM_EXPERTS).to(torch.float64)
        self.step_load = DTensor.from_local(routed, mesh, (Partial(), Partial()),
                                            run_check=False).full_tensor()
        return (gates * per_choice).sum(dim=1) + 0.5

    @torch.no_grad()
    def balance(self) -> None:
        """Moves the routing bias towards the mean load (the same on every
        rank: from the summed step load)."""
        assert self.step_load is not None
        self.load += self.step_load
        self.bias += BALANCE_RATE * torch.sign(self.step_load.mean() - self.step_load).float()


def local(p: torch.Tensor) -> torch.Tensor:
    """`p`'s local data, its gradient a Partial on the dims `p` is replicated on."""
    assert isinstance(p, DTensor)
    grads = [Partial() if isinstance(q, Replicate) else q for q in p.placements]
    return p.to_local(grad_placements=grads)


class Ballast(torch.nn.Module):
    """MOE_BALLAST_MB: a frozen parameter, only held and moved."""

    def __init__(self, mesh, mib: int) -> None:  # noqa: ANN001
        super().__init__()
        self.weight = _on(mesh, torch.rand(NUM_EXPERTS, mib * 2**18 // NUM_EXPERTS),
                          (Replicate(), Shard(0)))
        self.weight.requires_grad_(False)


class Counter(torch.nn.Module):
    def __init__(self, mesh) -> None:  # noqa: ANN001
        super().__init__()
        self.weight = _on(mesh, torch.zeros(NUM_COUNTED, dtype=torch.float64),
                          (Replicate(), Replicate()))

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return local(self.weight)[indices]


class Net(torch.nn.Module):
    def __init__(self, mesh) -> None:  # noqa: ANN001
        super().__init__()
        self.moe = Moe(mesh)
        self.counter = Counter(mesh)
        ballast_mb = int(os.environ.get("MOE_BALLAST_MB", "0"))
        if ballast_mb:
            self.ballast = Ballast(mesh, ballast_mb)

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.moe(x), self.counter(indices)


def build(mesh):  # noqa: ANN001, ANN201 - the form a user writes
    torch.manual_seed(0)
    model = Net(expert_mesh(mesh))
    trained = [p for n, p in model.named_parameters()
               if not n.startswith(("counter.", "ballast."))]
    return model, torch.optim.AdamW(trained, lr=0.05)


def reduce_gradients(model: torch.nn.Module) -> None:
    """Sums every Partial gradient over its mesh (collective)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, indices: torch.Tensor,
               global_batch_size: int) -> torch.Tensor:
    """One step on this rank's `indices` (collective); the per-sample losses."""
    x, y = features(indices.to(torch.float32))
    prediction, counted = model(x, indices)
    per_sample = (prediction - y) ** 2
    loss = (per_sample.sum() - counted.sum()) / global_batch_size
    loss.backward()
    reduce_gradients(model)
    opt.step()
    counter = model.counter.weight
    with torch.no_grad():  # plain SGD, lr = B: +1 per applied sample
        counter.add_(counter.grad, alpha=-global_batch_size)
    model.moe.balance()
    opt.zero_grad()
    counter.grad = None
    return per_sample.detach()


def record_experts(gen) -> None:  # noqa: ANN001
    """Appends the experts this rank holds at a generation's start to
    ``experts-g<generation>-r<rank>.json`` (the test checks they are split
    over ep)."""
    audit = os.environ.get(AUDIT_DIR)
    if audit:
        w1 = gen.model.moe.w1
        ep, ep_i = w1.device_mesh.size(1), w1.device_mesh.get_local_rank(1)
        first = ep_i * (NUM_EXPERTS // ep)
        with open(os.path.join(audit, f"experts-g{gen.generation:04d}-r{gen.rank}.json"),
                  "w", encoding="utf-8") as f:
            json.dump({"world_size": gen.world_size, "ep": ep,
                       "experts": [first, first + w1.to_local().shape[0]]}, f)


def main() -> int:
    torch.set_num_threads(1)
    applied = AppliedSteps()
    session = Session(build=build, state={"applied": applied}, num_samples=NUM_COUNTED,
                      global_batch_size=12, max_steps=40)
    pace = StepPace()
    for gen in session.generations():
        with gen:
            model, opt = gen.model, gen.optimizer
            record(gen, "start", session.step)
            record_experts(gen)
            for batch in gen.batches():
                record_draw(batch.step, gen.generation, gen.rank)
                if applied.count != batch.step - 1:
                    raise ValueError(f"state= entry at step {applied.count}, shards at step "
                                     f"{batch.step - 1}")
                per_sample = train_step(model, opt, torch.as_tensor(batch.indices),
                                        batch.global_batch_size)
                applied.count = batch.step
                record_pieces(gen, batch.step)
                gen.report(loss=per_sample.mean().item() if len(per_sample) else 0.0)
                pace.wait(batch.step)
            record(gen, "end", session.step)  # a clean end: every rank is here
            if session.step >= gen.max_steps:
                record_applied(gen, session.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
