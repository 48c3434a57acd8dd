"""One rank of tests/worker/test_mesh.py's expert-mesh test: builds the
generation mesh of a few layouts over a real gloo group and prints, as
JSON, what each mesh and its expert view hold on this rank and what the
view's groups exchange."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from springback.worker import expert_mesh
from springback.worker.state.mesh import MeshLayout, build_mesh

from peerexit import exit_without_finalizing

LAYOUTS = {"hsdp-ep2": MeshLayout(replicate=2, shard=2, ep=2),
           "tp2-ep2": MeshLayout(shard=2, tp=2, ep=2),
           "hsdp-ep1": MeshLayout(replicate=2, shard=2)}


def main(rank: int, world: int, store_path: str) -> int:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world)
    out = {}
    for name, layout in LAYOUTS.items():
        mesh = build_mesh(layout, "cpu")
        made_with_mesh = hasattr(mesh, "_springback_expert_view")
        view = expert_mesh(mesh)
        ep_group = view.get_group("ep")
        peers = [torch.zeros(1, dtype=torch.long) for _ in range(view.size(1))]
        dist.all_gather(peers, torch.tensor([rank]), group=ep_group)
        received = torch.empty(view.size(1), dtype=torch.long)
        dist.all_to_all_single(received, torch.full((view.size(1),), rank), group=ep_group)
        experts = DTensor.from_local(torch.arange(4).chunk(view.size(1))[view.get_local_rank(1)],
                                     view, (Replicate(), Shard(0)), run_check=False)
        out[name] = {"mesh": mesh.mesh.tolist(), "dims": list(mesh.mesh_dim_names),
                     "view": view.mesh.tolist(), "view_dims": list(view.mesh_dim_names),
                     "made_with_mesh": made_with_mesh, "cached": expert_mesh(mesh) is view,
                     "coordinates": layout.expert_coordinates(rank),
                     "ep_peers": [int(p) for p in peers], "all_to_all": received.tolist(),
                     "full_experts": experts.full_tensor().tolist()}
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
