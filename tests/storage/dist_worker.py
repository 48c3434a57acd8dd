"""One rank of a multi-process checkpoint test; run as ``python dist_worker.py '<json>'``.

Modes:
  save     train a tiny model 3 steps (DDP or FSDP2 on gloo), checkpoint step 3,
           then write the full (gathered) model+optimizer state to ``out`` (rank 0).
  restore  build the same model at this world size with different init, restore the
           newest checkpoint, write the full state and the manifest facts to ``out``.
  hang     save step 1 normally; then save step 2 where rank ``hang_rank`` blocks in
           the middle of its shard upload (until killed). Rank 0 writes the outcome
           of step 2's commit to ``out``.
  stages   pipeline stages under FSDP2: a mesh (pp 2, shard world/2), stage s
           holds layer s only, sharded over its slice mesh["shard"]; checkpoint
           step 1 and write each stage's full layer to ``out``-s.pt.
  brownout restore a plain state (zeros of ``shapes``) from ``base`` through
           ``storage_options`` (a failing S3 endpoint) and write the restored
           state and the store's retry counters to ``out``-rank.pt.
  die_before_commit  save step 1 normally; then save step 2, where rank 0 (the
           committer), once every shard is durable, creates the file ``out`` and
           blocks just before writing ``.metadata`` (until killed).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn


def build(parallel: str, world: int, seed: int,
          mesh_shape: list[int] | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 7))  # 33: uneven shards
    if parallel == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # (replicate, shard): HSDP over a 2-D mesh when given, else FSDP over all ranks
        shape = tuple(mesh_shape or (world,))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # deep copy: for unsharded modules these tensors alias the live parameters
    return copy.deepcopy({"model": msd, "optim": osd})


def main() -> None:
    a = json.loads(sys.argv[1])
    rank, world = a["rank"], a["world"]
    from springback.storage import Checkpointer, restore_model
    from springback.storage.restoring import model_state_dict

    if a["mode"] == "hang":
        return hang(a, rank, world)
    if a["mode"] == "die_before_commit":
        return die_before_commit(a, rank, world)
    dist.init_process_group("gloo", init_method=f"file://{a['rendezvous']}", rank=rank, world_size=world)
    try:
        if a["mode"] == "brownout":
            brownout(a, rank)
        elif a["mode"] == "stages":
            stages(a, rank, world)
        elif a["mode"] == "save":
            model, opt = build(a["parallel"], world, seed=0, mesh_shape=a.get("mesh"))
            g = torch.Generator().manual_seed(100 + rank)
            for _ in range(3):
                loss = model(torch.randn(4, 16, generator=g)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            ck = Checkpointer(a["base"], rank=rank, world_size=world, commit_timeout_s=60, poll_interval_s=0.05)
            ck.save(3, model_state_dict(model, opt), generation=1, cursor=(1, 96), layout={"dp": world})
            ck.wait(60)
            ck.close()
            full = full_state(model, opt)
            if rank == 0:
                torch.save(full, a["out"])
        else:
            model, opt = build(a["parallel"], world, seed=1234, mesh_shape=a.get("mesh"))
            res = restore_model(a["base"], model, opt, restore_rng=True)
            full = full_state(model, opt)
            # one more step works on the restored state
            model(torch.randn(2, 16)).sum().backward()
            opt.step()
            if rank == 0:
                torch.save({**full, "step": res.step, "cursor": [res.manifest.cursor.epoch, res.manifest.cursor.offset],
                            "writers": res.manifest.world_size, "skipped": [u for u, _ in res.skipped]}, a["out"])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def brownout(a: dict, rank: int) -> None:
    from springback.storage import RetryPolicy, restore
    from springback.storage.store import ObjectStore

    store = ObjectStore(a["base"], storage_options=a["storage_options"], retry=RetryPolicy(**a["retry"]))
    sd = {k: torch.zeros(shape) for k, shape in a["shapes"].items()}
    res = restore(a["base"], sd, store=store)
    s = store.stats
    torch.save({"state": sd, "step": res.step, "skipped": [u for u, _ in res.skipped], "retries": s.retries,
                "collective_retries": s.collective_retries, "gave_up": s.gave_up}, f"{a['out']}-{rank}.pt")


def stages(a: dict, rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from springback.storage import Checkpointer

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "shard"))
    stage = mesh.get_local_rank("pp")
    torch.manual_seed(stage)
    model = nn.Sequential()
    model.add_module(f"layer{stage}", nn.Linear(16, 33))
    fully_shard(model, mesh=mesh["shard"])  # a slice of the root mesh: pp left out
    ck = Checkpointer(a["base"], rank=rank, world_size=world, commit_timeout_s=60, poll_interval_s=0.05)
    ck.save(1, {"model": model.state_dict()}, generation=1, layout={"pp": 2, "dp": world // 2})
    ck.wait(60)
    ck.close()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if mesh.get_local_rank("shard") == 0:
        torch.save(full, f"{a['out']}-{stage}.pt")


def hang(a: dict, rank: int, world: int) -> None:
    from springback.storage import Checkpointer, CommitTimeout
    from springback.storage.store import ObjectStore

    class BlockingStore(ObjectStore):
        """Blocks forever after the first 64 KiB of one checkpoint's shard (a stuck upload)."""

        def write_file(self, uri, produce):
            if "step-00000002" not in uri or not uri.endswith(".distcp"):
                return super().write_file(uri, produce)

            def blocked(f):
                class W:
                    n = 0

                    def write(self, b):
                        f.write(b)
                        W.n += len(memoryview(b).cast("B"))
                        if W.n >= 65536:
                            f.flush()
                            threading.Event().wait()  # until SIGKILL
                        return len(memoryview(b).cast("B"))

                return produce(W())

            return super().write_file(uri, blocked)

    store = BlockingStore(a["base"]) if rank == a["hang_rank"] else ObjectStore(a["base"])
    ck = Checkpointer(a["base"], rank=rank, world_size=world, store=store, commit_timeout_s=a["commit_timeout_s"], poll_interval_s=0.05)
    sd = {"w": torch.randn(512, 512), "b": torch.randn(512), "x": torch.randn(300, 300)}
    ck.save(1, sd, generation=1)
    ck.wait(60)
    fut = ck.save(2, sd, generation=1)
    try:
        fut.result(timeout=120)
        outcome = {"committed": True}
    except CommitTimeout as exc:
        outcome = {"committed": False, "error": "CommitTimeout", "missing": exc.missing_ranks}
    if rank == 0:
        with open(a["out"], "w") as f:
            json.dump(outcome, f)


def die_before_commit(a: dict, rank: int, world: int) -> None:
    from pathlib import Path

    from springback.storage import Checkpointer
    from springback.storage.store import ObjectStore

    class DiesAtCommit(ObjectStore):
        def put_bytes(self, uri, data, **kw):
            if "step-00000002" in uri and uri.endswith("/.metadata"):
                Path(a["out"]).touch()
                threading.Event().wait()  # until SIGKILL
            return super().put_bytes(uri, data, **kw)

    store = DiesAtCommit(a["base"]) if rank == 0 else ObjectStore(a["base"])
    ck = Checkpointer(a["base"], rank=rank, world_size=world, store=store, poll_interval_s=0.05)
    sd = {"w": torch.full((256, 256), 1.0), "b": torch.randn(256)}
    ck.save(1, sd, generation=1).result(timeout=60)
    sd["w"].fill_(2.0)
    ck.save(2, sd, generation=1).result(timeout=120)


if __name__ == "__main__":
    main()
    # What a test reads is written: leave without finalizing the interpreter,
    # which can abort with exit -6 while a gloo thread drops its last tensor
    # (the whole story: tests/worker/peercopy_peer.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
