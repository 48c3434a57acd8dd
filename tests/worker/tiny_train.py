"""A tiny DDP training script for the worker tests: a linear regression whose
samples are a fixed function of their index, so any rank can build any batch.

The model also carries a *sample counter*: a float64 parameter with one entry
per sample, trained by plain SGD on the loss ``-counter[i]`` for each sample
``i`` of a batch. With the batch's loss scale and a learning rate equal to the
job's global batch size, one applied update adds exactly 1 to the entry of every
sample whose gradient reached the optimizer, through DDP's all-reduce, state
hand-overs and checkpoint restores alike. At the end each rank writes its
counter to the audit directory (``applied-*.json``), so a test proves from
the model's own state that every sample was applied exactly once
(tests/worker/applied.py), not only that the sampler handed it out.

Environment knobs (test-only): TINY_STEP_SLEEP_S slows each step so faults land
mid-run; TINY_CRASH_AT_STEP=N makes global rank 1 (TINY_CRASH_RANK) exit(3) at step N, once
per marker file TINY_CRASH_MARKER: before the step, or with
TINY_CRASH_IN=backward in the middle of its backward pass (its peers are then
inside DDP's gradient all-reduce), or with TINY_CRASH_IN=after_step right after
its optimizer steps of step N (its peers applied the step too), or with
TINY_CRASH_IN=hang it does not exit
but hangs there for good (a deadlock in the user's code; its agent lives on); TINY_CRASH_RANKS=all makes every rank crash
that way (a bad batch), TINY_CRASH_TIMES=K lets the crash repeat K times
(one marker file per time). TINY_RAISE_AT_STEP=N raises the script's own
RuntimeError at step N on every rank (a bug in the user's code, not a
membership change). TINY_PRINT_STEPS=1 prints a line per step (for the
rank-log tests). TINY_DDP=script wraps the model in the script's own DDP
instead of `gen.ddp`. TINY_MESH_REDUCE=1 ends each step with an all-reduce on
the "replicate" group of the script's own `gen.mesh`, after the sleep, which it
announces ("step N sleeping"): a peer killed meanwhile is seen on that
subgroup's sockets first. TINY_LOG=info logs the library's info lines with timestamps
(the hand-written-plan tests: a failure shows each rank's generations).
TINY_NAN_STEPS=5,7 makes the loss that global rank TINY_NAN_RANK (default 1)
hands to `gen.check_step` NaN at those steps (its gradients stay finite: only
the step vote tells the other ranks), TINY_NAN_FROM_STEP=N at every step
from N; TINY_BAD_LOSS=1e6 hands that loss instead of NaN (a spike);
TINY_DIGESTS=1 appends each rank's state digest after every step to
``digests-r<rank>-p<pid>.jsonl`` in the audit directory. TINY_LOSS_ALL_REDUCE=1
ends each step with an all-reduce of the loss over ``gen.group`` after the
optimizer steps (a logging all-reduce: with TINY_CRASH_IN=after_step the
survivors' step breaks there, after they applied it). TINY_COMPUTE_SLEEP_S
sleeps that long in every step between the batch and the forward pass, i.e.
in the compute before the step's first collective (a slow node: set it on
one agent only; per-member timing, worker/train/ranktiming.py);
TINY_COMPUTE_SLEEP_FROM_STEP=S sleeps it only from step S on (a node that
becomes slow mid-run: the straggler policy, service/policy/stragglers.py).
TINY_BALLAST_MB=N adds a frozen parameter of N MiB (seeded, never trained) to
the model: held state large enough that a joiner's hand-over takes long enough
to be cut by a kill from outside.
"""

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from draws import record_draw
from pace import StepPace
from springback.worker import Session
from springback.client.env import AUDIT_DIR
from springback.worker.train.audit import state_digest

NUM_SAMPLES, GLOBAL_BATCH = 256, 12  # standalone fallbacks; a job's spec overrides them
MAX_COUNTED = 8192  # sample indices the counter covers (jobs of the tests are smaller)


def features(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.stack([torch.sin(indices * 0.1 * k) for k in range(1, 9)], dim=1)
    w_true = torch.arange(1, 9, dtype=torch.float32) / 8
    return x, x @ w_true + 0.5


class TinyModel(torch.nn.Module):
    def __init__(self, num_samples: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)
        self.counter = torch.nn.Parameter(torch.zeros(num_samples, dtype=torch.float64))
        ballast_mb = int(os.environ.get("TINY_BALLAST_MB", "0"))
        if ballast_mb:  # frozen: no gradient, no all-reduce; held and handed over
            self.ballast = torch.nn.Parameter(torch.rand(ballast_mb * 2**18), requires_grad=False)

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x).squeeze(1), self.counter[indices]


class Crash:
    """The crash injection configured by the TINY_CRASH_* variables."""

    def __init__(self) -> None:
        self.at = int(os.environ.get("TINY_CRASH_AT_STEP", "0"))
        self.marker = os.environ.get("TINY_CRASH_MARKER", "")
        self.where = os.environ.get("TINY_CRASH_IN", "before")
        self.every_rank = os.environ.get("TINY_CRASH_RANKS", "") == "all"
        self.times = int(os.environ.get("TINY_CRASH_TIMES", "1"))
        self.rank = int(os.environ.get("TINY_CRASH_RANK", "1"))

    def due(self, step: int, rank: int) -> bool:
        if not (self.at and step == self.at and self.marker):
            return False
        if not (self.every_rank or rank == self.rank):
            return False
        return any(not os.path.exists(self._marker(k, rank)) for k in range(self.times))

    def now(self, rank: int) -> None:
        k = next(k for k in range(self.times) if not os.path.exists(self._marker(k, rank)))
        open(self._marker(k, rank), "w").close()
        print(f"tiny_train: injected crash of rank {rank} ({self.where})", flush=True)
        if self.where == "hang":
            threading.Event().wait()  # never set: hung, reading no plan
        os._exit(3)

    def _marker(self, k: int, rank: int) -> str:
        suffix = f"-r{rank}" if self.every_rank else ""
        return f"{self.marker}{suffix}" + (f".{k}" if k else "")


def main() -> int:
    faulthandler.register(signal.SIGUSR1)  # stack dump of a hung rank, for debugging
    if os.environ.get("TINY_LOG") == "info":
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyModel(MAX_COUNTED)
    opt = torch.optim.Adam(model.linear.parameters(), lr=0.05)
    counter_opt = torch.optim.SGD([model.counter], lr=GLOBAL_BATCH)  # stateless; lr set per job
    session = Session(model=model, optimizer=opt, num_samples=NUM_SAMPLES,
                      global_batch_size=GLOBAL_BATCH, max_steps=40)
    pace = StepPace()
    crash = Crash()
    raise_at = int(os.environ.get("TINY_RAISE_AT_STEP", "0"))
    say_steps = os.environ.get("TINY_PRINT_STEPS") == "1"
    mesh_reduce = os.environ.get("TINY_MESH_REDUCE") == "1"
    nan_steps = {int(s) for s in os.environ.get("TINY_NAN_STEPS", "").split(",") if s}
    nan_from = int(os.environ.get("TINY_NAN_FROM_STEP", "0"))
    nan_rank = int(os.environ.get("TINY_NAN_RANK", "1"))
    bad_loss = float(os.environ.get("TINY_BAD_LOSS", "nan"))
    digests = os.environ.get("TINY_DIGESTS") == "1"
    loss_all_reduce = os.environ.get("TINY_LOSS_ALL_REDUCE") == "1"
    compute_sleep_s = float(os.environ.get("TINY_COMPUTE_SLEEP_S", "0"))
    compute_sleep_from = int(os.environ.get("TINY_COMPUTE_SLEEP_FROM_STEP", "0"))
    for gen in session.generations():
        with gen:
            assert gen.stream.num_samples <= MAX_COUNTED
            counter_opt.param_groups[0]["lr"] = gen.stream.global_batch_size  # +1 per sample
            # TINY_DDP=script: the script's own wrapper (the vote then has an
            # all-reduce of its own); else the library's, which carries it
            ddp = (DDP(model, process_group=gen.group) if os.environ.get("TINY_DDP") == "script"
                   else gen.ddp(model))
            for batch in gen.batches():
                record_draw(batch.step, gen.generation, gen.rank)
                if batch.step == raise_at:
                    raise RuntimeError(f"tiny_train: bad batch at step {raise_at}")
                crashing = crash.due(batch.step, gen.rank)
                if crashing and crash.where in ("before", "hang"):
                    crash.now(gen.rank)
                if compute_sleep_s and batch.step >= compute_sleep_from:
                    time.sleep(compute_sleep_s)  # a slow node's compute (TINY_COMPUTE_SLEEP_S)
                indices = torch.as_tensor(batch.indices)
                x, y = features(indices.to(torch.float32))
                prediction, counted = ddp(x, indices)
                per_sample = (prediction - y) ** 2
                loss = (per_sample.sum() - counted.sum()) * batch.loss_scale
                if crashing and crash.where == "backward":  # after the local gradients,
                    # inside DDP's all-reduce
                    model.linear.weight.register_hook(lambda g: crash.now(gen.rank))
                loss.backward()
                checked = per_sample.mean().item() if len(per_sample) else 0.0
                if gen.rank == nan_rank and (batch.step in nan_steps
                                             or 0 < nan_from <= batch.step):
                    checked = bad_loss
                if gen.check_step(checked):  # always True unless controls.bad_step is on
                    opt.step()
                    counter_opt.step()
                opt.zero_grad()
                counter_opt.zero_grad()
                if crashing and crash.where == "after_step":  # its peers applied the step too
                    crash.now(gen.rank)
                if loss_all_reduce:  # after the optimizer step: breaks a step it applied
                    torch.distributed.all_reduce(loss.detach(), group=gen.group)
                if digests:
                    path = os.path.join(os.environ[AUDIT_DIR],
                                        f"digests-r{gen.rank}-p{os.getpid()}.jsonl")
                    with open(path, "a", encoding="utf-8") as f:
                        f.write(json.dumps({"step": batch.step,
                                            "digest": state_digest(session.state)}) + "\n")
                if say_steps:
                    print(f"trained step {batch.step} in generation {gen.generation}", flush=True)
                if mesh_reduce:
                    print(f"tiny_train: step {batch.step} sleeping before the mesh all-reduce",
                          flush=True)
                pace.wait(batch.step)
                if mesh_reduce:
                    torch.distributed.all_reduce(torch.ones(1),
                                                 group=gen.mesh.get_group("replicate"))
    audit_dir = os.environ.get(AUDIT_DIR)
    if audit_dir and session.finished:
        path = os.path.join(audit_dir, f"applied-p{os.getpid()}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"step": session.step, "counter": model.counter.detach().tolist()}, f)
        os.replace(path + ".tmp", path)  # whole or absent for a reader
    return 0


if __name__ == "__main__":
    sys.exit(main())
