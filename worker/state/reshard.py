"""In-memory resharding of DTensor state (FSDP2, HSDP, tensor parallel and
their combinations) across generations.

When a generation's mesh differs from the last one (a node lost or joined,
a scale), every rank rebuilds its model on the new mesh and fills the new
shards from the ranks that hold the blocks it needs, over the new process
group (point-to-point gloo sends), never through storage.

What is moved: every parameter, persistent buffer and optimizer state tensor
(AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``, ...), keyed by the
parameter's fully qualified name. A tensor is described by the block of the
global tensor that a rank holds (`Box`: a start and an end on every
dimension), as DTensor computes it for the placements (``Shard(d)`` on any
mesh dimension, nested shards of one dimension, FSDP2's ``_StridedShard``
under a tensor-parallel ``Shard`` of the same dimension, ``Replicate``); a
0-dim tensor (``step``) is a one-element block. ``Partial`` (a sum not yet
reduced) and any other placement are refused with `NotReshardable`: the
ranks agree on it and restore the newest commit instead (`agreement`).

The protocol (`plan_transfers`) is a pure function of what every rank holds
and needs, which the ranks all-gather first, so every rank computes the same
transfer list: for each tensor and each receiving rank, the needed block is
covered by blocks cut from holders' blocks: the receiver's own first, then
the holder that has sent the fewest bytes so far (ties to the lower rank),
so that the sending is spread over the replicas. When some part of a block
has no holder the result is None on every rank alike (the caller then
restores from the newest committed checkpoint).

Failure semantics: the exchange is collective; a peer dying mid-exchange
raises what a failed collective raises (the generation fails to start and
the next plan is awaited), and the receiving rank's new tensors are only
partly written, but the held pieces, taken before the exchange, are
untouched and kept by the agreement (`agreement.StateAgreement`), so the
next attempt starts from them again. After an exchange the ranks agree that
every needed element was written (`agree_written`) before the model is used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from springback.worker.rank.rendezvous import handed_to_gloo

log = logging.getLogger(__name__)

Span = tuple[tuple[int, ...], tuple[int, ...]]
"""A block's start and end (exclusive) on every dimension."""


class NotReshardable(ValueError):
    """A tensor placement the in-memory reshard does not handle."""


@dataclass(frozen=True)
class Box:
    """The block [start, end) (per dimension) of a tensor of global `shape`
    that a piece is; a 0-dim tensor is the block [0, 1) of one dimension."""

    shape: tuple[int, ...]
    dtype: str
    start: tuple[int, ...]
    end: tuple[int, ...]

    @property
    def span(self) -> Span:
        return self.start, self.end

    def contains(self, span: Span) -> bool:
        return all(s <= a and b <= e for s, e, a, b in zip(self.start, self.end, *span))


@dataclass(frozen=True)
class Transfer:
    """The block [start, end) of tensor `key`, from rank `src` to rank `dst`."""

    key: str
    src: int
    dst: int
    start: tuple[int, ...]
    end: tuple[int, ...]

    @property
    def span(self) -> Span:
        return self.start, self.end


Piece = tuple[torch.Tensor, Box]
"""A rank's local data of a tensor and the block of the global tensor it is."""


def volume(span: Span) -> int:
    n = 1
    for a, b in zip(*span):
        n *= max(b - a, 0)
    return n


def intersect(x: Span, y: Span) -> Span | None:
    start = tuple(max(a, b) for a, b in zip(x[0], y[0]))
    end = tuple(min(a, b) for a, b in zip(x[1], y[1]))
    return (start, end) if all(a < b for a, b in zip(start, end)) else None


def subtract(outer: Span, inner: Span) -> list[Span]:
    """`outer` less `inner` (which lies inside it) as disjoint blocks: on each
    dimension in turn the slabs before and after `inner`, the dimensions
    already cut narrowed to `inner`'s range."""
    out: list[Span] = []
    lo, hi = list(outer[0]), list(outer[1])
    for d in range(len(lo)):
        if lo[d] < inner[0][d]:
            out.append((tuple(lo), tuple(hi[:d] + [inner[0][d]] + hi[d + 1:])))
        if inner[1][d] < hi[d]:
            out.append((tuple(lo[:d] + [inner[1][d]] + lo[d + 1:]), tuple(hi)))
        lo[d], hi[d] = inner[0][d], inner[1][d]
    return out


def local_view(data: torch.Tensor, box: Box, span: Span) -> torch.Tensor:
    """The part of `data` (the local data of `box`) that is `span` (a view)."""
    return data[tuple(slice(a - s, b - s) for s, a, b in zip(box.start, *span))]


def _check_placements(t: Any) -> None:
    """NotReshardable unless every placement of DTensor `t` makes its local
    data one block: Replicate, Shard, or FSDP2's _StridedShard under a later
    Shard of the same tensor dimension whose mesh dimension is its split."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = t.placements
    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            later = [(j, q) for j, q in enumerate(placements) if j > i and isinstance(q, Shard)
                     and not isinstance(q, _StridedShard) and q.dim == p.dim]
            if len(later) == 1 and t.device_mesh.size(later[0][0]) == p.split_factor:
                continue
        elif isinstance(p, (Replicate, Shard)):
            continue
        what = "a Partial (unreduced) value: reduce it first" if p.is_partial() else \
            f"placement {p}"
        raise NotReshardable(f"{what} in {tuple(placements)} is not resharded in memory "
                             "(Shard, Replicate and FSDP2's strided shard under tensor "
                             "parallel are)")


def box_of(t: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """The local data of `t` (a view that writes through) and the block it is."""
    from torch.distributed.tensor import DTensor

    shape = tuple(t.shape)
    dtype = str(t.dtype).removeprefix("torch.")
    dims = shape or (1,)
    if not isinstance(t, DTensor):
        local = t.detach().reshape(1) if t.dim() == 0 else t.detach()
        return local, Box(shape, dtype, (0,) * len(dims), dims)
    _check_placements(t)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local().detach()
    if not shape:
        return local.reshape(1), Box(shape, dtype, (0,), (1,))
    size, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(size):
        raise NotReshardable(f"placement {tuple(t.placements)}: the local shard's shape "
                             f"{tuple(local.shape)} is not the block {tuple(size)} DTensor "
                             "computes for it")
    # an empty shard (more ranks than rows) is the empty block at its offset
    end = tuple(o + n for o, n in zip(offset, size))
    return local, Box(shape, dtype, tuple(offset), end)


def plan_transfers(have: list[dict[str, Box]], need: list[dict[str, Box]],
                   owners: list[int] | None = None) -> list[Transfer] | None:
    """The transfers that give every rank the blocks it needs (see the module
    docstring); None when some needed part has no holder, or a holder's
    tensor differs in shape or dtype from the one needed.

    `have[i]` is held by rank i, or by rank ``owners[i]`` when given (a rank
    may then offer several pieces of one tensor, e.g. its own shard and a
    peer's copy: `worker/state/peercopy.py`)."""
    out: list[Transfer] = []
    sent: dict[int, int] = {}  # bytes each rank sends so far: the next block goes to the least
    for dst, wanted in enumerate(need):
        for key in sorted(wanted):
            box = wanted[key]
            holders = [(owners[i] if owners is not None else i, h[key])
                       for i, h in enumerate(have) if key in h]
            if any((h.shape, h.dtype) != (box.shape, box.dtype) for _, h in holders):
                return None
            holders.sort(key=lambda rh: (rh[0] != dst, sent.get(rh[0], 0), rh[0]))
            remaining = [box.span] if volume(box.span) else []
            for src, held in holders:
                if not remaining:
                    break
                left: list[Span] = []
                for part in remaining:
                    common = intersect(part, held.span)
                    if common is None:
                        left.append(part)
                        continue
                    out.append(Transfer(key, src, dst, *common))
                    if src != dst:
                        sent[src] = sent.get(src, 0) + volume(common)
                    left.extend(subtract(part, common))
                remaining = left
            if remaining:
                return None
    return out


def exchange(transfers: list[Transfer], rank: int,
             held: dict[str, Piece] | Callable[[Transfer], Piece],
             target: dict[str, Piece], *, host: bool = False) -> int:
    """Runs `transfers` (every rank calls it with the same list): copies held
    blocks into this rank's `target` views. `held` maps a key to this rank's
    piece, or is a function giving the piece that covers a transfer's block.
    With `host` the pieces travel in host memory whatever the target's
    device (the held pieces are host copies: `worker/state/peercopy.py`).
    Returns the bytes received from other ranks."""
    ops: list[dist.P2POp] = []
    landing: list[tuple[torch.Tensor, torch.Tensor]] = []
    received = 0
    for tag, t in enumerate(transfers):
        if t.src == rank:
            data, box = held(t) if callable(held) else held[t.key]
            piece = local_view(data, box, t.span)
            if t.dst == rank:
                out, obox = target[t.key]
                local_view(out, obox, t.span).copy_(piece)
            else:
                ops.append(dist.P2POp(dist.isend, piece.contiguous(), t.dst, tag=tag))
        elif t.dst == rank:
            out, obox = target[t.key]
            view = local_view(out, obox, t.span)
            if view.is_contiguous() and (not host or view.device.type == "cpu"):
                buf = view  # received in place (e.g. rows of dim 0 of a contiguous tensor)
            else:
                buf = (torch.empty(view.shape, dtype=view.dtype) if host
                       else torch.empty_like(view, memory_format=torch.contiguous_format))
                landing.append((view, buf))
            ops.append(dist.P2POp(dist.irecv, buf, t.src, tag=tag))
            received += buf.numel() * buf.element_size()
    if ops:
        # registered before they are posted, not after the waits: a wait that
        # fails (a peer died) leaves the other transfers in flight, and so does
        # a post that fails after the ones before it (a peer already known
        # dead), and `leave_group` must not let their buffers go while gloo
        # may still write into them
        handed_to_gloo(*(op.tensor for op in ops))
        works = dist.batch_isend_irecv(ops)
        for work in works:
            work.wait()
    for view, buf in landing:
        view.copy_(buf)
    return received


def agree_written(transfers: list[Transfer], rank: int, targets: dict[str, Piece]) -> bool:
    """Collective: every rank checks that the exchange wrote every element it
    needed of every target (`covered`), and the ranks agree on it (a MIN
    all-reduce): False on every rank when any rank's fill is short, so no
    rank trains on a partly written model (the caller tries the next source)."""
    short = covered(transfers, rank, targets)
    ok = torch.tensor([0 if short else 1], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    handed_to_gloo(ok)
    if short:
        log.error("the exchange left elements unwritten on rank %d: %s", rank,
                  ", ".join(short[:5]))
    return bool(ok.item())


def covered(transfers: list[Transfer], rank: int, targets: dict[str, Piece]) -> list[str]:
    """The keys of `targets` whose block the transfers to `rank` do not
    write exactly once: each transfer inside the block, no two overlapping,
    their volumes summing to the block's (empty: the fill writes every
    element)."""
    spans: dict[str, list[Span]] = {}
    for t in transfers:
        if t.dst == rank:
            spans.setdefault(t.key, []).append(t.span)
    short = []
    for key, (_, box) in targets.items():
        parts = spans.get(key, [])
        inside = all(box.contains(p) for p in parts)
        disjoint = all(intersect(a, b) is None for i, a in enumerate(parts) for b in parts[i + 1:])
        if not (inside and disjoint and sum(map(volume, parts)) == volume(box.span)):
            short.append(key)
    return short
