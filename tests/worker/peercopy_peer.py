"""One rank of the peer-copy fallback test (test_peer_copies.py); run as
``python peercopy_peer.py RANK DIR``.

Four gloo ranks on two "nodes" (ranks 0-1, 2-3) train a tiny FSDP2 model
(shard=4) with peer copies every 2 steps through the library's own
`StateAgreement` and `GenerationCopies`. The copy of step 2 completes; at
step 4 node 1 dies before sending its copy: ranks 2 and 3 exit after the
step, ranks 0 and 1 start the step-4 transfer, fail to finish it (the copy
stays in flight) and abandon it, its buffers kept. The
two survivors then start generation 2: step 4's pieces do not cover node 1's
rows, step 2's do. Rank 0 writes ``result.json``: the step the survivors
rolled back to, the restore kind, and the gathered state's SHA-256 at that
step in both generations.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from springback.client import plans
from springback.v1 import types_pb2 as pb
from springback.worker.train.agreement import StateAgreement
from springback.worker.rank.context import RankContext
from springback.worker.state.peercopy import GenerationCopies
from springback.worker.state.sharded import ShardedModel

from peerexit import exit_without_finalizing


def build(mesh):  # noqa: ANN001, ANN201
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Linear(33, 5))  # uneven rows
    for block in model:
        fully_shard(block, mesh=mesh["replicate", "shard"])
    fully_shard(model, mesh=mesh["replicate", "shard"])
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def plan(world: int, nodes: int) -> pb.Plan:
    p = pb.Plan(generation=1 + (world == 2), world_size=world, layout=pb.ParallelLayout(
        dp=world, tp=1, pp=1, ep=1, replicate=1, shard=world))
    p.restore.kind = pb.RESTORE_KIND_PEERS
    p.spec.peer_copies.every_steps = 2
    for node in range(nodes):
        p.members.add(member_id=f"node{node}", node_rank=node, first_rank=node * world // nodes,
                      num_local_ranks=world // nodes)
    return plans.set_nodes(p)


def digest(ctx: RankContext) -> str:
    full = get_model_state_dict(ctx.state["model"], options=StateDictOptions(full_state_dict=True))
    h = hashlib.sha256()
    for key, t in sorted(full.items()):
        h.update(key.encode() + t.contiguous().numpy().tobytes())
    return h.hexdigest()


def main(rank: int, root: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(root, "g1"), 4)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
    ctx = RankContext(env=SimpleNamespace(rendezvous_timeout_s=60.0, job_id=""), state={},  # type: ignore[arg-type]
                      device=torch.device("cpu"))
    agreement = StateAgreement(ctx, None, ShardedModel(build))
    first = plan(4, nodes=2)
    agreement.agree_sharded(first, rank, dist.PrefixStore("a", store))
    copies = GenerationCopies.for_generation(agreement.copies, ctx, agreement.sharded, first, rank)
    assert copies is not None
    digests = {}
    for step in range(1, 5):
        model, opt = ctx.state["model"], ctx.state["optimizer"]
        model(torch.full((4, 8), float(step))).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ctx.held.step_applied(step, None)
        digests[step] = digest(ctx)
        if step == 4 and rank >= 2:
            os._exit(0)  # node 1 dies before it sends step 4's copy
        copies.after_step(step)
    try:  # the step-4 transfer never completes here
        copies.settle()
        raise AssertionError("a copy from a dead node completed")
    except (RuntimeError, dist.DistError):
        pass
    # a failed wait leaves the copy in flight, and abandoning it (twice: it is
    # idempotent) keeps its buffers until the group is gone
    assert copies._in_flight is not None
    copies.abandon()
    copies.abandon()
    assert copies._abandoned is not None and copies._in_flight is None
    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(root, "g2"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    kind = agreement.agree_sharded(plan(2, nodes=1), rank, dist.PrefixStore("b", store)).kind
    rolled = digest(ctx)
    if rank == 0:
        with open(os.path.join(root, "result.json"), "w", encoding="utf-8") as f:
            json.dump({"step": ctx.state_step, "kind": pb.RestoreKind.Name(kind),
                       "digest": rolled, "digests": digests}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
    exit_without_finalizing(0)
