"""A party on the network without the plan: connects to a node's rendezvous
store (its address is no secret) and tries the generation's predictable key
names (the layout before `Plan.rendezvous_secret`): reads them, then counts a
phantom rank in and overwrites the endpoint entries. Prints what it saw as
one JSON line: ``python store_intruder.py HOST PORT JOB GENERATION``."""

from __future__ import annotations

import datetime
import json
import sys

import torch.distributed as dist


def main(host: str, port: int, job_id: str, generation: int) -> None:
    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    old = f"springback/{job_id}/g{generation}//"
    names = [old + "arrived", old + "endpoints/0", old + "endpoints/1"]
    seen = {name: store.check([name]) for name in names}
    # what a forger would do: count itself in, claim a rank's endpoints
    arrived = store.add(old + "arrived", 1000)
    store.set(old + "endpoints/1", json.dumps(["127.0.0.1:1"]))
    print(json.dumps({"seen": seen, "arrived_after_add": arrived}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
