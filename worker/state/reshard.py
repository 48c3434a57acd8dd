"""In-memory resharding of FSDP2 / HSDP state across generations.

When a generation's mesh differs from the last one (a node lost or joined,
a scale), every rank rebuilds its model on the new mesh and fills the new
shards from the ranks that hold the rows it needs, over the new process
group (point-to-point gloo sends), never through storage.

What is moved: every parameter, persistent buffer and optimizer state tensor
(AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``, ...), keyed by the
parameter's fully qualified name. A tensor is described by the rows of dim 0
that a rank holds (`Rows`): FSDP2's ``Shard(0)`` placement over one mesh
dimension gives ``torch.chunk``'s split, ``Replicate`` the whole tensor; a
0-dim tensor (``step``) is one row. Other placements (TP's ``Shard(1)``,
``Partial``) are refused with `NotReshardable`: the ranks agree on it and
restore the newest commit instead (`agreement`).

The protocol (`plan_transfers`) is a pure function of what every rank holds
and needs, which the ranks all-gather first, so every rank computes the same
transfer list: for each tensor and each receiving rank, the needed rows are
covered by segments from holders, the receiver itself first, then the lowest
rank. When some rows have no holder the result is None on every rank alike
(the caller then restores from the newest committed checkpoint).

Failure semantics: the exchange is collective; a peer dying mid-exchange
raises what a failed collective raises (the generation fails to start and
the next plan is awaited), and the receiving rank's new tensors are only
partly written, but the held pieces, taken before the exchange, are
untouched and kept by the agreement (`agreement.StateAgreement`), so the
next attempt starts from them again. After an exchange the ranks agree that
every needed row was written (`agree_written`) before the model is used.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from springback.worker.rank.rendezvous import handed_to_gloo

log = logging.getLogger(__name__)


class NotReshardable(ValueError):
    """A tensor placement the in-memory reshard does not handle."""


@dataclass(frozen=True)
class Rows:
    """Rows [start, end) of dim 0 of a tensor of global `shape`."""

    shape: tuple[int, ...]
    dtype: str
    start: int
    end: int


@dataclass(frozen=True)
class Transfer:
    """Rows [start, end) of tensor `key`, from rank `src` to rank `dst`."""

    key: str
    src: int
    dst: int
    start: int
    end: int


Piece = tuple[torch.Tensor, Rows]
"""A rank's local data of a tensor and the rows of dim 0 it is."""


def rows_of(t: torch.Tensor) -> tuple[torch.Tensor, Rows]:
    """The local data of `t` (a view that writes through) and the rows it is."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = tuple(t.shape)
    dtype = str(t.dtype).removeprefix("torch.")
    if not isinstance(t, DTensor):
        local = t.detach().reshape(1) if t.dim() == 0 else t.detach()
        return local, Rows(shape, dtype, 0, shape[0] if shape else 1)
    start, end = 0, shape[0] if shape else 1
    coordinate = t.device_mesh.get_coordinate()
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            continue
        if not (isinstance(placement, Shard) and placement.dim == 0 and end - start == shape[0]):
            raise NotReshardable(f"placement {t.placements} (only Shard(0) over one mesh "
                                 "dimension and Replicate are resharded in memory)")
        assert coordinate is not None
        size, index = t.device_mesh.size(dim), coordinate[dim]
        chunk = -(-shape[0] // size)  # torch.chunk's split
        start, end = min(index * chunk, shape[0]), min((index + 1) * chunk, shape[0])
    local = t.to_local().detach()
    return (local.reshape(1) if local.dim() == 0 else local), Rows(shape, dtype, start, end)


def plan_transfers(have: list[dict[str, Rows]], need: list[dict[str, Rows]],
                   owners: list[int] | None = None) -> list[Transfer] | None:
    """The transfers that give every rank the rows it needs (see the module
    docstring); None when some needed rows have no holder, or a holder's
    tensor differs in shape or dtype from the one needed.

    `have[i]` is held by rank i, or by rank ``owners[i]`` when given (a rank
    may then offer several pieces of one tensor, e.g. its own rows and a
    peer's copy: `worker/state/peercopy.py`)."""
    out: list[Transfer] = []
    for dst, wanted in enumerate(need):
        for key in sorted(wanted):
            rows = wanted[key]
            holders = [(owners[i] if owners is not None else i, h[key])
                       for i, h in enumerate(have) if key in h]
            if any((h.shape, h.dtype) != (rows.shape, rows.dtype) for _, h in holders):
                return None
            holders.sort(key=lambda rh: (rh[0] != dst, rh[0]))
            cursor = rows.start
            while cursor < rows.end:
                src = next(((r, h) for r, h in holders if h.start <= cursor < h.end), None)
                if src is None:
                    return None
                stop = min(rows.end, src[1].end)
                out.append(Transfer(key, src[0], dst, cursor, stop))
                cursor = stop
    return out


def exchange(transfers: list[Transfer], rank: int,
             held: dict[str, tuple[torch.Tensor, Rows]] | Callable[[Transfer], Piece],
             target: dict[str, tuple[torch.Tensor, Rows]], *, host: bool = False) -> int:
    """Runs `transfers` (every rank calls it with the same list): copies held
    rows into this rank's `target` views. `held` maps a key to this rank's
    piece, or is a function giving the piece that covers a transfer's rows.
    With `host` the pieces travel in host memory whatever the target's
    device (the held pieces are host copies: `worker/state/peercopy.py`).
    Returns the bytes received from other ranks."""
    ops: list[dist.P2POp] = []
    landing: list[tuple[torch.Tensor, torch.Tensor]] = []
    received = 0
    for tag, t in enumerate(transfers):
        if t.src == rank:
            data, rows = held(t) if callable(held) else held[t.key]
            piece = data[t.start - rows.start:t.end - rows.start]
            if t.dst == rank:
                out, orows = target[t.key]
                out[t.start - orows.start:t.end - orows.start].copy_(piece)
            else:
                ops.append(dist.P2POp(dist.isend, piece.contiguous(), t.dst, tag=tag))
        elif t.dst == rank:
            out, orows = target[t.key]
            view = out[t.start - orows.start:t.end - orows.start]
            if view.is_contiguous() and (not host or view.device.type == "cpu"):
                buf = view  # received in place (rows of dim 0 of a contiguous tensor)
            else:
                buf = (torch.empty(view.shape, dtype=view.dtype) if host
                       else torch.empty_like(view, memory_format=torch.contiguous_format))
                landing.append((view, buf))
            ops.append(dist.P2POp(dist.irecv, buf, t.src, tag=tag))
            received += buf.numel() * buf.element_size()
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        handed_to_gloo(*(op.tensor for op in ops))
    for view, buf in landing:
        view.copy_(buf)
    return received


def agree_written(transfers: list[Transfer], rank: int,
                  targets: dict[str, tuple[torch.Tensor, Rows]]) -> bool:
    """Collective: every rank checks that the exchange wrote every row it
    needed of every target (`covered`), and the ranks agree on it (a MIN
    all-reduce): False on every rank when any rank's fill is short, so no
    rank trains on a partly written model (the caller tries the next source)."""
    short = covered(transfers, rank, targets)
    ok = torch.tensor([0 if short else 1], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    handed_to_gloo(ok)
    if short:
        log.error("the exchange left rows unwritten on rank %d: %s", rank,
                  ", ".join(short[:5]))
    return bool(ok.item())


def covered(transfers: list[Transfer], rank: int,
            targets: dict[str, tuple[torch.Tensor, Rows]]) -> list[str]:
    """The keys of `targets` whose rows the transfers to `rank` do not cover,
    each row once and in order (empty: the fill writes every row)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for t in transfers:
        if t.dst == rank:
            spans.setdefault(t.key, []).append((t.start, t.end))
    short = []
    for key, (_, rows) in targets.items():
        cursor = rows.start
        for start, end in sorted(spans.get(key, [])):
            if start != cursor:
                break
            cursor = end
        if cursor != rows.end:
            short.append(key)
    return short


def all_gather_objects(obj: object, world_size: int) -> list[object]:
    """`obj` of every rank (pickled through torch.save; tensors registered
    with `handed_to_gloo`, so the group can be torn down safely after)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)
    handed_to_gloo(size, padded, *sizes, *gathered)
    return [torch.load(io.BytesIO(g[:int(s.item())].numpy().tobytes()), weights_only=False)
            for g, s in zip(gathered, sizes)]


def broadcast_object(obj: Any, source: int, rank: int) -> Any:
    """`obj` of rank `source`, on every rank (torch-serialised, two broadcasts);
    unlike dist.broadcast_object_list its tensors are registered with
    `handed_to_gloo`, so the group can be torn down safely afterwards."""
    if rank == source:
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
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
    # to host memory: the source's CUDA device index may not exist here;
    # load_state_dict copies onto this rank's own device
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False,
                      map_location="cpu")
