"""One rank of tests/worker/test_rendezvous.py's mesh-cache test: three
generations through the library's `form_group` / `leave_group`, each with a
new device mesh of the same layout; prints whether a DTensor op's output is
bound to that generation's own mesh."""

import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from springback.worker.rank.rendezvous import form_group, leave_group

from peerexit import exit_without_finalizing


def main(port: int) -> int:
    own = []
    for generation in (1, 2, 3):
        form_group(secret="", job_id="mesh-cache", generation=generation, rank=0, world_size=1,
                   master_addr="127.0.0.1", master_port=port, backend="gloo",
                   collective_timeout_s=5, rendezvous_timeout_s=30, superseded=lambda: False)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        doubled = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]) * 2
        own.append(doubled._spec.mesh is mesh)
        leave_group()
    print(f"own meshes {own}", flush=True)
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main(int(sys.argv[1])))
