"""A joiner's hand-over of large DDP state: Springback's striped transfer vs
raw gloo point-to-point vs torchft 0.2.0's recovery transport, in one run.

Four gloo processes on loopback: ranks 0-2 hold the same model + AdamW state
(``--gib`` of it, 1 GiB by default: Linear(2048) layers, parameters and two
moments), rank 3 is a joiner holding other values. With 1, 2 and 3 holders
the joiner takes the state through the library's own start-of-generation
agreement (`StateAgreement.agree`, which hands it over with
`worker/state/handover.py`); each hand-over is timed on the joiner from a
barrier to the state loaded, and checked bit for bit (SHA-256). In the same
run and between the same processes, holder 0 sends the joiner the same
number of bytes as one flat tensor with gloo's own send (the link's speed
as gloo reaches it). torchft's side runs in the bench venv (bench/setup.sh)
in a subprocess, bench/_torchft_handover.py: a healthy replica serves the
same state dict with torchft's checkpoint transports (HTTPTransport, the
Manager's default, whole and in chunks; PGTransport over torchft's gloo
process group) and the recovering one receives and loads it.

Prints each time (median of ``--reps``), the throughput against raw gloo
(target ≥ 0.8x with one holder), the time with 3 holders against 1 (target
≤ 0.5x), torchft's best time against Springback's best (target ≥ 2x), and
the load average (two cores shared by other work make every figure noisy).

    .venv/bin/python bench/handover.py [--gib 1] [--reps 3] [--chunk-mib 8]
        [--holders 1,2,3] [--no-torchft]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parent
WIDTH = 2048
JOINER = 3


def build(gib: float, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear(WIDTH) layers with AdamW state: 12 bytes a parameter, `gib` GiB
    in all; one step taken so that both moments exist."""
    torch.manual_seed(seed)
    layers = max(1, round(gib * 2**30 / (12 * WIDTH * (WIDTH + 1))))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for t in [
        *model.state_dict().values(),
        *(v for s in opt.state_dict()["state"].values() for v in s.values())])


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in [*model.state_dict().values(),
              *(v for s in opt.state_dict()["state"].values() for v in s.values())]:
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def join_group(tmp: str, tag: str, members: list[int], rank: int) -> int | None:
    """A new default group of `members`; this process's rank in it, or None."""
    if rank not in members:
        return None
    store = dist.FileStore(os.path.join(tmp, tag), len(members))
    dist.init_process_group("gloo", store=store, rank=members.index(rank),
                            world_size=len(members), timeout=datetime.timedelta(seconds=300))
    return members.index(rank)


def raw_gloo(nbytes: int, me: int, joiner: int, buf: torch.Tensor) -> float:
    """Holder 0 sends `nbytes` as one tensor to the joiner: the joiner's seconds."""
    dist.barrier()
    t0 = time.perf_counter()
    if me == 0:
        dist.send(buf[:nbytes], joiner)
    elif me == joiner:
        dist.recv(buf[:nbytes], 0)
    return time.perf_counter() - t0


def springback(ag: Any, me: int, joiner: int, world: int) -> float:
    """One hand-over through the library's agreement: the joiner's seconds."""
    from springback.v1 import types_pb2 as pb
    from springback.worker.rank.heldstate import HeldState

    if me == joiner:  # holds other values, and no step
        with torch.no_grad():
            for t in [*ag.ctx.state["model"].parameters(), *(
                    v for s in ag.ctx.state["optimizer"].state.values() for v in s.values())]:
                t.zero_()
        ag.ctx.held = HeldState()  # holds nothing
    p = pb.Plan(generation=2, world_size=world)
    p.restore.kind, p.restore.source_rank = pb.RESTORE_KIND_PEERS, 0
    dist.barrier()
    t0 = time.perf_counter()
    ag.agree(p, me)
    return time.perf_counter() - t0


def rank_main(rank: int, args: argparse.Namespace, tmp: str, q: Any) -> None:
    from springback.worker.rank.context import RankContext
    from springback.worker.rank.heldstate import HeldState
    from springback.worker.state import handover
    from springback.worker.train.agreement import StateAgreement

    torch.set_num_threads(1)
    model, opt = build(args.gib, seed=1 if rank == JOINER else 0)
    nbytes = state_bytes(model, opt)
    ctx = RankContext(env=SimpleNamespace(rendezvous_timeout_s=300.0, job_id=""),  # type: ignore[arg-type]
                      state={"model": model, "optimizer": opt}, device=torch.device("cpu"),
                      held=HeldState(state_step=5, clean=True))
    ag = StateAgreement(ctx, None, None)
    trained = digest(model, opt) if rank == 0 else ""
    buf = torch.empty(nbytes, dtype=torch.uint8) if rank in (0, JOINER) else None
    out: dict[str, Any] = {"bytes": nbytes}
    for holders in args.holders:
        for chunk_mib in (args.chunk_mib if holders == 1 else args.chunk_mib[:1]):
            handover.CHUNK_BYTES = int(chunk_mib * 2**20)
            members = [*range(holders), JOINER]
            me = join_group(tmp, f"h{holders}-c{chunk_mib}", members, rank)
            if me is None:
                continue
            joiner = len(members) - 1
            if holders == 1 and chunk_mib == args.chunk_mib[0]:
                out["raw_s"] = [raw_gloo(nbytes, me, joiner, buf) for _ in range(args.reps)]
            times = [springback(ag, me, joiner, len(members)) for _ in range(args.reps)]
            out[f"sb_{holders}_{chunk_mib}"] = times
            if rank == JOINER:
                out[f"ok_{holders}_{chunk_mib}"] = digest(model, opt)
            dist.barrier()
            dist.destroy_process_group()
    if rank == 0:
        q.put({"trained": trained})
    if rank == JOINER:
        q.put(out)


def torchft_side(args: argparse.Namespace) -> dict[str, Any]:
    python = BENCH.parent / ".bench-venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: run bash bench/setup.sh (or pass --no-torchft)")
    done = subprocess.run([str(python), str(BENCH / "_torchft_handover.py"), "--gib",
                           str(args.gib), "--reps", str(args.reps)],
                          capture_output=True, text=True, timeout=3000,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"torchft's side failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(next(line for line in done.stdout.splitlines()
                           if line.startswith("RESULT "))[7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="model + optimizer state, GiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--holders", default="1,2,3")
    p.add_argument("--chunk-mib", default="8",
                   help="chunk sizes to measure with one holder (the first for 2 and 3)")
    p.add_argument("--no-torchft", action="store_true")
    args = p.parse_args()
    args.holders = [int(h) for h in args.holders.split(",")]
    args.chunk_mib = [float(c) for c in args.chunk_mib.split(",")]
    if any(h not in (1, 2, 3) for h in args.holders) or 1 not in args.holders:
        raise SystemExit("--holders: 1 must be measured, and at most 3 holders")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, args, tmp, q)) for r in range(4)]
        for proc in procs:
            proc.start()
        got = [q.get(timeout=3000) for _ in range(2)]
        for proc in procs:
            proc.join(timeout=120)
    if any(proc.exitcode != 0 for proc in procs):
        raise SystemExit(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}")
    trained = next(g["trained"] for g in got if "trained" in g)
    res = next(g for g in got if "bytes" in g)
    gib = res["bytes"] / 2**30
    med = statistics.median
    raw = med(res["raw_s"])
    print(f"state: {gib:.3f} GiB (model + AdamW), gloo on loopback, median of {args.reps}")
    print(f"raw gloo send, 1 holder:            {raw:7.3f} s  {gib / raw:6.2f} GiB/s")
    best = {}
    differs: list[str] = []  # a run whose received state is not the trained one, bit for bit
    for key in sorted(k for k in res if k.startswith("sb_")):
        _, holders, chunk = key.split("_")
        t = med(res[key])
        ok = "bit-identical" if res[f"ok_{holders}_{chunk}"] == trained else "DIFFERS"
        if ok == "DIFFERS":
            differs.append(f"springback, {holders} holder(s), {float(chunk):g} MiB chunks")
        print(f"springback, {holders} holder(s), {float(chunk):g} MiB chunks: {t:7.3f} s  "
              f"{gib / t:6.2f} GiB/s  {raw / t:5.2f}x raw gloo  ({ok})")
        best[int(holders)] = min(best.get(int(holders), t), t)
    if 3 in best:
        print(f"3 holders / 1 holder time:          {best[3] / best[1]:5.2f}x  (target <= 0.5)")
    print(f"1 holder throughput / raw gloo:     {raw / best[1]:5.2f}x  (target >= 0.8)")
    if not args.no_torchft:
        ft = torchft_side(args)
        for name, times in ft["times"].items():
            ok = "bit-identical" if ft["digest"][name] == trained else "DIFFERS"
            if ok == "DIFFERS":
                differs.append(f"torchft {name}")
            print(f"torchft {name:27s} {med(times):7.3f} s  {gib / med(times):6.2f} GiB/s ({ok})")
        fastest = min(med(t) for t in ft["times"].values())
        print(f"torchft's fastest / springback 1 holder:  {fastest / best[1]:5.2f}x  "
              "(target >= 2)")
        print(f"torchft's fastest / springback's fastest: {fastest / min(best.values()):5.2f}x")
    print("load average:", " ".join(open("/proc/loadavg").read().split()[:3]))
    if differs:  # a fast wrong answer is a failure, not a figure
        raise SystemExit(f"received state differs from the trained state: {', '.join(differs)}")


if __name__ == "__main__":
    main()
