"""One rank of tests/worker/test_mesh.py's expert-dispatch test: trains
moe_train.py's model a few steps on fixed batches, with the experts split
over ep = 2 (all-to-all dispatch) and with ep = 1 (every rank holds every
expert), and prints the gathered parameters of both as JSON."""

import json
import sys

import torch
import torch.distributed as dist

from moe_train import build, train_step
from springback.worker.state.mesh import MeshLayout, build_mesh

from peerexit import exit_without_finalizing

STEPS, BATCH = 4, 12


def main(rank: int, world: int, store_path: str) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world)
    out = {}
    for ep in (2, 1):
        model, opt = build(build_mesh(MeshLayout(shard=world, ep=ep), "cpu"))
        for step in range(STEPS):
            indices = torch.arange(step * BATCH, (step + 1) * BATCH)
            train_step(model, opt, indices.chunk(world)[rank], BATCH)
        out[ep] = {name: p.full_tensor().tolist() for name, p in model.named_parameters()}
        out[ep]["bias"] = model.moe.bias.tolist()
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
