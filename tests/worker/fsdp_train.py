"""A tiny FSDP2 / HSDP training script for the sharded-training tests, in the
library's sharded-model form (`Session(build=...)`).

Like tiny_train.py it trains a per-sample *counter* (its own FSDP unit, so
its float64 rows are sharded like any parameter) by plain SGD with the
learning rate equal to the global batch size: each applied update adds 1 to
the entry of every sample of the step, through in-memory reshards and
checkpoint restores alike. The rest of the model trains with AdamW, whose
exp_avg, exp_avg_sq and step are resharded with it.

Every rank appends, to ``<audit>/digest-g<generation>-r<rank>.jsonl``, a
SHA-256 of the *gathered* full model and optimizer state when a generation
starts and when it ends cleanly, and after every step writes its own pieces
of the state with no collective (tests/worker/pieces.py), so a test can
prove a reshard bit-identical with the state an earlier generation held at
that step, even one a kill interrupted before any gather. At the end it
writes the gathered counter as ``applied-*.json`` (tests/worker/applied.py).

A ``state=`` entry, `AppliedSteps`, counts the optimizer steps applied; it
must equal the session's step before every step, so a reshard, roll-back to
peer copies or restore that leaves the whole-held state at another step than
the shards fails the rank.

With a layout of tp > 1 the hidden and output layers are tensor parallel
(column-wise, row-wise) on ``mesh["tp"]`` under FSDP2.

Environment knobs: TINY_STEP_SLEEP_S slows each step; FSDP_BUILD_RAISE=1
makes the build function raise (a bug in the user's code); FSDP_BALLAST_MB=N
adds a frozen, seeded N MiB parameter sharded like the rest (``ballast.``):
state large enough that a reshard's transfer can be cut by a kill from
outside. Never trained, it is left out of the digests and pieces.
"""

import json
import os
import sys

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from draws import record_draw
from pace import StepPace
from pieces import flat, record_pieces, state_digest, without_ballast
from springback.worker import Session
from springback.client.env import AUDIT_DIR

NUM_COUNTED = 256  # the tests' job has 256 samples
FULL = StateDictOptions(full_state_dict=True)


def features(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.stack([torch.sin(indices * 0.1 * k) for k in range(1, 9)], dim=1)
    return x, x @ (torch.arange(1, 9, dtype=torch.float32) / 8) + 0.5


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(NUM_COUNTED, dtype=torch.float64))

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.weight[indices]


class Ballast(torch.nn.Module):
    """FSDP_BALLAST_MB: a frozen parameter, only held and moved."""

    def __init__(self, mib: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(mib * 2**18), requires_grad=False)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)
        self.counter = Counter()
        ballast_mb = int(os.environ.get("FSDP_BALLAST_MB", "0"))
        if ballast_mb:
            self.ballast = Ballast(ballast_mb)

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.out(torch.tanh(self.hidden(x))).sum(dim=1), self.counter(indices)


class AppliedSteps:
    """A registered ``state=`` entry: how many steps this state has applied."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])


def build(mesh):  # noqa: ANN001, ANN201 - the form a user writes
    if os.environ.get("FSDP_BUILD_RAISE") == "1":
        raise ValueError("fsdp_train: no such layer 'decoder.7'")
    torch.manual_seed(0)
    model = Net()
    if mesh["tp"].size() > 1:  # tensor parallel inside a node, FSDP2 over the dp dims
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        parallelize_module(model, mesh["tp"], {"hidden": ColwiseParallel(),
                                               "out": RowwiseParallel()})
    dp = mesh["replicate", "shard"]
    for unit in (model.hidden, model.out, model.counter, getattr(model, "ballast", None)):
        if unit is not None:
            fully_shard(unit, mesh=dp)
    fully_shard(model, mesh=dp)
    trained = [p for n, p in model.named_parameters() if not n.startswith(("counter.", "ballast."))]
    return model, torch.optim.AdamW(trained, lr=0.05)


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """Collective: SHA-256 of the gathered full state."""
    return state_digest(without_ballast({**flat(get_model_state_dict(model, options=FULL)),
                                         **flat(get_optimizer_state_dict(model, opt, options=FULL))}))


def record(gen, when: str, step: int) -> None:  # noqa: ANN001
    value = digest(gen.model, gen.optimizer)
    audit = os.environ.get(AUDIT_DIR)
    if audit:
        name = f"digest-g{gen.generation:04d}-r{gen.rank}.jsonl"
        with open(os.path.join(audit, name), "a") as f:
            f.write(json.dumps({"when": when, "step": step, "world_size": gen.world_size,
                                "digest": value}) + "\n")


def record_applied(gen, step: int) -> None:  # noqa: ANN001
    """At the job's last step: the counter of samples that reached the
    optimizer, gathered whole (a collective: every rank calls it), written
    by rank 0 for the exactly-once audit."""
    full = get_model_state_dict(gen.model, options=FULL)
    audit_dir = os.environ.get(AUDIT_DIR)
    if audit_dir and gen.rank == 0:
        path = os.path.join(audit_dir, f"applied-p{os.getpid()}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"step": step, "counter": full["counter.weight"].tolist()}, f)
        os.replace(path + ".tmp", path)


def main() -> int:
    torch.set_num_threads(1)
    applied = AppliedSteps()
    session = Session(build=build, state={"applied": applied}, num_samples=NUM_COUNTED,
                      global_batch_size=12, max_steps=40)
    pace = StepPace()
    counter = None
    for gen in session.generations():
        with gen:
            model, opt = gen.model, gen.optimizer
            counter = model.counter
            record(gen, "start", session.step)
            for batch in gen.batches():
                record_draw(batch.step, gen.generation, gen.rank)
                if applied.count != batch.step - 1:
                    raise ValueError(f"state= entry at step {applied.count}, shards at step "
                                     f"{batch.step - 1}")
                indices = torch.as_tensor(batch.indices)
                x, y = features(indices.to(torch.float32))
                prediction, counted = model(x, indices)
                per_sample = (prediction - y) ** 2
                loss = (per_sample.sum() - counted.sum()) * batch.loss_scale
                loss.backward()
                opt.step()
                with torch.no_grad():  # plain SGD, lr = B: +1 per applied sample
                    counter.weight.add_(counter.weight.grad, alpha=-batch.global_batch_size)
                opt.zero_grad()
                counter.weight.grad = None
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
