"""One of two gloo ranks: the reshard exchange when its sender dies
(test_reshard.py), through the library's own `exchange` and `leave_group`.

Rank 1 holds two blocks rank 0 needs and dies (a hard exit, its sockets
closed) once the group is connected, before it sends. Rank 0's exchange
posts both receives and fails on its first wait, the second receive still
posted. Prints ``RESULT`` with whether the exchange raised, how many of
the receive buffers were registered with `handed_to_gloo` when it did (both
must be: `leave_group` lets go only of what gloo has released), and whether
`leave_group` then tore the group down.

With ``LOST_PEER_LATE_S`` set, rank 0 starts its exchange that many
seconds after rank 1 left, so gloo has usually seen the closed connection
and a post itself fails (a loaded run's order): the buffers posted before
it must be registered too.

argv: rank, world size (2), a file-store path.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from springback.worker.rank import rendezvous
from springback.worker.state.reshard import Box, Transfer, exchange

from peerexit import exit_without_finalizing

SHAPE = (64, 1024)


def main() -> int:
    rank, world, store_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    dist.barrier()  # every connection is up: rank 1's exit closes them
    if rank == 1:
        print("RESULT {}", flush=True)
        exit_without_finalizing(0)
    time.sleep(float(os.environ.get("LOST_PEER_LATE_S", "0")))  # the order, not a wait
    whole = Box(SHAPE, "float32", (0, 0), SHAPE)
    targets = {k: (torch.zeros(SHAPE), whole) for k in ("a", "b")}
    transfers = [Transfer(k, 1, 0, (0, 0), SHAPE) for k in ("a", "b")]
    result = {"raised": False}
    try:
        exchange(transfers, 0, {}, targets)
    except (RuntimeError, dist.DistError) as e:
        result["raised"] = True
        result["handed"] = sum(r() is not None for r in rendezvous._handed)
        rendezvous.leave_group(broken=True, cause=e)
    result["left"] = not dist.is_initialized()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main())
