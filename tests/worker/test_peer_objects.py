"""Objects from peers are decoded as tensors and plain data only: a pickle
that names a callable is refused, naming the sending rank, and never run."""

import collections
import os
import socket
import subprocess
import sys

import pytest
import torch

from springback.worker.state.peerobjects import UnsafePeerObject, decode, encode
from springback.worker.state.reshard import Box

pytestmark = pytest.mark.timeout(90)


class _WritesMarker:
    """Unpickling this would create the file at `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_what_the_ranks_exchange_round_trips():
    payload = {
        "rows": {"w": Box((8, 6), "torch.float32", (0, 0), (4, 6))},
        "digests": ["ab", "cd"],
        "rng": {"cpu": torch.get_rng_state()},
        "optimizer": torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]).state_dict(),
        "extra": {"sampler": collections.OrderedDict(epoch=3, seen={1, 2}), "dtype": torch.bfloat16},
        "index": ({"w": (0, Box((2,), "torch.int64", (0,), (2,)), (2,))}, 16),
    }
    back = decode(encode(payload).numpy().tobytes(), peer=1)
    assert back["rows"] == payload["rows"] and back["index"] == payload["index"]
    assert torch.equal(back["rng"]["cpu"], payload["rng"]["cpu"])
    assert back["extra"] == payload["extra"] and back["digests"] == payload["digests"]


def test_a_pickle_that_names_a_callable_is_refused_naming_the_peer(tmp_path):
    marker = tmp_path / "ran"
    data = encode({"extra": _WritesMarker(str(marker))}).numpy().tobytes()
    with pytest.raises(UnsafePeerObject, match=r"rank 3 sent state that is not tensors and plain data \(it names io.open\)"):
        decode(data, peer=3)
    assert not marker.exists()


RANK = r"""
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
from springback.worker.state.peerobjects import UnsafePeerObject, all_gather_objects, broadcast_object
rank, port, marker = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
got = all_gather_objects({"rank": rank, "t": torch.full((2,), float(rank))}, 2)
assert [g["rank"] for g in got] == [0, 1] and torch.equal(got[1]["t"], torch.ones(2)), got
class Evil:
    def __reduce__(self):
        return (open, (marker, "w"))
try:
    broadcast_object({"extra": Evil()} if rank == 1 else None, 1, rank)
except UnsafePeerObject as e:
    print("REFUSED", e)
else:
    print("ACCEPTED")
sys.stdout.flush()
dist.barrier()  # rank 0 hosts the store: nobody leaves while the other still uses it
dist.destroy_process_group()
"""


def test_two_gloo_ranks_exchange_plain_state_and_refuse_a_malicious_one(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    marker = tmp_path / "ran"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port), str(marker)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    outs = [p.communicate(timeout=80) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    receiver, sender = outs[0][0], outs[1][0]
    assert "REFUSED rank 1 sent state that is not tensors" in receiver, outs
    assert "ACCEPTED" in sender  # the source keeps its own object as it is
    assert not marker.exists()
