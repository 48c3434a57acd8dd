"""One rank of test_sharded.py's meta-build test; ``python meta_build_peer.py
RANK DIR CASE``. Two gloo ranks (FSDP2, shard=2) through the library's own
`StateAgreement`: generation 1 starts fresh, trains a step and commits a
checkpoint; generation 2 fills from the ranks' own shards (memory);
generation 3 starts on ranks that hold nothing and restores the checkpoint.
CASE names the model: ``plain``, ``unsharded`` (no FSDP2: plain parameters,
declared replicated, which ``to_empty`` replaces), ``nonpersistent`` (a non-persistent
buffer, which no checkpoint holds), ``item`` (the build reads a value: it
cannot run on the meta device), ``loose`` (a tensor attribute outside the
parameters and buffers). Rank 0 writes ``result-CASE.json``: per generation
how the build ran (meta or real) and the full state's digest, and the model's
output on a fixed input after each."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from springback.storage import Checkpointer, committed_checkpoints, model_state_dict
from springback.client import plans
from springback.v1 import types_pb2 as pb
from springback.worker.train.agreement import StateAgreement
from springback.worker.train.checkpointing import restore_from_checkpoint
from springback.worker.rank.context import RankContext
from springback.worker.state.sharded import ShardedModel

from peerexit import exit_without_finalizing

CASE = sys.argv[3] if len(sys.argv) > 3 else "plain"
BUILDS: list[str] = []


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 33), torch.nn.Linear(33, 5)
        if CASE == "nonpersistent":
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 33), persistent=False)
        if CASE == "loose":
            self.offset = torch.full((33,), 0.25)  # not a parameter or buffer
        if CASE == "item" and self.a.weight.abs().sum().item() < 0:  # reads a value
            raise AssertionError("unreachable")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if CASE == "nonpersistent":
            h = h * self.scale
        if CASE == "loose":
            h = h + self.offset
        return self.b(h)


def build(mesh):  # noqa: ANN001, ANN201
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    if CASE != "unsharded":
        for block in (model.a, model.b):
            fully_shard(block, mesh=mesh["replicate", "shard"])
        fully_shard(model, mesh=mesh["replicate", "shard"])
    BUILDS.append("meta" if next(model.parameters()).is_meta else "real")
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def plan(generation: int, ref: pb.CheckpointRef | None = None) -> pb.Plan:
    p = pb.Plan(generation=generation, world_size=2, layout=pb.ParallelLayout(
        dp=2, tp=1, pp=1, ep=1, replicate=1, shard=2))
    p.restore.kind = pb.RESTORE_KIND_PEERS if ref is None else pb.RESTORE_KIND_CHECKPOINT
    if ref is not None:
        p.restore.checkpoint.CopyFrom(ref)
    p.members.add(member_id="node0", node_rank=0, first_rank=0, num_local_ranks=2)
    return plans.set_nodes(p)


def digest(ctx: RankContext) -> str:
    full = get_model_state_dict(ctx.state["model"], options=StateDictOptions(full_state_dict=True))
    h = hashlib.sha256()
    for key, t in sorted(full.items()):
        h.update(key.encode() + t.contiguous().numpy().tobytes())
    return h.hexdigest()


def agreement() -> StateAgreement:
    ctx = RankContext(env=SimpleNamespace(rendezvous_timeout_s=60.0, job_id=""), state={},  # type: ignore[arg-type]
                      device=torch.device("cpu"))
    replicated = [n for n, _ in Net().named_parameters()] if CASE == "unsharded" else []
    return StateAgreement(ctx, restore_from_checkpoint, ShardedModel(build, replicated=replicated))


def output(ctx: RankContext) -> list[float]:
    with torch.no_grad():
        return ctx.state["model"](torch.ones(2, 8)).flatten().tolist()


def main(rank: int, root: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(root, f"store-{CASE}"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    result: dict = {"generations": []}
    first = agreement()
    first.agree_sharded(plan(1), rank, dist.PrefixStore("g1", store))
    model, opt = first.ctx.state["model"], first.ctx.state["optimizer"]
    model(torch.ones(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    first.ctx.held.step_applied(1, None)
    result["generations"].append((BUILDS[-1], digest(first.ctx), output(first.ctx)))
    base = f"file://{root}/ckpt-{CASE}"
    ck = Checkpointer(base, rank=rank, world_size=2)
    ck.save(1, model_state_dict(model, opt), generation=1, cursor=(0, 0),
            layout={"dp": 2, "replicate": 1, "shard": 2})
    ck.wait(60)
    ck.close(60)
    first.agree_sharded(plan(2), rank, dist.PrefixStore("g2", store))  # from memory
    result["generations"].append((BUILDS[-1], digest(first.ctx), output(first.ctx)))
    newest = committed_checkpoints(base)[-1]
    ref = pb.CheckpointRef(uri=newest.uri, step=newest.step, generation=newest.generation)
    fresh = agreement()  # ranks that hold nothing: the checkpoint
    fresh.agree_sharded(plan(3, ref), rank, dist.PrefixStore("g3", store))
    result["generations"].append((BUILDS[-1], digest(fresh.ctx), output(fresh.ctx)))
    if rank == 0:
        with open(os.path.join(root, f"result-{CASE}.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
    exit_without_finalizing(0)
