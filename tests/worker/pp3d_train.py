"""A tiny 3-D parallel training script (FSDP x TP x PP) for
tests/worker/test_3d_parallel.py, in the library's sharded-model form
(`Session(build=...)`), with pp_train.py's audit records.

The model is pp_train.py's: four layers ``layers.0`` .. ``layers.3``
(Linear 8-16-16-16-1, tanh between them) and a per-sample ``counter`` on the
last stage. `build` keeps this rank's pipeline stage (pp_train.stage_of over
``mesh["pp"]``), makes the stage's layers tensor parallel on ``mesh["tp"]``
(even layers column-wise, odd layers row-wise, so a stage of two layers
takes a replicated input and gives a replicated output) and then
``fully_shard``s each layer over the data-parallel dims
``mesh["replicate", "shard"]``: every trained parameter and its AdamW state
is a DTensor over (replicate, shard, tp). The counter stays a plain tensor,
the same on every rank of the last stage (declared
``Session(replicated=["counter.weight"])``). A step runs a GPipe schedule
over ``mesh["pp"]`` with `MICROBATCHES` micro-batches of this dp rank's
share of the global batch; FSDP averages the gradients over the dp ranks,
so the loss is scaled by the dp size to keep the step the global batch's
sum / global batch size.

Records, as pp_train.py, in ``digest-g<generation>-r<rank>.jsonl``: the
SHA-256 of every tensor of the full state (each DTensor gathered whole,
``full_tensor()``, then every stage's keys gathered) at a generation's start
and clean end, and after every step the digests of this rank's stage's
tensors gathered whole over the stage's mesh only (``after``: with tp
inside a node and dp replicas on other nodes that gather stays in the
node, so a kill of another node leaves the step on record); ``applied-*``
at the last step; ``stage-g<generation>-r<rank>.json`` (layers held, pp, tp
and dp sizes at a start).

Failure semantics are the library's: a dead peer in a pipeline send, an
FSDP reduction or the digests' gathers raises what a failed collective
raises, which ends the generation (``with gen:``) for the next plan.

Environment knobs: TINY_STEP_SLEEP_S slows each step.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from draws import record_draw
from fsdp_train import NUM_COUNTED, AppliedSteps, features
from pp_train import Net, dp_sum, key_digests, stage_of, write_digests
from pace import StepPace
from springback.client.env import AUDIT_DIR
from springback.worker import Session

MICROBATCHES = 2


def build(mesh):  # noqa: ANN001, ANN201 - the form a user writes
    torch.manual_seed(0)
    model = stage_of(Net(), mesh)
    if mesh["tp"].size() > 1:
        parallelize_module(model, mesh["tp"], {
            f"layers.{name}": ColwiseParallel() if int(name) % 2 == 0 else RowwiseParallel()
            for name in model.layers})
    dp = mesh["replicate", "shard"]
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp)
    trained = [p for n, p in model.named_parameters() if not n.startswith("counter.")]
    return model, torch.optim.AdamW(trained, lr=0.05)


def dp_size(mesh) -> int:  # noqa: ANN001
    return mesh["replicate"].size() * mesh["shard"].size()


def pipeline(model: Net, mesh, global_batch_size: int) -> ScheduleGPipe:  # noqa: ANN001
    """This rank's stage over ``mesh["pp"]`` and a GPipe schedule of it."""
    pp = mesh["pp"]
    stage = PipelineStage(model, pp.get_local_rank(), pp.size(), torch.device("cpu"),
                          group=pp.get_group())
    scale = dp_size(mesh) / global_batch_size  # FSDP's mean over dp back to the sum / B

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((output - target) ** 2).sum() * scale

    return ScheduleGPipe(stage, MICROBATCHES, loss_fn=loss_fn, scale_grads=False)


def train_step(model: Net, opt: torch.optim.Optimizer, schedule: ScheduleGPipe, mesh,  # noqa: ANN001
               indices: torch.Tensor) -> float:
    """One pipelined step on this dp rank's `indices` (collective); the mean
    per-sample loss over the global batch."""
    x, y = features(indices.to(torch.float32))
    pp = mesh["pp"]
    first, last = pp.get_local_rank() == 0, pp.get_local_rank() == pp.size() - 1
    if first and last:
        raise ValueError("pp3d_train.py needs pp > 1")
    losses: list[torch.Tensor] = []
    if first:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    # every collective of the step before the optimizer applies it (see pp_train.py)
    applied = torch.bincount(indices, minlength=NUM_COUNTED).to(torch.float64)
    if last:
        dp_sum(applied, mesh)  # every tp rank of a dp rank has the same indices
    # the last stage's losses, once per dp rank (tp index 0), over every rank
    mine = sum(l.item() for l in losses) if mesh["tp"].get_local_rank() == 0 else 0.0
    total = torch.tensor([mine / dp_size(mesh)])
    dist.all_reduce(total)
    opt.step()
    opt.zero_grad()
    if last:
        with torch.no_grad():
            model.counter.weight.add_(applied)
    return total.item()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (collective over its mesh), a plain tensor as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def own_state(model: Net, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Collective over this rank's stage's mesh (its tp and dp ranks, every
    one calling in the same order): the stage's model and optimizer state,
    each tensor whole, by global key."""
    out: dict[str, torch.Tensor] = {f"param/{n}": _whole(p.detach()).clone()
                                    for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for name, value in opt.state.get(p, {}).items():
            out[f"optim/{n}/{name}"] = _whole(torch.as_tensor(value)).clone()
    return out


def full_state(model: Net, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Collective: the full model and optimizer state gathered from every
    stage, by key; ValueError when two ranks' copies of a key differ."""
    everyone: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, own_state(model, opt))
    out: dict[str, torch.Tensor] = {}
    for theirs in everyone:
        for key, value in theirs.items():
            if key in out and not torch.equal(out[key], value):
                raise ValueError(f"two ranks' copies of {key} differ")
            out[key] = value
    return out


def record(gen, when: str, step: int) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Collective: the full state's keys' digests written (``start``, ``end``)."""
    state = full_state(gen.model, gen.optimizer)
    write_digests(gen, {"when": when, "step": step, "keys": key_digests(state)})
    return state


def record_own(gen, step: int) -> None:  # noqa: ANN001
    """After a step: this rank's stage's keys' digests (``after``), gathered
    over the stage's mesh only."""
    write_digests(gen, {"when": "after", "step": step,
                 "keys": key_digests(own_state(gen.model, gen.optimizer))})


def record_stage(gen) -> None:  # noqa: ANN001
    """Writes the layers this rank holds at a generation's start and the
    mesh's sizes, and which of its parameters are DTensors (over which dims)."""
    audit = os.environ.get(AUDIT_DIR)
    if audit:
        mesh = gen.mesh
        dtensors = {n: list(p.device_mesh.mesh_dim_names or ())
                    for n, p in gen.model.named_parameters() if isinstance(p, DTensor)}
        with open(os.path.join(audit, f"stage-g{gen.generation:04d}-r{gen.rank}.json"),
                  "w", encoding="utf-8") as f:
            json.dump({"world_size": gen.world_size, "pp": mesh["pp"].size(),
                       "tp": mesh["tp"].size(), "replicate": mesh["replicate"].size(),
                       "shard": mesh["shard"].size(), "dtensors": dtensors,
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
                      global_batch_size=12, max_steps=40, replicated=["counter.weight"])
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
                gen.report(loss=loss)
                pace.wait(batch.step)
            state = record(gen, "end", session.step)  # a clean end: every rank is here
            if session.step >= gen.max_steps:
                record_applied(gen, state, session.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
