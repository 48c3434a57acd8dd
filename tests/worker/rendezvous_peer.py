"""One rank of tests/worker/test_rendezvous.py: optionally survives a failed
init of generation 1 first, then forms generation 2 and all-reduces."""

import sys

import torch
import torch.distributed as dist

from springback.worker.rank.rendezvous import RendezvousAborted, form_group, leave_group

from peerexit import exit_without_finalizing


def main(rank: int, port: int, fail_first: bool) -> int:
    common = {"job_id": "rdzv", "secret": "", "master_addr": "127.0.0.1", "master_port": port,
              "backend": "gloo", "collective_timeout_s": 2, "rendezvous_timeout_s": 30,
              "superseded": lambda: False}
    if fail_first:
        # the test counted a phantom second rank in: init starts and times out
        try:
            form_group(generation=1, rank=0, world_size=2, **common)
        except (RendezvousAborted, RuntimeError, dist.DistError) as e:
            print(f"generation 1 failed as intended: {type(e).__name__}", flush=True)
        else:
            return 2
        leave_group()
    form_group(generation=2, rank=rank, world_size=2, **common)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    leave_group()
    print(f"sum {t.item()}", flush=True)
    return 0 if t.item() == 3.0 else 1


if __name__ == "__main__":
    exit_without_finalizing(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"))
