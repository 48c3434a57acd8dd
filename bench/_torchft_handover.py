"""torchft 0.2.0's side of bench/handover.py (run with .bench-venv's python):
a healthy replica serves the bench's state dict through torchft's checkpoint
transports and a recovering one receives it and loads it, as torchft's
Manager does (``send_checkpoint`` on the healthy side, ``recv_checkpoint`` then
``load_state_dict`` on the recovering one):

* HTTPTransport, ``num_chunks=0`` (the Manager's default) and chunked
  (``num_chunks=8``, fetched by parallel requests);
* PGTransport over torchft's ProcessGroupGloo (its in-place receive into the
  recovering replica's own state dict).

Each recovery is timed on the recovering process from a barrier to the state
loaded; prints ``RESULT <json>``: the times and the SHA-256 of the state loaded.

    .bench-venv/bin/python bench/_torchft_handover.py [--gib 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handover import build, digest  # noqa: E402 - the same state as Springback's side

TIMEOUT = timedelta(seconds=600)
HEALTHY, RECOVERING = 0, 1


def state_dict(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def load(model: torch.nn.Module, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])


def side(rank: int, args: argparse.Namespace, store_port: int, barrier: Any, urls: Any,
         q: Any) -> None:
    from torchft.checkpointing import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    model, opt = build(args.gib, seed=1 if rank == RECOVERING else 0)
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    pg.configure(f"127.0.0.1:{store_port}/handover", "0", rank, 2)
    times: dict[str, list[float]] = {}
    digests: dict[str, str] = {}
    for name, chunks in (("HTTPTransport (whole)", 0), ("HTTPTransport (8 chunks)", 8),
                         ("PGTransport (gloo)", None)):
        for rep in range(args.reps):
            if chunks is None:
                transport: Any = PGTransport(pg, TIMEOUT, torch.device("cpu"),
                                             state_dict=lambda: state_dict(model, opt))
            else:
                transport = HTTPTransport(TIMEOUT, num_chunks=chunks)
            if rank == HEALTHY:
                urls.put(transport.metadata())
            if rank == RECOVERING:
                metadata = urls.get()
                with torch.no_grad():  # other values than the healthy replica's
                    for t in [*model.parameters(), *(v for s in opt.state.values()
                                                     for v in s.values())]:
                        t.zero_()
            barrier.wait()
            t0 = time.perf_counter()
            if rank == HEALTHY:
                transport.send_checkpoint([RECOVERING], 1, state_dict(model, opt), TIMEOUT)
            else:
                load(model, opt, transport.recv_checkpoint(HEALTHY, metadata, 1, TIMEOUT))
                times.setdefault(name, []).append(time.perf_counter() - t0)
            barrier.wait()  # the healthy side serves until the recovering one is done
            if chunks is not None:
                transport.shutdown()
        if rank == RECOVERING:
            digests[name] = digest(model, opt)
    if rank == RECOVERING:
        q.put({"times": times, "digest": digests})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    barrier, urls, q = ctx.Barrier(2), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=side, args=(r, args, store.port, barrier, urls, q))
             for r in (HEALTHY, RECOVERING)]
    for proc in procs:
        proc.start()
    result = None
    while result is None:
        try:
            result = q.get(timeout=2)
        except queue.Empty:
            if any(proc.exitcode not in (None, 0) for proc in procs):
                raise SystemExit(f"a side failed: {[proc.exitcode for proc in procs]}")
    for proc in procs:
        proc.join(timeout=120)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
