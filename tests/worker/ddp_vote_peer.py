"""One rank of tests/worker/test_boundary.py's DDP-carried vote test: three
gloo ranks train two identical models, one under DDP's own all-reduce and one
whose DDP carries the step-boundary votes (`carry_votes_hook`); step 3 runs
no backward (its vote is all-reduced by itself). Prints one JSON line: the
agreements, how many all-reduces of its own the boundary started, and
whether the two models stayed equal, and the warnings of leaving the group
while the carrying DDP wrapper still lives (as a script's wrapper does)."""

import json
import logging
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from springback.worker.train import boundary as B
from springback.worker.rank.rendezvous import form_group, leave_group

from peerexit import exit_without_finalizing

WORLD, STEPS = 3, 5


def main(rank: int, port: int) -> int:
    form_group(secret="", job_id="ddp-vote", generation=5, rank=rank, world_size=WORLD,
               master_addr="127.0.0.1", master_port=port, backend="gloo",
               collective_timeout_s=30, rendezvous_timeout_s=30, superseded=lambda: False)
    torch.manual_seed(0)
    plain_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    carrying_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                         torch.nn.Linear(16, 1))
    carrying_model.load_state_dict(plain_model.state_dict())
    plain, carrying = DDP(plain_model), DDP(carrying_model)
    boundary = B.StepBoundary(rank, WORLD)
    carrying.register_comm_hook(boundary, B.carry_votes_hook)
    boundary.ddp_group = dist.group.WORLD
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, carrying)]
    started = []
    start = boundary._start
    boundary._start = lambda vote: (started.append(vote.step), start(vote))[1]
    agreed = []
    for step in range(1, STEPS + 1):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        if step != 3:  # step 3: no backward, nothing all-reduced by DDP
            for model, opt in zip((plain, carrying), opts):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        a = boundary.vote(B.Vote(step=step, generation_seen=5 + (rank == 1 and step == 2),
                                 loss_share=float(rank + step), draining=(rank == 2 and step == 4) or step in (3, 5),
                                 last_holder=False, ended_t=float(step),
                                 bad=rank == 0 and step == 2,
                                 timing=(float(10 * step + rank), float(rank))))
        agreed.append(a.__dict__ if a else None)
    agreed.append(boundary.settle().__dict__)
    same = all(torch.allclose(p, q, rtol=1e-6, atol=0)
               for p, q in zip(plain_model.parameters(), carrying_model.parameters()))
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("springback.worker.rank.rendezvous").addHandler(handler)
    leave_group(release_timeout_s=20.0)
    print(json.dumps({"agreed": agreed, "own_all_reduces": started, "same": same,
                      "warnings": warnings}), flush=True)
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main(int(sys.argv[1]), int(sys.argv[2])))
