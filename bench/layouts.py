"""Node loss and per-step overhead under the parallel layouts Springback
reshards: DP x TP, DP x PP, DP x EP and FSDP x TP x PP, each in one run.

For every layout real gloo ranks (multiprocessing, 2 ranks a node; 1 for
pp) train a compact model of that layout (``--layers`` x Linear(``--width``)
blocks, or ``--experts`` stacked expert MLPs of the same width, AdamW; about
190 MiB of parameters plus optimizer state by default) and measure:

* **node loss -> next step** (bench/sharded_recovery.py's machinery): the
  ranks commit a checkpoint to S3 (a moto server child on 127.0.0.1), a node
  is lost, and the survivors reach their next step twice through the
  library's start-of-generation agreement (`worker/train/agreement.py`): in
  memory (build on the new mesh, fill from the surviving replicas) and from
  S3 (the same build, then a DCP restore of the commit). Printed: the
  seconds to the agreed state of both and their ratio (target >= 10x); the
  same with the next step included is printed below the table.
* **per-step overhead**: the same ranks then run one generation of the
  library's `Session(build=...)` (driven by plan files and a TCPStore, as an
  agent would: no coordinator, no checkpoints), and in it step two copies of
  the same model and layout in alternating windows (ABBA order, so a drift
  of the shared machine's load hits both): a plain torch.distributed one
  (built by the same builder on `init_device_mesh`, its own batches, no
  Session call) and the Session's own (``gen.batches()``, ``gen.report``).
  Printed: median ms/step of both and the median of the paired windows'
  ratios (target <= 3 %).

Layouts (``--layouts``, comma-separated):

* ``tp``: DP 2 (FSDP2 replicate 2 x shard 1) x TP 2 (column/row-wise
  pairs), 2 nodes of 2; node 1 lost -> DP 1 x TP 2.
* ``pp``: DP 2 x PP 2 (plain tensors, declared replicated; GPipe, 2
  micro-batches, dp gradients all-reduced), 4 nodes of 1; the node of rank
  3 (stage 1's second replica) lost -> PP 2 on ranks 0 and 2 (rank 1
  becomes a spare, as the planner would leave it).
* ``ep``: DP 4 x EP 2 (``--experts`` experts placed (Replicate, Shard(0)) on
  `expert_mesh`, top-2 routing, all-to-all dispatch), 2 nodes of 2; node 1
  lost -> DP 2 x EP 2.
* ``3d``: FSDP2 (replicate 2 x shard 1) x TP 2 x PP 2, 8 ranks, 4 nodes of
  2; node 3 lost -> TP 2 x PP 2 on ranks 0, 1, 4, 5 (2, 3 spares).

    .venv/bin/python bench/layouts.py [--layouts tp,pp,ep,3d] [--width 1024 --layers 16]

Targets: in memory >= 10x faster than from S3; overhead <= 3 % per step.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import sharded_recovery as SR  # noqa: E402 - the HSDP bench's plan / commit / loss machinery

GLOBAL_BATCH, NUM_SAMPLES, MICROBATCHES, TOP_K = 16, 4096, 2, 2


def degrees(dp: int, pp: int = 1, tp: int = 1, ep: int = 1, shard: int = 1) -> dict:
    return dict(dp=dp, pp=pp, tp=tp, ep=ep, replicate=dp // shard, shard=shard)


def features(indices: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.as_tensor(indices, dtype=torch.float32)[:, None]
    return torch.sin(i * torch.arange(1, width + 1) * 1e-3), torch.cos(i[:, 0] * 0.1)


# -- the models ---------------------------------------------------------------


class Stack(torch.nn.Module):
    """``layers`` x Linear(width) with tanh; the last layer's output summed to
    one value a sample. A pipeline stage is this less the other stages' layers
    (keys keep the full model's names)."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(width, width)
                                           for i in range(layers)})
        self.last = str(layers - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x.sum(dim=1) if self.last in self.layers else x


def build_stack(args, tp: bool, pp: bool, fsdp: bool) -> Callable:  # noqa: ANN001
    def build(mesh):  # noqa: ANN001, ANN202 - the form a user writes
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
        from springback.worker import stage_layers

        torch.manual_seed(0)
        model = Stack(args.layers, args.width)
        if pp:
            kept = stage_layers(mesh, args.layers)
            for i in range(args.layers):
                if i not in kept:
                    del model.layers[str(i)]
        if tp:  # column-wise then row-wise: a pair takes and gives a replicated input
            parallelize_module(model, mesh["tp"], {
                f"layers.{n}": ColwiseParallel() if int(n) % 2 == 0 else RowwiseParallel()
                for n in model.layers})
        if fsdp:
            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh["replicate", "shard"])
            if not pp:
                fully_shard(model, mesh=mesh["replicate", "shard"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    return build


def _on(mesh, full: torch.Tensor, placements) -> torch.nn.Parameter:  # noqa: ANN001
    """`full` (seeded, the same on every rank) as a DTensor parameter, no collective."""
    from torch.distributed.tensor import DTensor, Shard

    local = full
    for dim, p in enumerate(placements):
        if isinstance(p, Shard):
            local = local.chunk(mesh.size(dim), dim=p.dim)[mesh.get_local_rank(dim)]
    return torch.nn.Parameter(DTensor.from_local(local.contiguous(), mesh, placements,
                                                 run_check=False))


def _local(p: torch.Tensor) -> torch.Tensor:
    """`p`'s local data; its gradient a Partial on the dims `p` is replicated on."""
    from torch.distributed.tensor import Partial, Replicate

    return p.to_local(grad_placements=[Partial() if isinstance(q, Replicate) else q
                                       for q in p.placements])


class Moe(torch.nn.Module):
    """A router and `experts` two-layer MLPs stacked ``[E, ...]`` on the
    ``("edp", "ep")`` expert mesh; top-2 routing, all-to-all dispatch over ``ep``."""

    def __init__(self, mesh, experts: int, width: int) -> None:  # noqa: ANN001
        super().__init__()
        from torch.distributed.tensor import Replicate, Shard

        rep, exp = (Replicate(), Replicate()), (Replicate(), Shard(0))
        self.experts = experts
        self.router = _on(mesh, torch.randn(width, experts) * 0.02, rep)
        self.w1 = _on(mesh, torch.randn(experts, width, width) * width ** -0.5, exp)
        self.w2 = _on(mesh, torch.randn(experts, width, width) * width ** -0.5, exp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        mesh = self.w1.device_mesh
        group, ep, ep_i = mesh.get_group("ep"), mesh.size(1), mesh.get_local_rank(1)
        per_rank, n = self.experts // ep, x.shape[0]
        scores = torch.softmax(x @ _local(self.router), dim=1)
        choice = torch.topk(scores.detach(), TOP_K, dim=1).indices
        gates, expert = scores.gather(1, choice), choice.reshape(-1)
        order = torch.argsort(expert, stable=True)  # by expert, so by the rank holding it
        sent_expert = expert[order]
        sent = x[torch.arange(n).repeat_interleave(TOP_K)[order]]
        counts = torch.bincount(sent_expert // per_rank, minlength=ep)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        out_splits, in_splits = received.tolist(), counts.tolist()
        their_x = funcol.all_to_all_single_autograd(sent, out_splits, in_splits, group)
        their_expert = torch.empty(sum(out_splits), dtype=torch.long)
        dist.all_to_all_single(their_expert, sent_expert, out_splits, in_splits, group=group)
        mine = their_expert - ep_i * per_rank
        w1, w2 = _local(self.w1), _local(self.w2)
        by = torch.argsort(mine, stable=True)
        chunks = their_x[by].split(torch.bincount(mine, minlength=per_rank).tolist())
        done = torch.cat([torch.tanh(c @ w1[e]) @ w2[e] for e, c in enumerate(chunks)])
        back = funcol.all_to_all_single_autograd(done[torch.argsort(by)], in_splits,
                                                 out_splits, group)
        per_choice = back[torch.argsort(order)].view(n, TOP_K, -1).sum(dim=2)
        return (gates * per_choice).sum(dim=1)


def build_moe(args, plain: bool) -> Callable:  # noqa: ANN001
    def build(mesh):  # noqa: ANN001, ANN202
        from springback.worker import expert_mesh

        torch.manual_seed(0)
        model = Moe(mesh if plain else expert_mesh(mesh), args.experts, args.width)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    return build


# -- the steps ----------------------------------------------------------------


def dense_step(model, opt, mesh, indices, width: int) -> float:  # noqa: ANN001
    x, y = features(indices, width)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def moe_step(model, opt, mesh, indices, width: int) -> float:  # noqa: ANN001
    x, y = features(indices, width)
    loss = ((model(x) - y) ** 2).sum() / GLOBAL_BATCH
    loss.backward()
    for p in model.parameters():  # sum the Partial gradients over their mesh
        p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
    opt.step()
    opt.zero_grad()
    return loss.item()


def pipe_step(model, opt, mesh, indices, width: int, fsdp: bool) -> float:  # noqa: ANN001
    """One GPipe step over ``mesh["pp"]``; without FSDP the dp replicas'
    gradients are all-reduced here."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    schedule = model.__dict__.get("_bench_schedule")
    pp = mesh["pp"]
    if schedule is None:
        stage = PipelineStage(model, pp.get_local_rank(), pp.size(), torch.device("cpu"),
                              group=pp.get_group())
        schedule = ScheduleGPipe(stage, MICROBATCHES, scale_grads=False,
                                 loss_fn=lambda out, y: ((out - y) ** 2).sum() / GLOBAL_BATCH)
        model.__dict__["_bench_schedule"] = schedule
    x, y = features(indices, width)
    losses: list[torch.Tensor] = []
    if pp.get_local_rank() == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    if not fsdp and mesh["replicate"].size() > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad, group=mesh.get_group("replicate"))
    opt.step()
    opt.zero_grad()
    return float(sum(loss.item() for loss in losses))


# -- the layouts --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    title: str
    world: int
    node: int
    """Ranks per node."""
    before: dict
    after: dict
    survivors: tuple
    """The old ranks of the new generation's ranks 0, 1, ... after the loss."""
    lost: tuple

    def build(self, args, plain: bool = False) -> Callable:  # noqa: ANN001
        if self.before["ep"] > 1:
            return build_moe(args, plain)
        return build_stack(args, tp=self.before["tp"] > 1, pp=self.before["pp"] > 1,
                           fsdp=self.before["tp"] > 1)

    def replicated(self, args) -> list[str]:  # noqa: ANN001
        """Plain parameters (the pp layout's), the same on every dp replica."""
        if self.before["tp"] > 1 or self.before["ep"] > 1:
            return []
        return [f"layers.{i}.{w}" for i in range(args.layers) for w in ("weight", "bias")]

    def step(self, args, model, opt, mesh, indices) -> float:  # noqa: ANN001
        if self.before["ep"] > 1:
            return moe_step(model, opt, mesh, indices, args.width)
        if self.before["pp"] > 1:
            return pipe_step(model, opt, mesh, indices, args.width, self.before["tp"] > 1)
        return dense_step(model, opt, mesh, indices, args.width)

    def plain_mesh(self, deg: dict):  # noqa: ANN201
        from torch.distributed.device_mesh import init_device_mesh

        if deg["ep"] > 1:  # pp = tp = 1: the dp ranks are the world, edp-major
            return init_device_mesh("cpu", (deg["dp"] // deg["ep"], deg["ep"]),
                                    mesh_dim_names=("edp", "ep"))
        return init_device_mesh("cpu", (deg["pp"], deg["replicate"], deg["shard"], deg["tp"]),
                                mesh_dim_names=("pp", "replicate", "shard", "tp"))


LAYOUTS = {
    "tp": Layout("DP2xTP2", 4, 2, degrees(2, tp=2), degrees(1, tp=2), (0, 1), (2, 3)),
    "pp": Layout("DP2xPP2", 4, 1, degrees(2, pp=2), degrees(1, pp=2), (0, 2), (3,)),
    "ep": Layout("DP4xEP2", 4, 2, degrees(4, ep=2, shard=2), degrees(2, ep=2, shard=2),
                 (0, 1), (2, 3)),
    "3d": Layout("FSDP2xTP2xPP2", 8, 2, degrees(2, pp=2, tp=2), degrees(1, pp=2, tp=2),
                 (0, 1, 4, 5), (6, 7)),
}


def indices_for(step: int, rank: int, deg: dict) -> torch.Tensor:
    """A plain script's batch: rank's dp share of step's seeded global batch
    (TP and PP peers, the same dp rank, get the same)."""
    batch = torch.randint(0, NUM_SAMPLES, (GLOBAL_BATCH,),
                          generator=torch.Generator().manual_seed(step))
    return batch.tensor_split(deg["dp"])[(rank // deg["tp"]) % deg["dp"]]


def local_mib(model, opt) -> float:  # noqa: ANN001
    def size(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    return sum(size(t) for t in [*model.parameters(), *(v for s in opt.state.values()
                                                         for v in s.values()
                                                         if isinstance(v, torch.Tensor)
                                                         and v.dim())]) / 2**20


# -- the rank processes ---------------------------------------------------------


def recover(rank: int, args, L: Layout, tmp: str, q: mp.Queue) -> None:  # noqa: ANN001
    """Node loss -> next step, in memory vs from S3 (sharded_recovery.py's way)."""
    store = dist.FileStore(os.path.join(tmp, "g1"), L.world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=L.world)
    build, replicated = L.build(args), L.replicated(args)
    first = SR.agreement(args, -1, build, replicated)
    outcome = first.agree_sharded(SR.plan(L.world, 1, nodes=L.world // L.node, layout=L.before),
                                  rank, dist.PrefixStore("sb", store))
    model, opt = first.ctx.state["model"], first.ctx.state["optimizer"]
    for s in (1, 2):
        L.step(args, model, opt, outcome.mesh, indices_for(s, rank, L.before))
    first.ctx.held.step_applied(2, None)
    SR.commit(args, rank, 2, model, opt, L.before, world=L.world)
    mib = local_mib(model, opt)
    store2 = SR.lose_node_1(rank, tmp, "g2", L.survivors)
    if store2 is None:
        return
    new_rank, world = L.survivors.index(rank), len(L.survivors)

    def step(m, o, mesh) -> None:  # noqa: ANN001
        L.step(args, m, o, mesh, indices_for(3, new_rank, L.after))
    nodes = max(world // L.node, 1)
    mem = SR.next_step_via(first, SR.plan(world, 1, nodes=nodes, layout=L.after), new_rank,
                           dist.PrefixStore("a", store2), args, step)
    fresh = SR.agreement(args, -1, build, replicated)  # a rank that holds nothing
    s3 = SR.next_step_via(fresh, SR.plan(world, 1, SR.newest_commit(args), nodes=nodes,
                                         layout=L.after), new_rank,
                          dist.PrefixStore("b", store2), args, step)
    if new_rank == 0:
        q.put({"memory": mem, "s3": s3, "rank_mib": mib, "load": os.getloadavg()[0]})
    dist.destroy_process_group()


def overhead(rank: int, args, L: Layout, tmp: str, q: mp.Queue) -> None:  # noqa: ANN001
    """One Session generation on every rank; in it a plain copy of the model
    and the Session's own stepped in alternating windows."""
    from springback.client.env import RankEnv
    from springback.worker import Session

    node, local_rank = divmod(rank, L.node)
    env = RankEnv(job_id="bench", member_id=f"node{node}", local_rank=local_rank,
                  control_dir=os.path.join(tmp, "control", f"node{node}"), coordinator="",
                  token=None, collective_timeout_s=600.0, rendezvous_timeout_s=600.0,
                  audit_dir="", metrics_file="")
    session = Session(build=L.build(args), env=env, replicated=L.replicated(args))
    for gen in session.generations():
        with gen:
            mesh = L.plain_mesh(L.before)
            plain_model, plain_opt = L.build(args, plain=True)(mesh)
            batches = iter(gen.batches())
            plain_step = [0]

            def plain() -> None:
                plain_step[0] += 1
                L.step(args, plain_model, plain_opt, mesh,
                       indices_for(plain_step[0], rank, L.before))

            def library() -> None:
                batch = next(batches)
                gen.report(loss=L.step(args, gen.model, gen.optimizer, gen.mesh,
                                       torch.as_tensor(batch.indices)))

            def window(fn: Callable[[], None], n: int) -> float:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                dist.barrier()
                return (time.perf_counter() - t0) / n

            window(plain, 2)
            window(library, 2)
            times: dict[str, list[float]] = {"plain": [], "springback": []}
            for i in range(args.rounds):
                for name in (("plain", "springback") if i % 2 == 0 else ("springback", "plain")):
                    times[name].append(window(plain if name == "plain" else library,
                                              args.window))
            if rank == 0:
                q.put({**times, "load": os.getloadavg()[0]})
        break


def rank_main(rank: int, args, name: str, tmp: str, q: mp.Queue) -> None:  # noqa: ANN001
    import warnings

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # RowwiseParallel's view
    torch.set_num_threads(1)
    L = LAYOUTS[name]
    recover(rank, args, L, tmp, q)
    overhead(rank, args, L, tmp, q)


def _result(q: mp.Queue, procs: list) -> dict:
    """The next result from rank 0; RuntimeError once a rank died without one."""
    import queue

    while True:
        try:
            return q.get(timeout=2)
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"a rank exited with {failed[0]} (its traceback above)")


def run_layout(ctx, args, name: str, q: mp.Queue) -> tuple[dict, dict]:  # noqa: ANN001
    """Publishes the Session phase's plan as the nodes' agents would and runs
    the layout's ranks: (recovery result, overhead result)."""
    from springback.client import plans
    from springback.service.transport.planboard import Posted
    from springback.v1 import types_pb2 as pb
    from springback.worker.control import PlanPublisher

    L = LAYOUTS[name]
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    plan = pb.Plan(job_id="bench", generation=1, action=pb.PLAN_ACTION_RUN, world_size=L.world,
                   master_addr="127.0.0.1", master_port=master.port,
                   layout=pb.ParallelLayout(**L.before))
    plan.spec.data.num_samples, plan.spec.data.global_batch_size = NUM_SAMPLES, GLOBAL_BATCH
    plan.spec.max_steps = 10**6
    for node in range(L.world // L.node):
        plan.members.add(member_id=f"node{node}", node_rank=node, first_rank=node * L.node,
                         num_local_ranks=L.node)
    plan.restore.kind = pb.RESTORE_KIND_NONE
    posted = Posted(plans.set_nodes(plan).SerializeToString(), 0)
    with tempfile.TemporaryDirectory() as tmp:
        for node in range(L.world // L.node):
            PlanPublisher(os.path.join(tmp, "control", f"node{node}")).publish(
                posted.slice(f"node{node}"))
        run_args = copy.copy(args)
        run_args.base = f"{args.base}/{name}"
        procs = [ctx.Process(target=rank_main, args=(r, run_args, name, tmp, q))
                 for r in range(L.world)]
        for p in procs:
            p.start()
        try:
            rec, over = _result(q, procs), _result(q, procs)
        except BaseException:
            for p in procs:  # a failed layout's other ranks wait in a collective
                p.kill()
            raise
        finally:
            for p in procs:
                p.join(120)
                if p.is_alive():
                    p.kill()
    return rec, over


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="tp,pp,ep,3d")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4, help="pairs of windows, plain / Session")
    ap.add_argument("--window", type=int, default=5, help="steps a window")
    args = ap.parse_args()
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}: choose from {list(LAYOUTS)}")
    from springback.v1 import types_pb2 as pb

    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    server, bucket = SR.s3_bucket(ctx, q)
    args.base = f"s3://{bucket}/ckpt"
    dense = args.layers * (args.width ** 2 + args.width) * 4 / 2**20
    moe = (2 * args.experts * args.width ** 2 + args.width * args.experts) * 4 / 2**20
    print(f"dense: {args.layers} x Linear({args.width}) {dense:.0f} MiB of parameters, "
          f"{dense * 3:.0f} MiB with AdamW; moe: {args.experts} experts {moe:.0f} MiB, "
          f"{moe * 3:.0f} MiB; global batch {GLOBAL_BATCH}; windows of {args.window} steps x "
          f"{args.rounds} pairs; load {os.getloadavg()[0]:.2f}", flush=True)
    header = (f"{'layout':<14} {'ranks':>5} {'MiB/rank':>8} {'in-mem s':>8} {'S3 s':>6} "
              f"{'ratio':>6} {'plain ms':>8} {'sb ms':>6} {'ovh %':>6} {'load':>5}")
    rows, notes = [], []
    for name in names:
        L = LAYOUTS[name]
        try:
            rec, over = run_layout(ctx, args, name, q)
        except Exception as e:  # noqa: BLE001 - a layout that fails is reported, the rest run
            rows.append(f"{L.title:<14} {L.world:>5} FAILED: {type(e).__name__}: {e}")
            print(rows[-1], flush=True)
            continue
        (mem_a, mem_s, mem_kind), (s3_a, s3_s, s3_kind) = rec["memory"], rec["s3"]
        plain, sb = statistics.median(over["plain"]), statistics.median(over["springback"])
        ratio = statistics.median(s / p for p, s in zip(over["plain"], over["springback"]))
        rows.append(f"{L.title:<14} {L.world:>5} {rec['rank_mib']:>8.0f} {mem_a:>8.2f} "
                    f"{s3_a:>6.2f} {s3_a / mem_a:>5.1f}x {plain * 1e3:>8.0f} {sb * 1e3:>6.0f} "
                    f"{(ratio - 1) * 100:>+6.1f} {over['load']:>5.2f}")
        kinds = "/".join(pb.RestoreKind.Name(k)[13:] for k in (mem_kind, s3_kind))
        notes.append(f"{L.title}: lost ranks {L.lost}, survivors {L.survivors}; restore kinds "
                     f"{kinds}; with the next step {mem_s:.2f} vs {s3_s:.2f} s "
                     f"({s3_s / mem_s:.1f}x); windows plain "
                     f"{[round(x * 1e3) for x in over['plain']]} vs Springback "
                     f"{[round(x * 1e3) for x in over['springback']]} ms")
        print(rows[-1], flush=True)
    server.kill()
    print("\nnode lost -> state agreed (in-mem vs S3, target >= 10x); per-step overhead "
          "(median of paired windows, target <= 3 %)")
    print(header)
    print("\n".join(rows))
    print("\n".join(notes))
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
