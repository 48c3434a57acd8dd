"""Goodput benchmark, BASELINE side: the standard torchrun-elastic pattern.

Same model, data and step as bench/_springback_train.py (bench/_goodput_common.py),
with plain DDP on gloo. Every GOODPUT_CKPT_EVERY steps the job saves a
torch.distributed.checkpoint (DCP) to GOODPUT_CKPT_DIR/step_N and then points
GOODPUT_CKPT_DIR/latest at it; at start it loads the latest checkpoint if there
is one. torchrun restarts every worker on any membership change, so after each
restart the job resumes from the last checkpoint and redoes the steps after it.

Rank 0 appends JSON events to GOODPUT_EVENTS: ``start`` (one per worker-group
start), ``step`` and ``done``, each with ``run`` (which start it belongs to).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import _goodput_common as C

CKPT_DIR = Path(os.environ["GOODPUT_CKPT_DIR"])
CKPT_EVERY = int(os.environ.get("GOODPUT_CKPT_EVERY", "20"))
EVENTS = os.environ.get("GOODPUT_EVENTS", "")
GLOO_TIMEOUT_S = float(os.environ.get("GOODPUT_GLOO_TIMEOUT_S", "30"))


def log(rank: int, record: dict) -> None:
    if rank == 0 and EVENTS:
        with open(EVENTS, "a") as f:
            f.write(json.dumps({"t": time.time(), **record}) + "\n")


def main() -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    run = time.time_ns()
    model, opt = C.make_model()
    ddp = DDP(model)
    step = 0
    latest = CKPT_DIR / "latest"
    if latest.exists():
        msd, osd = get_state_dict(ddp, opt)
        state = {"model": msd, "optim": osd, "step": torch.zeros((), dtype=torch.int64)}
        dcp.load(state, checkpoint_id=str(CKPT_DIR / latest.read_text().strip()))
        set_state_dict(ddp, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(state["step"])
    log(rank, {"event": "start", "run": run, "world_size": world, "resume_step": step,
               "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))})
    scale = world / C.GLOBAL_BATCH  # DDP averages over ranks; local sum x world/G = global mean
    while step < C.MAX_STEPS:
        step += 1
        loss = C.train_step(ddp, opt, C.step_indices(step, world, rank), scale)
        log(rank, {"event": "step", "run": run, "step": step, "world_size": world, "loss": loss})
        if step % CKPT_EVERY == 0 or step == C.MAX_STEPS:
            msd, osd = get_state_dict(ddp, opt)
            name = f"step_{step}"
            dcp.save({"model": msd, "optim": osd, "step": torch.tensor(step)},
                     checkpoint_id=str(CKPT_DIR / name))
            if rank == 0:  # dcp.save returned: the metadata is written; publish it
                tmp = CKPT_DIR / "latest.tmp"
                tmp.write_text(name)
                os.replace(tmp, latest)
    log(rank, {"event": "done", "run": run, "step": step})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
