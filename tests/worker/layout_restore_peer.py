"""One of four gloo ranks: a checkpoint saved at one parallel layout is
restored at others, through the library's own save and restore.

fsdp_train.py's model (tensor parallel on ``mesh["tp"]`` when tp > 1, FSDP2
over the dp dims) trains two steps at tp 2 x shard 2, is checkpointed
(`Checkpointer`, the sharded form's format) and its gathered full state
hashed; then the same checkpoint is restored into the model built at
shard 4 (tp 1) and at replicate 2 x tp 2 (`restore_from_checkpoint`, the
session's restore hook). Prints ``RESULT`` with every layout's hash.

argv: rank, world size (4), a file-store path (its directory holds the checkpoint).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from fsdp_train import build, digest, features
from springback.storage import Checkpointer, model_state_dict
from springback.v1 import types_pb2 as pb
from springback.worker.state.mesh import MeshLayout, build_mesh
from springback.worker.train.checkpointing import restore_from_checkpoint

from peerexit import exit_without_finalizing

LAYOUTS = {  # name -> (replicate, shard, tp)
    "tp2-shard2": (1, 2, 2),
    "shard4": (1, 4, 1),
    "replicate2-tp2": (2, 1, 2),
}


def mesh_of(replicate: int, shard: int, tp: int):  # noqa: ANN201
    plan = pb.Plan(world_size=replicate * shard * tp, layout=pb.ParallelLayout(
        dp=replicate * shard, replicate=replicate, shard=shard, tp=tp, pp=1, ep=1))
    return build_mesh(MeshLayout.from_plan(plan), "cpu")


def main() -> int:
    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    base = f"file://{os.path.dirname(store)}/ckpt"
    model, opt = build(mesh_of(*LAYOUTS["tp2-shard2"]))
    indices = torch.arange(12)
    for _ in range(2):
        x, y = features(indices.to(torch.float32))
        prediction, _ = model(x, indices)
        ((prediction - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    saver = Checkpointer(base, rank=rank, world_size=world, commit_timeout_s=60, poll_interval_s=0.02)
    saver.save(2, model_state_dict(model, opt), generation=1).result(timeout=60)
    saver.close()
    dist.barrier()  # rank 0 has committed
    ref = pb.CheckpointRef(step=2, uri=f"{base}/{os.listdir(base[len('file://'):])[0]}")
    digests = {"tp2-shard2": digest(model, opt)}
    for name in ("shard4", "replicate2-tp2"):
        model, opt = build(mesh_of(*LAYOUTS[name]))
        state = {"model": model, "optimizer": opt}
        assert restore_from_checkpoint(ref, state) == 2
        digests[name] = digest(model, opt)
    print("RESULT " + json.dumps({"rank": rank, "digests": digests}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main())
