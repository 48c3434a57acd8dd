"""One rank of tests/worker/test_boundary.py: two steps of step-boundary votes
on a real gloo group; the last rank votes late at step 1, every rank drains at step 2. Prints one JSON line."""

import json
import sys
import time

from springback.worker.train.boundary import StepBoundary, Vote
from springback.worker.rank.rendezvous import form_group, leave_group

from peerexit import exit_without_finalizing

WORLD = 3
SEEN = (5, 7, 6)  # rank 1 has seen the newest plan


def main(rank: int, port: int) -> int:
    form_group(secret="", job_id="boundary", generation=5, rank=rank, world_size=WORLD,
               master_addr="127.0.0.1", master_port=port, backend="gloo",
               collective_timeout_s=20, rendezvous_timeout_s=30, superseded=lambda: False)
    boundary = StepBoundary(rank, WORLD)
    out: dict = {"rank": rank}
    if rank == WORLD - 1:
        time.sleep(1.5)  # a slow peer: the others' step 1 must not wait for it
    t0 = time.monotonic()
    out["first"] = boundary.vote(Vote(step=1, generation_seen=SEEN[rank], loss_share=rank + 1.0,
                                      draining=rank == 1, last_holder=False, ended_t=1.0,
                                      bad=rank == 2, timing=(rank + 0.25, 2.0 * rank)))
    out["vote_s"] = time.monotonic() - t0
    agreed = boundary.vote(Vote(step=2, generation_seen=5, loss_share=-2.0, draining=True,
                                last_holder=rank == 0, ended_t=2.0))
    out["step1"] = agreed.__dict__
    out["step2"] = boundary.settle().__dict__
    out["after"] = boundary.settle()
    leave_group()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main(int(sys.argv[1]), int(sys.argv[2])))
