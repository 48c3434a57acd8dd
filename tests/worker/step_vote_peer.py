"""One rank of tests/worker/test_boundary.py's pipeline vote test: two gloo
ranks step an SGD model whose optimizer step pre-hook is the boundary's
`reach`, registered as `Generation` does for a pipeline (pp > 1), so each
step's vote rides the next optimizer step's all-reduce; step 3 steps no
optimizer (its boundary all-reduces step 2's vote by itself). Then rank 1
exits before its optimizer step of step 6, and rank 0's optimizer step
must raise without applying. Prints one JSON line: the agreements, the
all-reduces made per step (and at settle), whether rank 0's step 6 raised
and whether its parameters stayed at step 5's."""

import json
import os
import sys

import torch
import torch.distributed as dist

from springback.worker.train import boundary as B
from springback.worker.rank.rendezvous import form_group, leave_group

from peerexit import exit_without_finalizing

WORLD, STEPS = 2, 5


def main(rank: int, port: int) -> int:
    form_group(secret="", job_id="step-vote", generation=5, rank=rank, world_size=WORLD,
               master_addr="127.0.0.1", master_port=port, backend="gloo",
               collective_timeout_s=30, rendezvous_timeout_s=30, superseded=lambda: False)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    boundary = B.StepBoundary(rank, WORLD)
    boundary.carried_by_step = True
    opt.register_step_pre_hook(lambda *_: boundary.reach())
    counted = [0]
    all_reduce = dist.all_reduce

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        counted[0] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting
    agreed, per_step = [], []

    def step(n: int) -> None:
        model(torch.full((2, 4), float(n + rank))).square().mean().backward()
        if n != 3:  # step 3: no optimizer step, so no pre-hook all-reduce
            opt.step()
        opt.zero_grad()

    for n in range(1, STEPS + 1):
        counted[0] = 0
        step(n)
        a = boundary.vote(B.Vote(step=n, generation_seen=5 + (rank == 1 and n == 2),
                                 loss_share=float(rank + n), draining=(rank == 1 and n == 4) or n == 5,
                                 last_holder=False, ended_t=float(n), bad=rank == 0 and n == 2,
                                 timing=(float(10 * n + rank), float(rank))))
        agreed.append(a.__dict__ if a else None)
        per_step.append(counted[0])
    counted[0] = 0
    agreed.append(boundary.settle().__dict__)
    per_step.append(counted[0])
    if rank == 1:
        os._exit(0)  # dies before its optimizer step of step 6
    before = [p.detach().clone() for p in model.parameters()]
    failed = ""
    try:
        step(6)
    except RuntimeError as e:
        failed = str(e).splitlines()[0]
        boundary.abandon()
        leave_group(broken=True, cause=e, release_timeout_s=20.0)
    kept = all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    print(json.dumps({"agreed": agreed, "all_reduces": per_step, "failed": failed,
                      "kept": kept}), flush=True)
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main(int(sys.argv[1]), int(sys.argv[2])))
