"""Node loss under HSDP: next step through the in-memory reshard vs through a
restore from S3 (a moto server on 127.0.0.1), in the same run.

Four gloo ranks train an FSDP2 model (``--layers`` Linear(``--width``) blocks,
AdamW; ≥ 200 MiB of parameters plus optimizer state by default) on a
replicate=2 x shard=2 mesh, commit a checkpoint to S3, then ranks 2 and 3 (a
node) exit. The two survivors form a new group and reach their next step
twice, through the library's own start-of-generation agreement
(`worker/train/agreement.py`):

* in memory: build on the new mesh, fill every shard from the surviving
  replica (no storage read);
* from S3: build on the new mesh, restore the committed checkpoint (DCP).

Prints both recovery times (node lost -> the state agreed, ready for the next
step), their ratio (target ≥ 10x), the same with the next step included (on a
CPU that step takes about a second and counts in both), and the load average.
The build runs on the meta device in both paths (every value is filled).

``--scenario fsdp`` (also run by the default ``both``): pure FSDP (shard=4
over two nodes of two ranks, no replica), peer copies every K steps
(`worker/state/peercopy.py`, K = the spec's default). It measures the step time
with and without the copies in the same run (target: ≤ 5 % more), the host
memory they take per rank, then loses the node of ranks 2 and 3: the
survivors reach their next step through the peer copies (rolled back to the
copy step) vs through a restore of the checkpoint committed at that step
from S3.

    .venv/bin/python bench/sharded_recovery.py [--layers 5 --width 2048] [--scenario both]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from s3_throughput import _serve_moto  # noqa: E402 - the same moto child process


def build(args: argparse.Namespace):  # noqa: ANN201
    from torch.distributed.fsdp import fully_shard

    def build_on(mesh):  # noqa: ANN001, ANN202
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                      for _ in range(args.layers)])
        for block in model:
            fully_shard(block, mesh=mesh["replicate", "shard"])
        fully_shard(model, mesh=mesh["replicate", "shard"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    return build_on


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, width: int) -> None:
    model(torch.randn(8, width)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def plan(world: int, replicate: int, ref=None, nodes: int = 1, kind=None,  # noqa: ANN001, ANN201
         layout: dict | None = None):
    """Generation 2's plan over `world` ranks on `nodes` equal nodes: HSDP
    (dp = world) unless `layout` gives the ParallelLayout's degrees."""
    from springback.client import plans
    from springback.v1 import types_pb2 as pb

    p = pb.Plan(generation=2, world_size=world, layout=pb.ParallelLayout(
        **(layout or dict(dp=world, tp=1, pp=1, ep=1, replicate=replicate,
                          shard=world // replicate))))
    p.restore.kind = kind or (pb.RESTORE_KIND_PEERS if ref is None else pb.RESTORE_KIND_CHECKPOINT)
    if ref is not None:
        p.restore.checkpoint.CopyFrom(ref)
    for node in range(nodes):
        p.members.add(member_id=f"node{node}", node_rank=node,
                      first_rank=node * world // nodes, num_local_ranks=world // nodes)
    return plans.set_nodes(p)


def agreement(args, ctx_step: int, build_fn=None, replicated=()):  # noqa: ANN001, ANN201
    from springback.worker.train.agreement import StateAgreement
    from springback.worker.train.checkpointing import restore_from_checkpoint
    from springback.worker.rank.context import RankContext
    from springback.worker.rank.heldstate import HeldState
    from springback.worker.state.sharded import ShardedModel

    ctx = RankContext(env=SimpleNamespace(rendezvous_timeout_s=120.0, job_id="bench"),
                     state={},  # type: ignore[arg-type]
                      device=torch.device("cpu"), held=HeldState(state_step=ctx_step))
    return StateAgreement(ctx, restore_from_checkpoint,
                          ShardedModel(build_fn or build(args), replicated=replicated))


def commit(args, rank: int, step: int, model, opt, layout: dict,  # noqa: ANN001
           world: int = 4) -> None:
    """Every rank: checkpoints `step` to S3 and waits for the commit."""
    from springback.storage import Checkpointer, model_state_dict
    from springback.storage.snapshot import plain_entries

    state = model_state_dict(model, opt)
    holders = None
    if layout.get("pp", 1) > 1:  # the stages hold different plain entries: say whose
        gathered: list = [None] * world
        dist.all_gather_object(gathered, plain_entries(state))
        holders = {fqn: (size, tuple(r for r, e in enumerate(gathered) if fqn in e))
                   for e in gathered for fqn, size in e.items()}
    ck = Checkpointer(args.base, rank=rank, world_size=world)
    ck.save(step, state, generation=1, cursor=(0, 0), layout=layout, holders=holders)
    ck.wait(600)
    ck.close(60)


def next_step_via(agreed, new_plan, rank: int, store, args,  # noqa: ANN001
                  step=None) -> tuple[float, float, int]:  # noqa: ANN001
    """The survivors' start of generation 2 through `agreed` (its agreement),
    then one step (`step(model, optimizer, mesh)`, else `train_step`):
    (seconds to the agreed state, to the step's end, restore kind)."""
    t0 = time.perf_counter()
    outcome = agreed.agree_sharded(new_plan, rank, store)
    agree_s = time.perf_counter() - t0
    model, opt = agreed.ctx.state["model"], agreed.ctx.state["optimizer"]
    if step is None:
        train_step(model, opt, args.width)
    else:
        step(model, opt, outcome.mesh)
    return agree_s, time.perf_counter() - t0, outcome.kind


def newest_commit(args):  # noqa: ANN001, ANN201
    from springback.storage import committed_checkpoints
    from springback.v1 import types_pb2 as pb

    newest = committed_checkpoints(args.base)[-1]
    return pb.CheckpointRef(uri=newest.uri, step=newest.step, generation=newest.generation)


def lose_node_1(rank: int, tmp: str, name: str, survivors=(0, 1)) -> dist.Store | None:  # noqa: ANN001
    """Node 1 (ranks 2 and 3) is lost: the survivors form a new group, in
    which `survivors[i]` is rank i (returns its store; None on the others)."""
    dist.barrier()
    dist.destroy_process_group()
    if rank not in survivors:
        return None
    store = dist.FileStore(os.path.join(tmp, name), len(survivors))
    dist.init_process_group("gloo", store=store, rank=survivors.index(rank),
                            world_size=len(survivors))
    return store


def rank_main(rank: int, args: argparse.Namespace, tmp: str, q: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "g1"), 4)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
    first = agreement(args, -1)
    first.agree_sharded(plan(4, replicate=2), rank, dist.PrefixStore("sb", store))
    model, opt = first.ctx.state["model"], first.ctx.state["optimizer"]
    train_step(model, opt, args.width)
    t0 = time.perf_counter()
    for _ in range(3):
        train_step(model, opt, args.width)
    step_s = (time.perf_counter() - t0) / 3
    first.ctx.held.step_applied(4, None)
    commit(args, rank, 4, model, opt, {"dp": 4, "replicate": 2, "shard": 2})
    state_mib = sum(t.to_local().numel() * t.element_size() for t in
                    [*model.parameters(), *(v for s in opt.state.values() for v in s.values()
                                            if isinstance(v, torch.Tensor) and v.dim())])
    store2 = lose_node_1(rank, tmp, "g2")
    if store2 is None:
        return
    memory_agree_s, memory_s, kind = next_step_via(first, plan(2, replicate=1), rank,
                                                   dist.PrefixStore("a", store2), args)
    fresh = agreement(args, -1)  # a rank that holds nothing: the storage path
    s3_agree_s, s3_s, kind_s3 = next_step_via(fresh, plan(2, 1, newest_commit(args)), rank,
                                              dist.PrefixStore("b", store2), args)
    if rank == 0:
        q.put({"memory_s": memory_s, "s3_s": s3_s, "step_s": step_s, "kinds": (kind, kind_s3),
               "memory_agree_s": memory_agree_s, "s3_agree_s": s3_agree_s,
               "rank_state_mib": state_mib / 2**20})
    dist.destroy_process_group()


def timed_steps(model, opt, args, ctx, first_step: int, n: int,  # noqa: ANN001
                copies=None) -> tuple[float, float]:  # noqa: ANN001
    """Wall and CPU seconds (this process, gloo's threads included) per step
    over `n` steps, each ended by the peer copies' boundary."""
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(first_step, first_step + n):
        train_step(model, opt, args.width)
        ctx.held.step_applied(step, None)
        if copies is not None:
            copies.after_step(step)
    if copies is not None:
        copies.settle()  # the transfer's cost inside its window
    dist.barrier()
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


def fsdp_rank_main(rank: int, args: argparse.Namespace, tmp: str, q: mp.Queue) -> None:
    """Pure FSDP on two nodes of two ranks with peer copies; node 1 lost."""
    from springback.client.spec import DEFAULT_PEER_COPY_EVERY_STEPS as K
    from springback.v1 import types_pb2 as pb
    from springback.worker.state.peercopy import GenerationCopies

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "f1"), 4)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
    first = agreement(args, -1)
    first_plan = plan(4, replicate=1, nodes=2)
    first.agree_sharded(first_plan, rank, dist.PrefixStore("sb", store))
    ctx = first.ctx
    model, opt = ctx.state["model"], ctx.state["optimizer"]
    train_step(model, opt, args.width)  # AdamW state exists from here
    copies = GenerationCopies.for_generation(first.copies, ctx, first.sharded, first_plan, rank)
    assert copies is not None
    # K steps without and K with copies (one copy each), --rounds times, in
    # ABBA order: a drift of the machine's load hits both alike
    plain, with_copies, step = [], [], 1
    for i in range(args.rounds):
        for with_them in ((False, True) if i % 2 == 0 else (True, False)):
            (with_copies if with_them else plain).append(
                timed_steps(model, opt, args, ctx, step + 1, K, copies if with_them else None))
            step += K
    timed_steps(model, opt, args, ctx, step + 1, K, copies)  # the loss comes after a copy
    step += K
    copy_step = max(s.step for s in first.copies.own)
    commit(args, rank, copy_step, model, opt, {"dp": 4, "replicate": 1, "shard": 4})
    train_step(model, opt, args.width)  # the survivors' live state moves past the copy
    ctx.held.step_applied(step + 1, None)
    held_mib = first.copies.nbytes() / 2**20
    shard_mib = sum(t.numel() * t.element_size() for t, _ in first.sharded.shards().values()) / 2**20
    store2 = lose_node_1(rank, tmp, "f2")
    if store2 is None:
        return
    ref = newest_commit(args)
    copy_agree_s, copy_s, kind = next_step_via(
        first, plan(2, 1, ref, kind=pb.RESTORE_KIND_PEERS), rank, dist.PrefixStore("a", store2),
        args)
    rolled_to = ctx.state_step  # set by the roll-back (the step itself does not count)
    fresh = agreement(args, -1)  # a rank that holds nothing: the storage path
    s3_agree_s, s3_s, kind_s3 = next_step_via(fresh, plan(2, 1, ref), rank,
                                              dist.PrefixStore("b", store2), args)
    if rank == 0:
        q.put({"copy_agree_s": copy_agree_s, "s3_agree_s": s3_agree_s, "plain_s": plain,
               "copies_s": with_copies, "in_loop_s": copies.snapshot_s / ((args.rounds + 1) * K),
               "held_mib": held_mib, "shard_mib": shard_mib, "copy_s": copy_s, "s3_s": s3_s,
               "kinds": (pb.RestoreKind.Name(kind), pb.RestoreKind.Name(kind_s3)),
               "rolled_to": rolled_to, "live_step": step + 1, "k": K})
    dist.destroy_process_group()


def run_ranks(ctx, target, args, q) -> dict:  # noqa: ANN001
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=target, args=(r, args, tmp, q)) for r in range(4)]
        for p in procs:
            p.start()
        result = q.get(timeout=1800)
        for p in procs:
            p.join(120)
    return result


def report_fsdp(r: dict) -> None:
    for i, what in ((0, "wall"), (1, "CPU (rank 0's process)")):
        plain = [w[i] for w in r["plain_s"]]
        copies = [w[i] for w in r["copies_s"]]
        ratio = statistics.median(c / p for p, c in zip(plain, copies))
        print(f"FSDP shard=4 over 2 nodes, peer copies every K={r['k']} steps, {what} time per "
              f"step: {statistics.median(plain) * 1e3:.0f} ms without, "
              f"{statistics.median(copies) * 1e3:.0f} ms with copies (medians; median of the "
              f"paired windows' ratios {(ratio - 1) * 100:+.1f} %, target <= 5 %; windows of K "
              f"steps {[round(x * 1e3) for x in plain]} vs {[round(x * 1e3) for x in copies]} ms)")
    plain = statistics.median(w[0] for w in r["plain_s"])
    print(f"  the step loop's own share "
          f"(snapshot + waits) {r['in_loop_s'] * 1e3:.1f} ms/step = "
          f"{r['in_loop_s'] / plain * 100:.2f} %; load {os.getloadavg()[0]:.2f}")
    print(f"peer copies in host memory per rank: {r['held_mib']:.1f} MiB (own snapshot + the "
          f"copy it keeps for its partner, and the buffers of the pair they replaced, which the "
          f"next copy fills: the peak while a copy travels) for {r['shard_mib']:.1f} MiB of shards: "
          f"{r['held_mib'] / r['shard_mib']:.2f}x")
    print(f"node lost -> recovered (state agreed: build + fill): via peer copies "
          f"{r['copy_agree_s']:.2f} s (rolled back from step {r['live_step']} to "
          f"{r['rolled_to']}), from S3 (moto) {r['s3_agree_s']:.2f} s: "
          f"{r['s3_agree_s'] / r['copy_agree_s']:.1f}x (target >= 10x); restore kinds "
          f"{r['kinds']}; load {os.getloadavg()[0]:.2f}")
    print(f"  with the next step (it counts in both): via peer copies {r['copy_s']:.2f} s, "
          f"from S3 {r['s3_s']:.2f} s: {r['s3_s'] / r['copy_s']:.1f}x")


def s3_bucket(ctx, q: mp.Queue):  # noqa: ANN001, ANN201
    """Starts the moto S3 server child, makes a fresh bucket on it and points
    this process (and the ranks it spawns) at it: (server process, bucket)."""
    server = ctx.Process(target=_serve_moto, args=(q,), daemon=True)
    server.start()
    host, port = q.get(timeout=60)
    endpoint = f"http://{host}:{port}"
    import boto3

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=bucket)
    os.environ.update({"SPRINGBACK_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
    return server, bucket


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--scenario", choices=("hsdp", "fsdp", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=4,
                    help="fsdp: pairs of K-step windows without / with copies")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    server, bucket = s3_bucket(ctx, q)
    args.base = f"s3://{bucket}/ckpt"
    params = args.layers * (args.width * args.width + args.width)
    print(f"model: {args.layers} x Linear({args.width}): {params * 4 / 2**20:.0f} MiB of "
          f"parameters, {params * 12 / 2**20:.0f} MiB with AdamW state; 4 ranks; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    if args.scenario in ("fsdp", "both"):
        report_fsdp(run_ranks(ctx, fsdp_rank_main, args, q))
    if args.scenario == "fsdp":
        server.kill()
        return
    result = run_ranks(ctx, rank_main, args, q)
    server.kill()
    print(f"HSDP replicate=2 x shard=2, per rank before the loss: "
          f"{result['rank_state_mib']:.0f} MiB of shards; "
          f"step {result['step_s'] * 1e3:.0f} ms")
    print(f"node lost -> recovered (state agreed: build + fill): in memory "
          f"{result['memory_agree_s']:.2f} s, from S3 (moto) {result['s3_agree_s']:.2f} s: "
          f"{result['s3_agree_s'] / result['memory_agree_s']:.1f}x (target >= 10x); "
          f"restore kinds {result['kinds']}; load {os.getloadavg()[0]:.2f}")
    print(f"  with the next step (it counts in both): in memory {result['memory_s']:.2f} s, "
          f"from S3 {result['s3_s']:.2f} s: {result['s3_s'] / result['memory_s']:.1f}x")


if __name__ == "__main__":
    main()
