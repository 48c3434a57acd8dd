"""Checkpoint stall in a real training loop: how long the step loop is blocked per
checkpoint, in one run on the same model + AdamW state (default ~200 MB).

Each repetition checkpoints the same training loop (forward + backward +
optimizer.step) three ways, in rotating order:
  (a) springback ``Checkpointer.save(..., optimizer=opt)``: stall = time in save()
      + time the next ``opt.step()`` waited in springback's step pre-hook for the
      background copy (``stats.last_hook_wait_s``);
  (b) ``torch.distributed.checkpoint.async_save()``: stall = time until it returns
      its future (it copies the state to host memory inside the call);
  (c) a plain in-memory copy of the state into preallocated buffers.
Stalls are medians over the repetitions (the first, buffer-allocating one is
reported apart). Besides the stall, it prints how much longer the first training
step after each checkpoint took than a step without one: background work (the
copy, serialization, writing) competes for the same cores, and that cost is not
hidden in the ratios. Prints springback/copy (target <= 2) and
springback/async_save (target <= 0.1).

    .venv/bin/python bench/checkpoint_stall.py [--mb 200] [--reps 7] [--batch 64] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from springback.storage import Checkpointer, model_state_dict, prune_to_record

WIDTH = 1024


def build(mb: int, device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    # params + 2 Adam moments = 3 x 4 bytes per parameter
    n_layers = max(1, round(mb * 2**20 / (3 * 4 * WIDTH * WIDTH)))
    layers: list[nn.Module] = []
    for _ in range(n_layers):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def tensors(sd: object) -> list[torch.Tensor]:
    if isinstance(sd, torch.Tensor):
        return [sd]
    if isinstance(sd, dict):
        return [t for v in sd.values() for t in tensors(v)]
    if isinstance(sd, (list, tuple)):
        return [t for v in sd for t in tensors(v)]
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64, help="training batch size (sets the step time)")
    ap.add_argument("--steps", type=int, default=2, help="training steps after each checkpoint")
    ap.add_argument("--device", default="cpu", help="where the state lives (cpu, or cuda: snapshots go to pinned host memory)")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir, removed)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="sb-stall-")
    os.makedirs(root, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{root}/rdzv", rank=0, world_size=1)
    cuda = args.device.startswith("cuda")
    model, opt = build(args.mb, args.device)
    x = torch.randn(args.batch, WIDTH, device=args.device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def train_step() -> float:
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync()
        return time.perf_counter() - t0

    train_step()  # creates the Adam state
    sd = model_state_dict(model, opt)  # live views: the same tensors the optimizer updates in place
    ts = tensors(sd)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    print(f"state: {len(ts)} tensors, {nbytes / 2**20:.0f} MiB, batch {args.batch}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}")

    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in ts]
    base = f"{root}/springback"
    ck = Checkpointer(base, rank=0, world_size=1,  # keep only the newest, as a record of one would
                      on_commit=lambda info: prune_to_record(base, [info.uri], current_generation=1))
    stall: dict[str, list[float]] = {"copy": [], "ours": [], "async": []}
    after: dict[str, list[float]] = {"copy": [], "ours": [], "async": [], "none": []}  # first step after
    extra: dict[str, list[float]] = {"ours": [], "async": []}  # steps' extra time until written
    steps_until_done: dict[str, list[int]] = {"ours": [], "async": []}
    ours_save: list[float] = []

    def undisturbed() -> float:
        return statistics.median(after["none"]) if after["none"] else after["copy"][-1]
    ours_hook: list[float] = []

    def until_done(kind: str, done: Callable[[], bool], first: float) -> None:
        """Trains on until the background work is done (at least --steps steps),
        then records the checkpoint's total cost: its stall plus every step's
        time above the undisturbed step, until then."""
        times = [first]
        while len(times) < args.steps or not done():
            times.append(train_step())
        extra[kind].append(sum(times) - len(times) * undisturbed())
        steps_until_done[kind].append(len(times))

    def ckpt_ours(i: int) -> None:
        t0 = time.perf_counter()
        ck.save(i, sd, generation=1, optimizer=opt)
        t_save = time.perf_counter() - t0
        first = train_step()  # its opt.step() waits in the hook if the copy is not done
        after["ours"].append(first)
        ours_save.append(t_save)
        ours_hook.append(ck.stats.last_hook_wait_s)
        stall["ours"].append(t_save + ck.stats.last_hook_wait_s)
        until_done("ours", lambda: not ck.in_flight(), first - ck.stats.last_hook_wait_s)
        ck.wait()

    def ckpt_async(i: int) -> None:
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=f"{root}/dcp/step-{i}")
        stall["async"].append(time.perf_counter() - t0)
        first = train_step()
        after["async"].append(first)
        until_done("async", fut.done, first)
        fut.result()
        shutil.rmtree(f"{root}/dcp/step-{i}", ignore_errors=True)

    def ckpt_copy(i: int) -> None:
        t0 = time.perf_counter()
        for b, t in zip(bufs, ts):
            b.copy_(t, non_blocking=cuda)
        sync()
        stall["copy"].append(time.perf_counter() - t0)
        after["copy"].append(train_step())
        for _ in range(args.steps - 1):
            train_step()

    def no_ckpt(i: int) -> None:
        for _ in range(args.steps):
            after["none"].append(train_step())

    # interleaved and rotated: these machines are shared, so all see the same conditions
    fns = [ckpt_ours, ckpt_async, ckpt_copy, no_ckpt]
    no_ckpt(0)  # an undisturbed step time before the first checkpoint's cost is counted
    for i in range(args.reps + 1):
        for fn in fns[i % 4 :] + fns[: i % 4]:
            fn(i)
    ck.close()
    bufs.clear()  # free the copy baseline's buffers

    med = {k: statistics.median(v[1:]) for k, v in stall.items()}
    step = statistics.median(after["none"])
    print(f"first call (allocating): copy {stall['copy'][0]*1e3:.1f} ms, springback {stall['ours'][0]*1e3:.1f} ms, "
          f"dcp.async_save {stall['async'][0]*1e3:.1f} ms")
    print(f"stall, median of {args.reps}: copy {med['copy']*1e3:.1f} ms, springback {med['ours']*1e3:.1f} ms "
          f"(save() {statistics.median(ours_save[1:])*1e3:.1f} + step hook {statistics.median(ours_hook[1:])*1e3:.1f}), "
          f"dcp.async_save {med['async']*1e3:.1f} ms")
    print(f"  springback per rep (ms): {[round(s * 1e3, 1) for s in stall['ours'][1:]]}")
    print(f"  async_save per rep (ms): {[round(s * 1e3, 1) for s in stall['async'][1:]]}")
    print(f"training step without checkpoint: {step*1e3:.0f} ms; first step after a checkpoint, extra: "
          + ", ".join(f"{k} {(statistics.median(after[k][1:]) - step)*1e3:+.0f} ms" for k in ("ours", "async", "copy")))
    total = {k: statistics.median([st + ex for st, ex in zip(stall[k][1:], extra[k][1:])])
             for k in ("ours", "async")}
    print("total cost (stall + the following steps' extra time until written), median: "
          + ", ".join(f"{name} {total[k]*1e3:.0f} ms over {statistics.median(steps_until_done[k][1:]):.0f} steps"
                      for k, name in (("ours", "springback"), ("async", "dcp.async_save"))))
    print(f"  springback per rep (ms): {[round((st + ex) * 1e3) for st, ex in zip(stall['ours'][1:], extra['ours'][1:])]}")
    print(f"  async_save per rep (ms): {[round((st + ex) * 1e3) for st, ex in zip(stall['async'][1:], extra['async'][1:])]}")
    print(f"springback / copy       = {med['ours'] / med['copy']:.3f}  (target <= 2)")
    print(f"springback / async_save = {med['ours'] / med['async']:.3f}  (target <= 0.1)")
    print(f"total cost, springback / async_save = {total['ours'] / total['async']:.3f}  (target <= 0.25)")
    dist.destroy_process_group()
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
