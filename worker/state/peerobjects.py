"""Small objects exchanged between the ranks of one generation: what each rank
holds and needs before a reshard, the state a joiner receives, peer-copy
offers and indexes.

They travel as `torch.save` bytes over the generation's gloo group, and are
decoded with ``torch.load(weights_only=True)``: tensors and plain data only
(dict, list, tuple, set, str, bytes, numbers, bool, None, OrderedDict,
torch dtypes, sizes and devices) plus the one project class on the wire,
`reshard.Box`. Nothing a peer sends can name a function or class to call, so
a compromised rank gains no code on the others (docs/security.md). The same
limit applies to the state a script registers with ``state=``: its
``state_dict()`` must be tensors and plain data, as for a DCP checkpoint.

Failure semantics: both exchanges are collectives; a peer dying mid-exchange
raises what a failed collective raises. An object that is not tensors and
plain data raises `UnsafePeerObject` on the receiving ranks, naming the
sending rank and what was refused; nothing of it is constructed, and the
generation fails as when a peer is lost.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from springback.worker.rank.rendezvous import handed_to_gloo
from springback.worker.state.reshard import Box

_SAFE_GLOBALS: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [Box]


class UnsafePeerObject(Exception):
    """A peer sent an object that is not tensors and plain data."""


def encode(obj: object) -> torch.Tensor:
    """`obj` as a uint8 tensor of its torch.save bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def decode(data: bytes, peer: int) -> Any:
    """The object rank `peer` encoded, in host memory (the sender's CUDA
    device may not exist here). Raises `UnsafePeerObject` naming `peer` and
    the refused global when the bytes name anything but plain data."""
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL (\S+)", str(e))
        why = f"it names {named.group(1)}" if named else str(e).splitlines()[0]
        raise UnsafePeerObject(
            f"rank {peer} sent state that is not tensors and plain data ({why}); "
            "objects registered with state= must return tensors, dicts, lists, "
            "tuples, strings and numbers from state_dict()") from None


def all_gather_objects(obj: object, world_size: int) -> list[object]:
    """`obj` of every rank (tensors registered with `handed_to_gloo`, so the
    group can be torn down safely after)."""
    data = encode(obj)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)
    handed_to_gloo(size, padded, *sizes, *gathered)
    return [decode(g[:int(s.item())].numpy().tobytes(), peer)
            for peer, (g, s) in enumerate(zip(gathered, sizes))]


def broadcast_object(obj: Any, source: int, rank: int) -> Any:
    """`obj` of rank `source`, on every rank (two broadcasts); unlike
    dist.broadcast_object_list its tensors are registered with
    `handed_to_gloo`, so the group can be torn down safely afterwards."""
    if rank == source:
        data = encode(obj)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=source)
    if rank != source:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=source)
    handed_to_gloo(size, data)
    if rank == source:
        return obj
    return decode(data.numpy().tobytes(), source)
