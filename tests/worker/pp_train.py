"""A tiny pipeline-parallel training script for the DP x PP tests, in the
library's sharded-model form (`Session(build=...)`), next to fsdp_train.py
and moe_train.py and with their audit records.

The model: four layers ``layers.0`` .. ``layers.3`` (Linear 8-16-16-16-1,
tanh between them) and a per-sample ``counter``. `build` keeps this rank's
stage of it (`springback.worker.stage_layers` over the mesh's ``pp``
dimension), deleting the other stages' layers, so the state keeps the full
model's names whichever stage holds a layer; the counter lives on the last
stage. Every parameter is a plain tensor, the same on the stage's dp
replicas (declared ``Session(replicated=...)``). A step runs
`torch.distributed.pipelining`'s ``ScheduleGPipe`` over ``mesh["pp"]``'s
group with `MICROBATCHES` micro-batches of this dp rank's share of the
global batch (the loss a sum over samples / global batch size, so the
gradients are summed over micro-batches and, by an all-reduce over the
stage's ``replicate`` and ``shard`` groups, over the dp ranks).

The counter: after every optimizer step the last stage adds 1 to the entry
of every sample of the global batch (its dp ranks' indices, summed), so the
gathered counter at the end is the exactly-once audit's applied record.

Records, in ``digest-g<generation>-r<rank>.jsonl``, the SHA-256 of every
tensor of the full state gathered from every stage at a generation's start
and clean end, and of this rank's stage's tensors after every step (no
collective, so a kill before the next gather leaves the step on record);
``applied-*.json`` at the last step as fsdp_train.py; and the layers this
rank holds at a start (``stage-g<generation>-r<rank>.json``).

Failure semantics are the library's: a dead peer in a pipeline send, a
reduction or the digest's gathers raises what a failed collective raises,
which ends the generation (``with gen:``) for the next plan.

Environment knobs: TINY_STEP_SLEEP_S slows each step; PP_BALLAST_MB=N adds
a frozen, seeded parameter of N / 4 MiB to each layer (``ballast.<layer>``,
kept and deleted with its layer, so each stage of pp = 2 holds N / 2 MiB,
replicated on its dp ranks): state large enough that a join's transfer can
be cut by a kill from outside. Never trained, it is left out of the digests
(``own_state``).
"""

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from draws import record_draw
from fsdp_train import NUM_COUNTED, AppliedSteps, features
from pace import StepPace
from springback.client.env import AUDIT_DIR
from springback.worker import Session, stage_layers

NUM_LAYERS, MICROBATCHES = 4, 2
WIDTHS = (8, 16, 16, 16, 1)
BALLAST_MB = int(os.environ.get("PP_BALLAST_MB", "0"))


class Ballast(torch.nn.Module):
    """PP_BALLAST_MB: a frozen parameter, only held and moved."""

    def __init__(self, mib: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(int(mib * 2**18)), requires_grad=False)


class Net(torch.nn.Module):
    """The full model; a stage is this with the other stages' layers deleted."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(WIDTHS[i], WIDTHS[i + 1])
                                           for i in range(NUM_LAYERS)})
        self.counter: torch.nn.Module | None = Counter()
        if BALLAST_MB:  # one per layer, with it in its stage
            self.ballast = torch.nn.ModuleDict({str(i): Ballast(BALLAST_MB / NUM_LAYERS)
                                                for i in range(NUM_LAYERS)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, layer in self.layers.items():
            x = layer(x)
            x = x.sum(dim=1) if int(name) == NUM_LAYERS - 1 else torch.tanh(x)
        return x


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(NUM_COUNTED, dtype=torch.float64),
                                         requires_grad=False)


with torch.device("meta"):  # names only: no ballast allocated
    REPLICATED = [name for name, _ in Net().named_parameters()]
    """Every parameter of every stage: plain tensors, the same on a stage's dp ranks."""


def stage_of(model: Net, mesh) -> Net:  # noqa: ANN001
    """`model` less the layers (and counter) of the other stages."""
    kept = stage_layers(mesh, NUM_LAYERS)
    for i in range(NUM_LAYERS):
        if i not in kept:
            del model.layers[str(i)]
            if BALLAST_MB:
                del model.ballast[str(i)]
    if NUM_LAYERS - 1 not in kept:
        model.counter = None
    return model


def build(mesh):  # noqa: ANN001, ANN201 - the form a user writes
    torch.manual_seed(0)
    model = stage_of(Net(), mesh)
    trained = [p for n, p in model.named_parameters()
               if not n.startswith(("counter.", "ballast."))]
    return model, torch.optim.AdamW(trained, lr=0.05)


def pipeline(model: Net, mesh, global_batch_size: int) -> ScheduleGPipe:  # noqa: ANN001
    """This rank's stage over ``mesh["pp"]`` and a GPipe schedule of it."""
    pp = mesh["pp"]
    stage = PipelineStage(model, pp.get_local_rank(), pp.size(), torch.device("cpu"),
                          group=pp.get_group())

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((output - target) ** 2).sum() / global_batch_size

    return ScheduleGPipe(stage, MICROBATCHES, loss_fn=loss_fn, scale_grads=False)


def dp_sum(t: torch.Tensor, mesh) -> None:  # noqa: ANN001
    """Sums `t` in place over this rank's stage's dp ranks (collective)."""
    for dim in ("replicate", "shard"):
        if mesh[dim].size() > 1:
            dist.all_reduce(t, group=mesh.get_group(dim))


def train_step(model: Net, opt: torch.optim.Optimizer, schedule: ScheduleGPipe, mesh,  # noqa: ANN001
               indices: torch.Tensor) -> float:
    """One pipelined step on this dp rank's `indices` (collective); the sum
    of the per-sample losses over the global batch."""
    x, y = features(indices.to(torch.float32))
    pp = mesh["pp"]
    first, last = pp.get_local_rank() == 0, pp.get_local_rank() == pp.size() - 1
    losses: list[torch.Tensor] = []
    if first and last:
        raise ValueError("pp_train.py needs pp > 1")
    if first:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    for p in model.parameters():
        if p.grad is not None:
            dp_sum(p.grad, mesh)
    # every collective of the step before the optimizer applies it: a peer lost
    # during one leaves no rank with a step half applied (the Session's
    # pre-hook of `opt.step()` is then the last collective before any change)
    applied = torch.bincount(indices, minlength=NUM_COUNTED).to(torch.float64)
    if last:
        dp_sum(applied, mesh)
    total = torch.tensor([float(sum(l.item() for l in losses))])
    dist.all_reduce(total)  # the last stage's losses over every dp rank
    opt.step()
    opt.zero_grad()
    if last:
        with torch.no_grad():
            model.counter.weight.add_(applied)
    return total.item()


def own_state(model: Net, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's stage of the model and optimizer state, by global key
    (less the ballast)."""
    out: dict[str, torch.Tensor] = {f"param/{n}": p.detach().clone()
                                    for n, p in model.named_parameters()
                                    if not n.startswith("ballast.")}
    for n, p in model.named_parameters():
        for name, value in opt.state.get(p, {}).items():
            out[f"optim/{n}/{name}"] = torch.as_tensor(value).clone()
    return out


def full_state(model: Net, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Collective: the full model and optimizer state gathered from every
    stage, by key; ValueError when two dp replicas of a stage differ."""
    everyone: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, own_state(model, opt))
    out: dict[str, torch.Tensor] = {}
    for theirs in everyone:
        for key, value in theirs.items():
            if key in out and not torch.equal(out[key], value):
                raise ValueError(f"the dp replicas of {key} differ")
            out[key] = value
    return out


def key_digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """SHA-256 of each tensor's bytes, by key."""
    return {key: hashlib.sha256(value.contiguous().numpy().tobytes()).hexdigest()
            for key, value in state.items()}


def write_digests(gen, entry: dict) -> None:  # noqa: ANN001
    """Appends `entry` (with the world size) to this rank's digest record."""
    audit = os.environ.get(AUDIT_DIR)
    if audit:
        with open(os.path.join(audit, f"digest-g{gen.generation:04d}-r{gen.rank}.jsonl"),
                  "a") as f:
            f.write(json.dumps({**entry, "world_size": gen.world_size}) + "\n")


def record(gen, when: str, step: int) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Collective: the full state gathered from every stage, its keys'
    digests written (``start``, ``end``)."""
    state = full_state(gen.model, gen.optimizer)
    write_digests(gen, {"when": when, "step": step, "keys": key_digests(state)})
    return state


def record_own(gen, step: int) -> None:  # noqa: ANN001
    """After a step, no collective: this rank's stage's keys' digests
    (``after``), so a step that a kill interrupts before the next gather is
    still on record."""
    write_digests(gen, {"when": "after", "step": step,
                 "keys": key_digests(own_state(gen.model, gen.optimizer))})


def record_stage(gen) -> None:  # noqa: ANN001
    """Writes the layers this rank holds at a generation's start."""
    audit = os.environ.get(AUDIT_DIR)
    if audit:
        with open(os.path.join(audit, f"stage-g{gen.generation:04d}-r{gen.rank}.json"),
                  "w", encoding="utf-8") as f:
            json.dump({"world_size": gen.world_size, "pp": gen.mesh["pp"].size(),
                       "layers": sorted(int(i) for i in gen.model.layers)}, f)


def record_applied(gen, state: dict[str, torch.Tensor], step: int) -> None:  # noqa: ANN001
    """Rank 0 writes the gathered counter for the exactly-once audit."""
    audit = os.environ.get(AUDIT_DIR)
    if audit and gen.rank == 0:
        path = os.path.join(audit, f"applied-p{os.getpid()}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"step": step, "counter": state["param/counter.weight"].tolist()}, f)
        os.replace(path + ".tmp", path)


def main() -> int:
    torch.set_num_threads(1)
    applied = AppliedSteps()
    session = Session(build=build, state={"applied": applied}, num_samples=NUM_COUNTED,
                      global_batch_size=12, max_steps=40, replicated=REPLICATED)
    pace = StepPace()
    for gen in session.generations():
        with gen:
            model, opt, mesh = gen.model, gen.optimizer, gen.mesh
            record(gen, "start", session.step)
            record_stage(gen)
            schedule = None
            for batch in gen.batches():
                record_draw(batch.step, gen.generation, gen.rank)
                if applied.count != batch.step - 1:
                    raise ValueError(f"state= entry at step {applied.count}, shards at step "
                                     f"{batch.step - 1}")
                schedule = schedule or pipeline(model, mesh, batch.global_batch_size)
                loss = train_step(model, opt, schedule, mesh, torch.as_tensor(batch.indices))
                applied.count = batch.step
                record_own(gen, batch.step)
                gen.report(loss=loss / batch.global_batch_size)
                pace.wait(batch.step)
            state = record(gen, "end", session.step)  # a clean end: every rank is here
            if session.step >= gen.max_steps:
                record_applied(gen, state, session.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
