"""One rank of test_recovery_faults.py: ``python recovery_peer.py RANK DIR
SCENARIO``. Gloo ranks run the library's own `StateAgreement` generation
after generation (each generation a new process group over a FileStore),
and a *victim* rank dies (``os._exit``) at a named point inside a recovery:
the survivors' start fails the way `Session._start` sees it (they leave the
broken group and take the next plan). Every rank writes
``result-RANK.json``: per generation what the agreement settled on (or the
error it raised) and the SHA-256 of the gathered full model and optimizer
state, next to the digests recorded at the steps trained.

Scenarios:

* ``second_fault`` (4 ranks, FSDP2): HSDP 2 x 2 trains 2 steps; generation 2
  (shard 4) loses rank 1 as it enters the exchange, generation 3 (the other
  three, shard 3) loses rank 2 in the steps' all-gather; generation 4 (ranks
  0 and 3, shard 2) must hold step 2's state.
* ``handover`` (4 ranks, DDP form): ranks 0-1 hold step 2, 2-3 are joiners;
  joiner 3 dies mid-receive of the broadcast, then holder 1 dies as the
  next hand-over begins; generation 4 (ranks 0 and 2) holds step 2's state.
* ``restore`` (3 ranks, FSDP2): step 2 committed, step 3 trained; ranks that
  hold nothing restore, rank 2 dies as its restore begins; the other two
  restore step 2.
* ``rollback`` (4 one-rank nodes, FSDP2 shard 4, peer copies every 2
  steps): node 3 dies after step 3; generation 2's roll back to step 2
  loses rank 1 as its exchange begins; ranks 0 and 2 roll back to step 2.
* ``tensor_parallel`` (tp 2 with FSDP2 on top: ``Shard(0)``, ``Shard(1)``
  and FSDP2's strided shard): tp 2 on 2 ranks, two joiners (shard 2 x tp 2),
  the same 4 as HSDP (replicate 2 x tp 2), then the first two lost; each
  generation holds, bit for bit, the step it resumed from.
* ``tp_second_fault`` (two nodes of tp 2, each a full replica): step 2 is
  trained; generation 2 reshards to FSDP shard 2 x tp 2 and loses rank 3 as
  it enters the exchange; generation 3 (the first node alone, tp 2) must
  hold step 2's state, bit for bit.
* ``pp_second_fault`` (4 one-rank nodes, pp 2 x dp 2, tests/worker/pp_train.py):
  step 2 is trained; generation 2 swaps ranks 1 and 2 between the stages
  and loses rank 0 as it enters the exchange; generation 3 (ranks 1 and 2,
  the two whose stage was changing: one holder of each) must hold step 2's
  state of both stages.
* ``ep_second_fault`` (4 one-rank nodes, ep 2, tests/worker/moe_train.py):
  step 2 is trained; generation 2 swaps ranks 1 and 2 between the expert
  halves and loses rank 0 (a holder of rank 1's half) as it enters the
  exchange; generation 3 (ranks 1 and 2, ep 2) must hold step 2's experts,
  router and balancing buffers.
* ``repartition_second_fault`` (4 one-rank nodes, pp 2 x dp 2,
  tests/worker/pp_train.py): step 2 is trained; generation 2 re-partitions to
  one stage (pp 1 x dp 4: every rank takes the other stage's layers) and
  loses rank 1, a holder of stage 0, as it enters the exchange; generation 3
  (ranks 0, 2 and 3, pp 1) must hold step 2's state of both stages.
* ``pp3d_second_fault`` (4 nodes of tp 2, pp 2 x replicate 2,
  tests/worker/pp3d_train.py): step 2 is trained; generation 2 swaps nodes 1
  and 2 between the stages, each stage FSDP-sharded over its two nodes, and
  loses node 0 (a holder of node 2's new rows) as it enters the exchange;
  generation 3 (nodes 2 and 1, tp 2 x pp 2) must hold step 2's state of
  both stages.
* ``pp3d_restore`` (4 nodes of tp 2, pp 2 x replicate 2,
  tests/worker/pp3d_train.py): step 2 is trained and committed; ranks that
  hold nothing restore it at tp 2 x pp 1 x replicate 2 (4 ranks), then at
  tp 1 x pp 2 x shard 4 (8 ranks).
* ``tp_copies`` (two nodes of tp 2, FSDP2 shard 2 across them, peer copies
  every 2 steps): the second node dies after step 3; the first rolls back to
  step 2 from the copies it keeps of the lost node's TP slices.
* ``tp_restore`` (4 ranks, tp 2 x FSDP2 shard 2, committed at step 2): ranks
  holding nothing restore it as tp 1 x shard 2, then as tp 4.
* ``guard_split`` (4 ranks, HSDP 2 x 2): steps 1-2 trained; step 3's
  gradients complete everywhere, then rank 1's optimizer step breaks in its
  wait for the world (its update pending, as `Generation` keeps it) while
  ranks 0, 2 and 3 apply it, and ranks 2 and 3 die (recording their own
  pieces); generation 2 (ranks 0 and 1, shard 2) must hold step 3, rank 1's
  pieces those rank 3 held.
* ``plain`` (2 ranks, FSDP2 with a plain parameter holding each rank's own
  values): rank 1 comes back holding nothing; the ranks refuse to hand it
  rank 0's values.
* ``fill`` (2 ranks, FSDP2, an optimizer with non-tensor state, a ``state=``
  entry): resharded shard 2 -> replicate 2 with that state kept; then rank 1
  comes back holding nothing, no commit: the state is lost, said, and the
  model and optimizer are the build's own (no entry the failed fill made),
  the ``state=`` entry the script's own on both ranks.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import springback.worker.train.agreement as agreement_module
import springback.worker.state.peercopy as peercopy_module
from springback.storage import Checkpointer, committed_checkpoints, model_state_dict
from springback.client import plans
from springback.v1 import types_pb2 as pb
from springback.worker.train.agreement import StateAgreement, StateUnrecoverable
from springback.worker.train.checkpointing import gather_holders, restore_from_checkpoint
from springback.worker.train.generation import _pending_update
from springback.worker.rank.context import RankContext
from springback.worker.state.peercopy import GenerationCopies
from springback.worker.rank.rendezvous import forget_meshes, leave_group
from springback.worker.state.mesh import MeshLayout, build_mesh
from springback.worker.state.sharded import ShardedModel

from peerexit import exit_without_finalizing

RANK, ROOT, SCENARIO = int(sys.argv[1]), sys.argv[2], sys.argv[3]
FULL = StateDictOptions(full_state_dict=True)
result: dict[str, Any] = {"generations": [], "trained": {}}


def die_at(module: Any, name: str, *, after_calls: int = 0) -> None:
    """This rank exits when `module.name` is called (after `after_calls`
    calls that run as usual): a process killed inside a recovery."""
    real = getattr(module, name)
    calls = [0]

    def dying(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > after_calls:
            sys.stdout.flush()
            os._exit(9)
        return real(*args, **kwargs)

    setattr(module, name, dying)


def join(tag: str, members: list[int]) -> int | None:
    """The new group of `members` (old ranks); this rank's rank in it, or
    None when it is not a member."""
    if RANK not in members:
        return None
    forget_meshes()  # as `form_group` does: a DTensor op must not meet an older mesh
    store = STORE[0] = dist.FileStore(os.path.join(ROOT, f"store-{tag}"), len(members))
    dist.init_process_group("gloo", store=store, rank=members.index(RANK),
                            world_size=len(members), timeout=datetime.timedelta(seconds=30))
    return members.index(RANK)


def plan(generation: int, world: int, *, shard: int, tp: int = 1, nodes: int | None = None,
         ref: pb.CheckpointRef | None = None, copies: int = 0) -> pb.Plan:
    dp = world // tp
    p = pb.Plan(generation=generation, world_size=world, layout=pb.ParallelLayout(
        dp=dp, tp=tp, pp=1, ep=1, replicate=dp // shard, shard=shard))
    p.restore.kind = pb.RESTORE_KIND_PEERS if ref is None else pb.RESTORE_KIND_CHECKPOINT
    if ref is not None:
        p.restore.checkpoint.CopyFrom(ref)
    p.spec.peer_copies.every_steps = copies
    nodes = nodes or world
    for node in range(nodes):
        p.members.add(member_id=f"node{node}", node_rank=node, first_rank=node * world // nodes,
                      num_local_ranks=world // nodes)
    return plans.set_nodes(p)


def new_agreement(build: Any, state: dict[str, Any] | None = None,
                  **kwargs: Any) -> StateAgreement:
    """The agreement of a sharded Session built by `build`, with ``state=``
    entries `state`."""
    ctx = RankContext(env=SimpleNamespace(rendezvous_timeout_s=60.0, job_id=""),  # type: ignore[arg-type]
                      state=dict(state or {}), device=torch.device("cpu"))
    return StateAgreement(ctx, restore_from_checkpoint, ShardedModel(build, **kwargs))


def digest(state: dict[str, Any], sharded: bool = True) -> str:
    """SHA-256 of the gathered full model and optimizer state (collective)."""
    model, opt = state["model"], state["optimizer"]
    if sharded:
        full = {**{f"model.{k}": v for k, v in get_model_state_dict(model, options=FULL).items()},
                "optim": get_optimizer_state_dict(model, opt, options=FULL)["state"]}
    else:
        full = {"model": model.state_dict(), "optim": opt.state_dict()["state"]}
    h = hashlib.sha256()

    def feed(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                feed(f"{prefix}/{k}", value[k])
        elif isinstance(value, torch.Tensor):
            t = value.full_tensor() if hasattr(value, "full_tensor") else value
            h.update(prefix.encode() + t.detach().contiguous().view(-1).view(torch.uint8)
                     .numpy().tobytes())
        else:
            h.update(f"{prefix}={value!r}".encode())

    feed("", full)
    return h.hexdigest()


def train(state: dict[str, Any], step: int, inputs: int = 8) -> None:
    model, opt = state["model"], state["optimizer"]
    model(torch.full((4, inputs), float(step))).square().mean().backward()
    opt.step()
    opt.zero_grad()


def attempt(generation: int, agree: Any, state: dict[str, Any], *, sharded: bool = True) -> None:
    """One start: records what it settled on and the state's digest, or the
    error that ended it (then leaves the broken group, as `Session` does)."""
    try:
        outcome = agree()
    except (RuntimeError, StateUnrecoverable) as e:
        result["generations"].append({"generation": generation, "error": type(e).__name__,
                                      "message": str(e)[:400]})
        if isinstance(e, RuntimeError):
            leave_group(broken=True, cause=e)
        return
    entry = {"generation": generation, "kind": pb.RestoreKind.Name(outcome.kind),
             "state_lost": outcome.state_lost,
             # before the digest: DCP's optimizer state dict fills empty state
             "optimizer_entries": len(state["optimizer"].state),
             "digest": digest(state, sharded)}
    result["generations"].append(entry)


def fsdp_build(mesh):  # noqa: ANN001, ANN201
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Linear(33, 5))  # uneven rows
    for block in model:
        fully_shard(block, mesh=mesh["replicate", "shard"])
    fully_shard(model, mesh=mesh["replicate", "shard"])
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def start(ag: StateAgreement, generation: int, p: pb.Plan, rank: int | None) -> None:
    """The sharded form's start of `generation` on the current group."""
    assert rank is not None and STORE[0] is not None
    attempt(generation, lambda: ag.agree_sharded(p, rank, dist.PrefixStore(f"g{generation}",
                                                                           STORE[0])),
            ag.ctx.state)
    result["generations"][-1]["step"] = ag.ctx.state_step


STORE: list[dist.Store | None] = [None]
"""The current group's store."""


def trained(ag: StateAgreement, steps: range, sharded: bool = True) -> None:
    for step in steps:
        train(ag.ctx.state, step)
        ag.ctx.held.step_applied(step, None)
        result["trained"][str(step)] = digest(ag.ctx.state, sharded)


def second_fault() -> None:
    ag = new_agreement(fsdp_build)
    rank = join("g1", [0, 1, 2, 3])
    start(ag, 1, plan(1, 4, shard=2), rank)
    trained(ag, range(1, 3))
    leave_group()
    if RANK == 1:
        die_at(agreement_module, "exchange")
    rank = join("g2", [0, 1, 2, 3])
    start(ag, 2, plan(2, 4, shard=4), rank)
    if RANK == 2:
        die_at(StateAgreement, "gather_steps")
    rank = join("g3", [0, 2, 3])
    start(ag, 3, plan(3, 3, shard=3), rank)
    rank = join("g4", [0, 3])
    start(ag, 4, plan(4, 2, shard=2), rank)


class Replicated(torch.nn.Module):
    """The DDP form's model: big enough (24 MiB with AdamW's state) that a
    broadcast to a dead receiver blocks its sender."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 1024)
        self.b = torch.nn.Linear(1024, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def handover() -> None:
    torch.manual_seed(RANK if RANK >= 2 else 0)  # joiners start from other values
    model = Replicated()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ctx = RankContext(env=SimpleNamespace(rendezvous_timeout_s=60.0, job_id=""),  # type: ignore[arg-type]
                      state={"model": model, "optimizer": opt}, device=torch.device("cpu"))
    ag = StateAgreement(ctx, None, None)
    if RANK < 2:
        for step in range(1, 3):
            train(ctx.state, step)
            ctx.held.step_applied(step, None)
            result["trained"][str(step)] = digest(ctx.state, sharded=False)
    if RANK == 3:  # the size is received, the state's bytes are not
        die_at(agreement_module.dist, "broadcast", after_calls=1)
    for generation, members in ((2, [0, 1, 2, 3]), (3, [0, 1, 2]), (4, [0, 2])):
        if RANK == 1 and generation == 3:
            die_at(agreement_module, "broadcast_object")
        rank = join(f"g{generation}", members)
        if rank is None:
            return
        p = plan(generation, len(members), shard=1)
        p.restore.source_rank = 0
        attempt(generation, lambda: ag.agree(p, rank), ctx.state, sharded=False)
        result["generations"][-1]["step"] = ctx.state_step
        if "error" not in result["generations"][-1]:
            leave_group()


def restore() -> None:
    ag = new_agreement(fsdp_build)
    rank = join("g1", [0, 1, 2])
    start(ag, 1, plan(1, 3, shard=3), rank)
    trained(ag, range(1, 3))
    ref = commit(ag, 2, world=3)
    trained(ag, range(3, 4))
    leave_group()
    fresh = new_agreement(fsdp_build)  # every holder lost: ranks that hold nothing
    if RANK == 2:
        die_at(agreement_module.StateAgreement, "restore")
    rank = join("g2", [0, 1, 2])
    start(fresh, 2, plan(2, 3, shard=3, ref=ref), rank)
    rank = join("g3", [0, 1])
    start(fresh, 3, plan(3, 2, shard=2, ref=ref), rank)


def commit(ag: StateAgreement, step: int, world: int) -> pb.CheckpointRef:
    base = f"file://{ROOT}/ckpt"
    ck = Checkpointer(base, rank=dist.get_rank(), world_size=world)
    state = ag.ctx.state
    ck.save(step, model_state_dict(state["model"], state["optimizer"]), generation=1,
            cursor=(0, 0), layout={"dp": world, "replicate": 1, "shard": world})
    ck.wait(60)
    ck.close(60)
    dist.barrier()
    newest = committed_checkpoints(base)[-1]
    return pb.CheckpointRef(uri=newest.uri, step=newest.step, generation=newest.generation)


def rollback() -> None:
    ag = new_agreement(fsdp_build)
    rank = join("g1", [0, 1, 2, 3])
    first = plan(1, 4, shard=4, copies=2)
    start(ag, 1, first, rank)
    copies = GenerationCopies.for_generation(ag.copies, ag.ctx, ag.sharded, first, rank)
    assert copies is not None
    for step in range(1, 4):
        trained(ag, range(step, step + 1))
        if step == 3:
            break  # node 3 dies after step 3: step 2's copies are the newest complete
        copies.after_step(step)
    copies.settle()
    if RANK == 3:
        os._exit(9)
    leave_group(broken=True)
    if RANK == 1:
        die_at(peercopy_module, "exchange")
    rank = join("g2", [0, 1, 2])
    start(ag, 2, plan(2, 3, shard=3), rank)
    rank = join("g3", [0, 2])
    start(ag, 3, plan(3, 2, shard=2), rank)


def tp_build(mesh):  # noqa: ANN001, ANN201
    """Tensor parallel on mesh["tp"] (column-wise then row-wise: Shard(0) and
    Shard(1) weights), FSDP2 over the data-parallel dims on top of it (FSDP2's
    strided shard of dim 0 under the column-wise Shard(0))."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["replicate", "shard"])
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def tensor_parallel() -> None:
    ag = new_agreement(tp_build)
    rank = join("g1", [0, 1])
    if rank is not None:
        start(ag, 1, plan(1, 2, shard=1, tp=2), rank)  # tp 2 on one node
        trained(ag, range(1, 3))
        leave_group()
    rank = join("g2", [0, 1, 2, 3])  # two joiners: FSDP shard 2 x tp 2
    start(ag, 2, plan(2, 4, shard=2, tp=2, nodes=2), rank)
    trained(ag, range(3, 4))
    leave_group()
    rank = join("g3", [0, 1, 2, 3])  # the same ranks as HSDP: replicate 2 x tp 2
    start(ag, 3, plan(3, 4, shard=1, tp=2, nodes=2), rank)
    trained(ag, range(4, 5))
    leave_group()
    rank = join("g4", [2, 3])  # the first node lost: its replica holds everything
    if rank is not None:
        start(ag, 4, plan(4, 2, shard=1, tp=2), rank)


def tp_second_fault() -> None:
    ag = new_agreement(tp_build)
    rank = join("g1", [0, 1, 2, 3])  # two nodes of tp 2, each a full replica
    start(ag, 1, plan(1, 4, shard=1, tp=2, nodes=2), rank)
    trained(ag, range(1, 3))
    leave_group()
    if RANK == 3:
        die_at(agreement_module, "exchange")
    rank = join("g2", [0, 1, 2, 3])  # to FSDP shard 2 x tp 2: rank 3 dies in the exchange
    start(ag, 2, plan(2, 4, shard=2, tp=2, nodes=2), rank)
    rank = join("g3", [0, 1])  # then the second node is gone: the first alone, tp 2
    if rank is not None:
        start(ag, 3, plan(3, 2, shard=1, tp=2), rank)


def pp_plan(generation: int, world: int, pp: int = 2) -> pb.Plan:
    """`pp` stages over `world` one-rank nodes, the rest data parallel (shard)."""
    p = plan(generation, world, shard=world // pp)
    p.layout.pp, p.layout.dp, p.layout.replicate, p.layout.shard = pp, world // pp, 1, world // pp
    return p


def pp_trained(ag: StateAgreement, steps: range, world: int) -> None:
    """Pipelined steps (tests/worker/pp_train.py) on the current group; the
    full state gathered from both stages is recorded, key by key."""
    import pp_train

    state = ag.ctx.state
    mesh = build_mesh(MeshLayout.from_plan(pp_plan(0, world)), "cpu")
    schedule = pp_train.pipeline(state["model"], mesh, 12)
    dp = mesh.get_local_rank("shard")
    for step in steps:
        pp_train.train_step(state["model"], state["optimizer"], schedule, mesh,
                            torch.arange(12)[dp::world // 2])
        ag.ctx.held.step_applied(step, None)
        result["trained"][str(step)] = pp_train.key_digests(
            pp_train.full_state(state["model"], state["optimizer"]))


def pp_start(ag: StateAgreement, generation: int, world: int, rank: int | None,
             pp: int = 2) -> None:
    """`start`, recording the full state of every stage key by key."""
    import pp_train

    start(ag, generation, pp_plan(generation, world, pp), rank)
    entry = result["generations"][-1]
    if "error" not in entry:
        entry["keys"] = pp_train.key_digests(pp_train.full_state(ag.ctx.state["model"],
                                                                 ag.ctx.state["optimizer"]))


def pp_step_2() -> StateAgreement:
    """Steps 1-2 of tests/worker/pp_train.py on 4 one-rank nodes, pp 2 x dp
    2 (stage 0: ranks 0-1, stage 1: ranks 2-3); the group left."""
    import pp_train

    ag = new_agreement(pp_train.build, replicated=pp_train.REPLICATED)
    rank = join("g1", [0, 1, 2, 3])  # stage 0: ranks 0-1, stage 1: ranks 2-3
    pp_start(ag, 1, 4, rank)
    pp_trained(ag, range(1, 3), 4)
    leave_group()
    return ag


def pp_second_fault() -> None:
    ag = pp_step_2()
    if RANK == 0:
        die_at(agreement_module, "exchange")
    rank = join("g2", [0, 2, 1, 3])  # 1 and 2 swap stages; 0 dies in the exchange
    pp_start(ag, 2, 4, rank)
    rank = join("g3", [1, 2])  # the two that were moving: one holder of each stage
    if rank is not None:
        pp_start(ag, 3, 2, rank)


def ep_plan(generation: int, world: int) -> pb.Plan:
    """ep 2 over `world` one-rank nodes (expert groups of 2 consecutive dp
    ranks, replicas of each other)."""
    p = plan(generation, world, shard=1)
    p.layout.ep = 2
    return p


def ep_trained(ag: StateAgreement, steps: range, world: int) -> None:
    """Steps of tests/worker/moe_train.py (all-to-all dispatch over ep)."""
    import moe_train

    state = ag.ctx.state
    for step in steps:
        moe_train.train_step(state["model"], state["optimizer"],
                             torch.arange(12)[dist.get_rank()::world], 12)
        ag.ctx.held.step_applied(step, None)
        result["trained"][str(step)] = digest(state)


def ep_second_fault() -> None:
    import moe_train

    ag = new_agreement(moe_train.build)
    rank = join("g1", [0, 1, 2, 3])  # experts 0-1 on ranks 0 and 2, 2-3 on 1 and 3
    start(ag, 1, ep_plan(1, 4), rank)
    ep_trained(ag, range(1, 3), 4)
    leave_group()
    if RANK == 0:
        die_at(agreement_module, "exchange")
    # 1 and 2 swap expert halves, each served by both holders of its half;
    # 0, one of rank 1's, dies in the exchange
    rank = join("g2", [0, 2, 1, 3])
    start(ag, 2, ep_plan(2, 4), rank)
    rank = join("g3", [1, 2])  # the two that were moving: one holder of each half
    if rank is not None:
        start(ag, 3, ep_plan(3, 2), rank)


def repartition_second_fault() -> None:
    ag = pp_step_2()
    if RANK == 1:
        die_at(agreement_module, "exchange")
    # re-partitioned to one stage (pp 1 x dp 4): every rank takes the layers
    # of the other stage; rank 1, a holder of stage 0, dies in the exchange
    rank = join("g2", [0, 1, 2, 3])
    pp_start(ag, 2, 4, rank, pp=1)
    rank = join("g3", [0, 2, 3])  # stage 0's last holder and stage 1's two
    if rank is not None:
        pp_start(ag, 3, 3, rank, pp=1)


def pp3d_plan(generation: int, world: int, *, shard: int, pp: int = 2, tp: int = 2,
              ref: pb.CheckpointRef | None = None) -> pb.Plan:
    """tp inside two-rank nodes, pp across nodes, the rest data parallel
    (`shard` of it FSDP, the rest replicas)."""
    p = plan(generation, world, shard=1, tp=tp, nodes=world // 2, ref=ref)
    dp = world // (pp * tp)
    p.layout.pp, p.layout.dp, p.layout.replicate, p.layout.shard = pp, dp, dp // shard, shard
    return p


def pp3d_start(ag: StateAgreement, generation: int, world: int, rank: int | None, *,
               shard: int, pp: int = 2, tp: int = 2, ref: pb.CheckpointRef | None = None
               ) -> None:
    """`start`, recording the full state of every stage key by key."""
    import pp3d_train

    start(ag, generation, pp3d_plan(generation, world, shard=shard, pp=pp, tp=tp, ref=ref), rank)
    entry = result["generations"][-1]
    if "error" not in entry:
        entry["keys"] = pp3d_train.key_digests(pp3d_train.full_state(
            ag.ctx.state["model"], ag.ctx.state["optimizer"]))


def pp3d_trained(ag: StateAgreement, steps: range) -> None:
    """Pipelined steps of tests/worker/pp3d_train.py on 8 ranks (pp 2 x
    replicate 2 x tp 2); the full state of both stages recorded key by key."""
    import pp3d_train

    mesh = build_mesh(MeshLayout.from_plan(pp3d_plan(0, 8, shard=1)), "cpu")
    schedule = pp3d_train.pipeline(ag.ctx.state["model"], mesh, 12)
    dp = mesh.get_local_rank("replicate")
    for step in steps:
        pp3d_train.train_step(ag.ctx.state["model"], ag.ctx.state["optimizer"], schedule, mesh,
                              torch.arange(12)[dp::2])
        ag.ctx.held.step_applied(step, None)
        result["trained"][str(step)] = pp3d_train.key_digests(pp3d_train.full_state(
            ag.ctx.state["model"], ag.ctx.state["optimizer"]))


def pp3d_step_2() -> StateAgreement:
    """Steps 1-2 of tests/worker/pp3d_train.py on 8 ranks: nodes of 2 ranks
    (tp 2), stage 0 on nodes 0-1 and stage 1 on nodes 2-3, the two nodes of
    a stage replicas; the group kept."""
    import pp3d_train

    ag = new_agreement(pp3d_train.build, replicated=["counter.weight"])
    rank = join("g1", list(range(8)))
    pp3d_start(ag, 1, 8, rank, shard=1)
    pp3d_trained(ag, range(1, 3))
    return ag


def pp3d_second_fault() -> None:
    ag = pp3d_step_2()
    leave_group()
    if RANK in (0, 1):
        die_at(agreement_module, "exchange")
    # nodes 1 and 2 swap stages, each stage now FSDP-sharded over its two
    # nodes; node 0 (a holder of node 2's new rows) dies in the exchange
    rank = join("g2", [0, 1, 4, 5, 2, 3, 6, 7])
    pp3d_start(ag, 2, 8, rank, shard=2)
    rank = join("g3", [4, 5, 2, 3])  # the two that were moving: one holder of each stage
    if rank is not None:
        pp3d_start(ag, 3, 4, rank, shard=1)


def pp3d_restore() -> None:
    import pp3d_train

    ag = pp3d_step_2()
    state = ag.ctx.state
    base = f"file://{ROOT}/ckpt"
    saved = model_state_dict(state["model"], state["optimizer"])
    ck = Checkpointer(base, rank=dist.get_rank(), world_size=8)
    ck.save(2, saved, generation=1, cursor=(0, 0), layout={"pp": 2, "dp": 2, "tp": 2},
            holders=gather_holders(saved, 8))  # the stages hold different plain entries
    ck.wait(60)
    ck.close(60)
    dist.barrier()
    newest = committed_checkpoints(base)[-1]
    ref = pb.CheckpointRef(uri=newest.uri, step=newest.step, generation=newest.generation)
    leave_group()
    rank = join("g2", [0, 1, 2, 3])  # holding nothing: pp 1 x replicate 2 x tp 2
    if rank is not None:
        fresh = new_agreement(pp3d_train.build, replicated=["counter.weight"])
        pp3d_start(fresh, 2, 4, rank, shard=1, pp=1, ref=ref)
        leave_group()
    rank = join("g3", list(range(8)))  # holding nothing: pp 2 x shard 4, tp 1
    fresh = new_agreement(pp3d_train.build, replicated=["counter.weight"])
    pp3d_start(fresh, 3, 8, rank, shard=4, tp=1, ref=ref)


def tp_copies() -> None:
    ag = new_agreement(tp_build)
    rank = join("g1", [0, 1, 2, 3])
    first = plan(1, 4, shard=2, tp=2, nodes=2, copies=2)  # FSDP across the two nodes
    start(ag, 1, first, rank)
    copies = GenerationCopies.for_generation(ag.copies, ag.ctx, ag.sharded, first, rank)
    assert copies is not None
    for step in range(1, 4):
        trained(ag, range(step, step + 1))
        if step == 3:
            break  # node 1 dies after step 3: step 2's copies are the newest complete
        copies.after_step(step)
    copies.settle()
    if RANK >= 2:
        os._exit(9)
    leave_group(broken=True)
    rank = join("g2", [0, 1])
    start(ag, 2, plan(2, 2, shard=1, tp=2), rank)


def tp_restore() -> None:
    ag = new_agreement(tp_build)
    rank = join("g1", [0, 1, 2, 3])
    start(ag, 1, plan(1, 4, shard=2, tp=2, nodes=2), rank)
    trained(ag, range(1, 3))
    ref = commit(ag, 2, world=4)
    leave_group()
    rank = join("g2", [0, 1])  # tp 2 x shard 2 -> tp 1 x shard 2, nothing held
    if rank is not None:
        start(new_agreement(tp_build), 2, plan(2, 2, shard=2, tp=1, ref=ref), rank)
        leave_group()
    rank = join("g3", [0, 1, 2, 3])  # -> tp 4, nothing held
    start(new_agreement(tp_build), 3, plan(3, 4, shard=1, tp=4, ref=ref), rank)


def plain_build(mesh):  # noqa: ANN001, ANN201
    model, _ = fsdp_build(mesh)
    # a hand-written slice of this rank's own, the same shape on every rank
    model.own = torch.nn.Parameter(torch.full((4,), float(dist.get_rank() + 1)))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def plain() -> None:
    ag = new_agreement(plain_build)
    rank = join("g1", [0, 1])
    start(ag, 1, plan(1, 2, shard=2), rank)
    trained(ag, range(1, 3))
    if RANK == 1:
        ag = new_agreement(plain_build)  # comes back holding nothing
    start(ag, 2, plan(2, 2, shard=1), rank)


class CountingSGD(torch.optim.SGD):
    """SGD that keeps a non-tensor entry per parameter (steps taken)."""

    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["count"] = self.state[p].get("count", 0) + 1
        return super().step(closure)


def fill_build(mesh):  # noqa: ANN001, ANN201
    model, _ = fsdp_build(mesh)
    return model, CountingSGD(model.parameters(), lr=0.1, momentum=0.9)


def counts(ag: StateAgreement) -> list[int]:
    """The distinct non-tensor counts the optimizer holds."""
    return sorted({s.get("count", -1) for s in ag.ctx.state["optimizer"].state.values()})


def local_digest(state: dict[str, Any]) -> str:
    """SHA-256 of this rank's own pieces of the model and optimizer (no
    collective)."""
    model, opt = state["model"], state["optimizer"]
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        entries = {"param": p, **opt.state.get(p, {})}
        for key in sorted(entries):
            t = entries[key]
            t = t.to_local() if hasattr(t, "to_local") else torch.as_tensor(t)
            h.update(f"{name}/{key}".encode() + t.detach().contiguous().view(-1)
                     .view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def guard_split() -> None:
    ag = new_agreement(fsdp_build)
    rank = join("g1", [0, 1, 2, 3])
    start(ag, 1, plan(1, 4, shard=2), rank)
    trained(ag, range(1, 3))
    state = ag.ctx.state
    state["model"](torch.full((4, 8), 3.0)).square().mean().backward()
    if RANK == 1:  # the wait before its optimizer step broke: what Generation keeps
        ag.ctx.held.broke(None, pending=_pending_update(state["optimizer"]))
    else:
        state["optimizer"].step()
        ag.ctx.held.step_applied(3, None)
    state["optimizer"].zero_grad()  # as the next start's Session._clear_gradients does
    result["local"] = local_digest(state)
    if RANK >= 2:
        with open(os.path.join(ROOT, f"local-{RANK}.json"), "w", encoding="utf-8") as f:
            json.dump(result["local"], f)
        sys.stdout.flush()
        os._exit(9)
    leave_group(broken=True, cause=RuntimeError("the step's wait for the world broke"))
    rank = join("g2", [0, 1])
    start(ag, 2, plan(2, 2, shard=2), rank)
    result["local_after"] = local_digest(ag.ctx.state)


class AppliedSteps:
    """A ``state=`` entry: the steps this rank's state has applied."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.steps = list(sd["steps"])


def fill() -> None:
    ag = new_agreement(fill_build, {"applied": AppliedSteps()}, on_meta=False)
    rank = join("g1", [0, 1])
    start(ag, 1, plan(1, 2, shard=2), rank)
    result["fresh"] = digest(ag.ctx.state)
    trained(ag, range(1, 3))
    ag.ctx.state["applied"].steps += [1, 2]
    result["counts_trained"] = counts(ag)
    start(ag, 2, plan(2, 2, shard=1), rank)  # resharded: shard 2 -> replicate 2
    result["counts"] = counts(ag)
    start(ag, 3, plan(3, 2, shard=2), rank)  # each rank holds half the rows again
    if RANK == 1:  # comes back holding nothing
        ag = new_agreement(fill_build, {"applied": AppliedSteps()}, on_meta=False)
    start(ag, 4, plan(4, 2, shard=2), rank)  # rank 1's rows: no holder, no commit
    result["applied"] = ag.ctx.state["applied"].steps


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"second_fault": second_fault, "handover": handover, "restore": restore,
     "rollback": rollback, "tensor_parallel": tensor_parallel, "tp_copies": tp_copies,
     "tp_second_fault": tp_second_fault, "pp_second_fault": pp_second_fault,
     "ep_second_fault": ep_second_fault, "pp3d_second_fault": pp3d_second_fault,
     "pp3d_restore": pp3d_restore, "repartition_second_fault": repartition_second_fault,
     "tp_restore": tp_restore, "plain": plain, "guard_split": guard_split,
     "fill": fill}[SCENARIO]()
    with open(os.path.join(ROOT, f"result-{RANK}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    exit_without_finalizing(0)
