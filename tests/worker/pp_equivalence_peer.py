"""One rank of tests/worker/test_pipeline_parallel.py's equivalence test:
trains pp_train.py's model a few steps on fixed batches as a 2-stage
pipeline (pp = 2, ScheduleGPipe over gloo) and, unpipelined, the full model
on every rank, and prints the gathered parameters of both as JSON."""

import json
import sys

import torch
import torch.distributed as dist

from fsdp_train import features
from pp_train import Net, build, full_state, pipeline, train_step
from springback.worker.state.mesh import MeshLayout, build_mesh

from peerexit import exit_without_finalizing

STEPS, BATCH = 4, 12


def main(rank: int, world: int, store_path: str) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world)
    mesh = build_mesh(MeshLayout(pp=world), "cpu")
    model, opt = build(mesh)
    schedule = pipeline(model, mesh, BATCH)
    for step in range(STEPS):
        train_step(model, opt, schedule, mesh, torch.arange(step * BATCH, (step + 1) * BATCH))
    split = {k.removeprefix("param/"): v.tolist() for k, v in full_state(model, opt).items()
             if k.startswith("param/")}
    torch.manual_seed(0)
    whole = Net()
    whole_opt = torch.optim.AdamW([p for n, p in whole.named_parameters()
                                   if not n.startswith("counter.")], lr=0.05)
    for step in range(STEPS):
        indices = torch.arange(step * BATCH, (step + 1) * BATCH)
        x, y = features(indices.to(torch.float32))
        (((whole(x) - y) ** 2).sum() / BATCH).backward()
        whole_opt.step()
        whole_opt.zero_grad()
        with torch.no_grad():
            whole.counter.weight.index_add_(0, indices, torch.ones(BATCH, dtype=torch.float64))
    print("RESULT " + json.dumps({"split": split, "whole": {
        n: p.tolist() for n, p in whole.named_parameters()}}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
