"""Goodput benchmark, torchft side: bench/_goodput_common.py's model under
torchft 0.2.0 (started by bench/goodput.py with the bench venv, bench/setup.sh).

One replica group per node, each of one rank with its own TCPStore; the
groups meet through the Lighthouse at TORCHFT_LIGHTHOUSE. Each step: a
quorum (`start_quorum`), forward and backward on this group's share of the
global batch, one `manager.allreduce` of the flattened gradients, then the
optimizer step only if `should_commit()`. torchft's own DDP wrapper is not
used: with torchft 0.2.0 it crashed every survivor at the first kill (an
``assert fut._fut`` in torchft/ddp.py after the manager swallowed the
all-reduce error); the flattened all-reduce is the setup that survives.

The participant of rank 0 appends JSON events to GOODPUT_EVENTS: ``step``
(each committed step) and ``done``. GOODPUT_TIMEOUT_S is the manager's and
the process group's timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo

import _goodput_common as C

EVENTS = os.environ.get("GOODPUT_EVENTS", "")
TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("GOODPUT_TIMEOUT_S", "5")))


def log(record: dict) -> None:
    if EVENTS:
        with open(EVENTS, "a") as f:
            f.write(json.dumps({"t": time.time(), **record}) + "\n")


def main() -> int:
    model, opt = C.make_model()
    params = [p for p in model.parameters()]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT), min_replica_size=2,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    opt.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        replica_id=os.environ.get("GOODPUT_NODE", "node"), rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=store.port, timeout=TIMEOUT,
        quorum_timeout=datetime.timedelta(seconds=60), connect_timeout=TIMEOUT)
    while manager.current_step() < C.MAX_STEPS:
        manager.start_quorum()
        step = manager.current_step() + 1
        world = manager.num_participants()
        rank = manager.participating_rank() or 0
        C.slow_compute(step)  # a slow node's compute (goodput.py --straggler)
        x, y = C.features(C.step_indices(step, world, rank).to(torch.float32))
        per_sample = (model(x).squeeze(1) - y) ** 2
        # the all-reduce averages over participants: local sum x world / G = global mean
        (per_sample.sum() * world / C.GLOBAL_BATCH).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        manager.allreduce(flat).wait()
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p))
            offset += n
        if manager.should_commit():
            opt.step()
            if manager.participating_rank() == 0:
                log({"event": "step", "step": manager.current_step(), "world_size": world,
                     "loss": per_sample.mean().item()})
        opt.zero_grad(set_to_none=False)
        if C.STEP_SLEEP_S:
            time.sleep(C.STEP_SLEEP_S)  # stand-in for compute
    if manager.participating_rank() == 0:
        log({"event": "done", "step": manager.current_step()})
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
