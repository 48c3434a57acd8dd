"""One of four gloo ranks: a pipeline-parallel job's checkpoint, written by
the training library's own checkpointing (`GenerationCheckpoints`, as a
job with ``checkpoint.uri`` does), restores at other layouts.

pp_train.py's model trains two pipelined steps at pp 2 x dp 2 (each stage's
plain parameters held by its two dp ranks only) and is checkpointed; its
full state, gathered from both stages, is hashed by key. The checkpoint is
then restored, through the session's restore hook, into the whole model at
pp 1 x dp 4, and into a pp 2 x dp 2 build again; both are hashed the same
way. Each stage trains with its own weight decay, which the second restore
must give back to each stage (settings are saved by parameter name). Prints
``RESULT`` with the hashes and the restored stage's weight decay.

argv: rank, world size (4), a file-store path (its directory holds the checkpoint).
"""

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from fsdp_train import AppliedSteps
from pp_train import build, full_state, key_digests, pipeline, train_step
from springback.storage import committed_checkpoints
from springback.v1 import types_pb2 as pb
from springback.worker.state.mesh import MeshLayout, build_mesh
from springback.worker.train.checkpointing import GenerationCheckpoints, restore_from_checkpoint

from peerexit import exit_without_finalizing


def plan_of(pp: int, dp: int, uri: str) -> pb.Plan:
    plan = pb.Plan(job_id="job-pp", generation=1, world_size=pp * dp, layout=pb.ParallelLayout(
        dp=dp, replicate=1, shard=dp, tp=1, pp=pp, ep=1))
    plan.spec.checkpoint.uri = uri
    return plan


def main() -> int:
    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    uri = f"file://{os.path.dirname(store)}/ckpt"
    plan = plan_of(2, 2, uri)
    mesh = build_mesh(MeshLayout.from_plan(plan), "cpu")
    model, opt = build(mesh)
    stage = mesh.get_local_rank("pp")
    opt.param_groups[0]["weight_decay"] = 0.01 * (stage + 1)  # a setting that differs by stage
    applied = AppliedSteps()
    schedule = pipeline(model, mesh, 12)
    dp_rank = mesh.get_local_rank("shard")
    for step in (1, 2):
        train_step(model, opt, schedule, mesh, torch.arange(12)[dp_rank::2])
        applied.count = step
    ctx = SimpleNamespace(state={"model": model, "optimizer": opt, "applied": applied},
                          reporter=None, env=SimpleNamespace(job_id="job-pp"))
    checkpoints = GenerationCheckpoints(ctx=ctx, plan=plan, rank=rank)
    assert checkpoints.save(2, (0, 24), wait=True)
    checkpoints.close(wait_for_commit=True)
    dist.barrier()  # rank 0 has committed
    (ckpt,) = committed_checkpoints(checkpoints.base_uri)
    ref = pb.CheckpointRef(step=2, uri=ckpt.uri)
    digests = {"pp2-dp2": key_digests(full_state(model, opt))}
    for name, (pp, dp) in (("pp1-dp4", (1, 4)), ("pp2-dp2-again", (2, 2))):
        model, opt = build(build_mesh(MeshLayout.from_plan(plan_of(pp, dp, uri)), "cpu"))
        applied = AppliedSteps()
        assert restore_from_checkpoint(ref, {"model": model, "optimizer": opt,
                                             "applied": applied}) == 2
        assert applied.count == 2
        digests[name] = key_digests(full_state(model, opt))
    print("RESULT " + json.dumps({"rank": rank, "digests": digests, "stage": stage,
                                  "weight_decay": opt.param_groups[0]["weight_decay"]}),
          flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main())
