"""Sharded goodput benchmark, torchft side (bench/goodput.py --sharded):
bench/_goodput_common.py's `Blocks` model under torchft 0.2.0's fault
tolerant HSDP, set up as torchtitan's torchft integration does it
(torchtitan/components/ft/manager.py; torchft's README points there for HSDP).

One replica group = one torchrun job over two one-rank nodes (bench/_baselines.py
starts them): FSDP2 over the group's own process group (``init_device_mesh``
with one ``dp_shard`` dimension of the group's size, every block and the root
one unit), and the replicate dimension fault tolerant: a torchft `Manager`
per rank (group rank 0 runs the manager server that meets the other groups at
the Lighthouse), its ``ManagedProcessGroup`` registered as ``dp_replicate``,
and every FSDP unit's ``set_all_reduce_hook`` averaging the reduce-scattered
gradient shards over it. ``OptimizerWrapper.zero_grad`` starts the (async)
quorum; AdamW steps only when ``should_commit()`` (OptimizerWrapper.step's
rule, written out to log the committed step). A group that loses a
node loses its shard group: its other rank's next FSDP collective fails, the
rank exits, torchrun restarts the group once the replacement node has joined
its rendezvous, and the new group heals from a live group, rank by rank
(torchft's HTTP checkpoint transport, this rank's shards: the model's local
tensors and AdamW's).

The data-parallel rank is participating replica rank x group size + group
rank, the data-parallel world participants x group size: each step takes
its share of bench/_goodput_common.py's global batch. Rank 0 of the
participating replica 0 appends JSON events to GOODPUT_EVENTS: ``step``
(each committed step) and ``done``. GOODPUT_TIMEOUT_S is the manager's and
the replicate process group's timeout, GOODPUT_GLOO_TIMEOUT_S the shard
group's.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torchft import Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper
from torchft.process_group import ManagedProcessGroup

import _goodput_common as C

EVENTS = os.environ.get("GOODPUT_EVENTS", "")
TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("GOODPUT_TIMEOUT_S", "5")))
GLOO_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("GOODPUT_GLOO_TIMEOUT_S", "10")))


def log(record: dict) -> None:
    if EVENTS:
        with open(EVENTS, "a") as f:
            f.write(json.dumps({"t": time.time(), **record}) + "\n")


def _local(value: object) -> object:
    return value.to_local() if isinstance(value, DTensor) else value


def main() -> int:
    dist.init_process_group("gloo", timeout=GLOO_TIMEOUT)  # the replica group (torchrun's env)
    group_rank, group_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (group_size,), mesh_dim_names=("dp_shard",))
    model = C.make_blocks()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = C.make_adamw(model)
    params = list(model.parameters())

    def model_state() -> dict:
        return {k: _local(v) for k, v in model.state_dict().items()}

    def load_model(state: dict) -> None:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                _local(v).copy_(state[k])

    def optim_state() -> list[dict]:
        return [{k: _local(v) for k, v in opt.state[p].items()} for p in params]

    def load_optim(state: list[dict]) -> None:
        with torch.no_grad():
            for p, entry in zip(params, state):
                mine = opt.state[p]
                for k, v in entry.items():
                    if k == "step":
                        mine[k] = v.clone()
                        continue
                    if k not in mine:
                        mine[k] = torch.zeros_like(p)
                    _local(mine[k]).copy_(v)

    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT), min_replica_size=1, load_state_dict=None,
        state_dict=None, use_async_quorum=True,
        replica_id=f"goodput_hsdp_{os.environ.get('GOODPUT_GROUP', '0')}", timeout=TIMEOUT,
        quorum_timeout=datetime.timedelta(seconds=60), connect_timeout=TIMEOUT)
    manager.register_state_dict_fn("model", load_model, model_state)
    manager.register_state_dict_fn("optim", load_optim, optim_state)
    replicate_pg = ManagedProcessGroup(manager)
    replicate_pg.register("dp_replicate")

    def all_reduce_hook(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=replicate_pg, op=dist.ReduceOp.AVG)

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(all_reduce_hook)
    optimizer = OptimizerWrapper(manager, opt)
    while manager.current_step() < C.MAX_STEPS:
        optimizer.zero_grad()  # starts the quorum
        step = manager.current_step() + 1
        world = manager.num_participants() * group_size
        rank = (manager.participating_rank() or 0) * group_size + group_rank
        x, y = C.features(C.step_indices(step, world, rank).to(torch.float32))
        per_sample = (model(x).squeeze(1) - y) ** 2
        # FSDP and the hook both average: local sum x world / G = the global mean
        (per_sample.sum() * world / C.GLOBAL_BATCH).backward()
        committed = manager.should_commit()
        if committed:
            opt.step()
            if rank == 0:
                log({"event": "step", "step": manager.current_step(), "world_size": world,
                     "loss": per_sample.mean().item()})
        if C.STEP_SLEEP_S:
            time.sleep(C.STEP_SLEEP_S)  # stand-in for compute
    if (manager.participating_rank() or 0) == 0 and group_rank == 0:
        log({"event": "done", "step": manager.current_step()})
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
