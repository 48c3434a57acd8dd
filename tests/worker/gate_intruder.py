"""A party on the network without the plan, at a restart-mode generation's
store gate (found by a port scan, say): tries to read and write torch's keys
with a plain TCPStore client, as a forged rank would. Prints what it got as
one JSON line: ``python gate_intruder.py HOST PORT``."""

from __future__ import annotations

import datetime
import json
import sys

import torch.distributed as dist


def main(host: str, port: int) -> None:
    out: dict = {"reached": False, "num_keys": None, "wrote": False, "error": ""}
    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=5))
        out["reached"] = True
        out["num_keys"] = store.num_keys()
        store.set("forged/rank", "1")  # what a forged rank would write
        out["wrote"] = True
    except (RuntimeError, dist.DistError) as e:
        out["error"] = str(e).splitlines()[0]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
