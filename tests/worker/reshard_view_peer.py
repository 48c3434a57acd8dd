"""One of two gloo ranks: the reshard's receive into views that are not
contiguous (test_reshard.py), through the library's own `box_of`,
`plan_transfers`, `exchange` and `agree_written`.

Every rank builds the same global tensors (bit patterns with a NaN payload,
-0.0 and infinities among them), holds its old-layout piece and receives into
a new-layout target that starts as a sentinel:

- ``tp2_to_tp1``: tensor parallel 2 -> 1: column shards (``Shard(1)``) are
  held, the whole tensor (``Replicate``) is needed, so the peer's columns land
  in a column block of a row-major tensor;
- ``cols_to_rows``: column shards held, row shards (``Shard(0)``) needed: the
  peer's quarter is a column block of this rank's rows;
- ``into_transposed``: row shards held, the target is a transposed view
  (``empty(6, 8).t()``), whose rows are strided.

Each of those receives goes through `exchange`'s landing buffer (a view that
is not contiguous cannot be received in place). Prints ``RESULT`` with, per
key, whether the receives went to non-contiguous views, and how many elements
differ bit for bit from the global tensor.

argv: rank, world size (2), a file-store path.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from springback.worker.state.reshard import (agree_written, box_of, exchange, local_view,
                                            plan_transfers)

from peerexit import exit_without_finalizing

SHAPE = (8, 6)
SENTINEL = 7.0


def global_tensor(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Same on every rank; special values make a bit-for-bit check mean more than ==."""
    t = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)
    t[0, 5], t[7, 0], t[3, 4], t[5, 1] = float("nan"), -0.0, float("inf"), -float("inf")
    if dtype == torch.float32:  # a NaN with a payload: copies that go through arithmetic lose it
        t.view(torch.int32)[6, 2] = 0x7FC00123
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def main() -> int:
    rank, world, store_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    cases = {  # key -> (dtype, old placement, new target: a DTensor's placement or "transposed")
        "tp2_to_tp1": (torch.float32, Shard(1), Replicate()),
        "cols_to_rows": (torch.bfloat16, Shard(1), Shard(0)),
        "into_transposed": (torch.float32, Shard(0), "transposed"),
    }
    full, held, targets = {}, {}, {}
    for seed, (key, (dtype, old, new)) in enumerate(sorted(cases.items())):
        full[key] = global_tensor(dtype, seed)
        held[key] = box_of(distribute_tensor(full[key], mesh, [old]))
        if new == "transposed":
            target: torch.Tensor = torch.full(SHAPE[::-1], SENTINEL, dtype=dtype).t()
        else:
            target = distribute_tensor(torch.full(SHAPE, SENTINEL, dtype=dtype), mesh, [new])
        targets[key] = box_of(target)
    haves: list = [None] * world
    needs: list = [None] * world
    dist.all_gather_object(haves, {k: b for k, (_, b) in held.items()})
    dist.all_gather_object(needs, {k: b for k, (_, b) in targets.items()})
    transfers = plan_transfers(haves, needs)
    assert transfers is not None
    received = exchange(transfers, rank, held, targets)
    written = agree_written(transfers, rank, targets)
    result = {"received": received, "written": written, "strided": {}, "differ": {}}
    for key, (out, box) in targets.items():
        into = [local_view(out, box, t.span) for t in transfers
                if t.key == key and t.dst == rank and t.src != rank]
        result["strided"][key] = bool(into) and not any(v.is_contiguous() for v in into)
        want = local_view(full[key], box_of(full[key])[1], box.span)
        result["differ"][key] = int((bits(out) != bits(want)).sum())
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main())
