"""One rank of tests/worker/test_rendezvous.py's broken-generation test.

Rank 0 leaves a broken generation while something (as a user's DDP wrapper
does) still holds the group; rank 1 is blocked receiving from it and prints
how long its receive took to fail and which peer the error names."""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from springback.worker.rank.rendezvous import form_group, leave_group, lost_peer_rank

from peerexit import exit_without_finalizing


def main(rank: int, port: int) -> int:
    store = form_group(secret="", job_id="leave", generation=1, rank=rank, world_size=2,
                       master_addr="127.0.0.1", master_port=port, backend="gloo",
                       collective_timeout_s=30, rendezvous_timeout_s=30,
                       superseded=lambda: False)
    if rank == 0:
        held = dist.group.WORLD  # the DDP wrapper's reference
        store.wait(["receiving"], timedelta(seconds=60))
        leave_group(broken=True)
        store.wait(["failed"], timedelta(seconds=60))  # still holding the group
        print(f"left holding {held is not None}", flush=True)
        return 0
    t = torch.zeros(1)
    store.set("receiving", "1")
    start = time.monotonic()
    try:
        dist.recv(t, src=0)
    except RuntimeError as e:
        print(f"failed after {time.monotonic() - start:.2f}s naming {lost_peer_rank(e)}",
              flush=True)
        store.set("failed", "1")
        return 0
    return 1


if __name__ == "__main__":
    exit_without_finalizing(main(int(sys.argv[1]), int(sys.argv[2])))
