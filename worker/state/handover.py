"""The striped hand-over of whole-held state: how the DDP form's joiners (and
ranks whose state is not the agreed one) receive it (`agreement.StateAgreement.agree`).

The state's dense tensors travel as raw bytes, never pickled: `split` takes
them out of the state (each replaced by a meta tensor of its shape and
dtype), the skeleton left goes through `peerobjects` (tensors and plain data
only), and `stream` moves the bytes point to point. The transfer plan
(`plan_handover`) cuts the tensors into chunks of about `CHUNK_BYTES` (a
large tensor into pieces, small ones packed together) and has chunk i served
by the i-th holder mod H, to every receiver: every holder of the agreed state
sends about 1/H of it. Each holder keeps `IN_FLIGHT` sends in flight, so
copying the next chunk to a send buffer (packing, or device to pinned host
memory) overlaps the sends; a receiver posts all its receives at once,
straight into the tensors it will load (pieces) or into a small staging
buffer (packed chunks).

Failure semantics: `stream` is point to point over the generation's gloo
group and bounded by the group's timeout; a holder or receiver lost
mid-stream raises what a failed collective raises, on every rank that
exchanges with it. It writes only tensors it allocated itself: the caller
loads them once `stream` has returned, so a failed hand-over leaves every
rank's state as it was. Every tensor handed to gloo is registered with
`handed_to_gloo` as it is posted, so the group can be torn down safely after
a failure too.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from springback.worker.rank.rendezvous import handed_to_gloo

CHUNK_BYTES = 8 * 2**20
"""A chunk's size. Measured over gloo on loopback (2 cores, 192 MiB of
16 MiB tensors, 1-3 holders): 4-16 MiB chunks moved 1.8-2.9 GiB/s, 2 MiB
1.5-1.6, 1 MiB 1.1 (the per-message cost), 32-64 MiB 0.8-0.96 (tensors
under a chunk are packed: a copy on each side)."""
IN_FLIGHT = 4
"""Sends a holder keeps in flight while it prepares the next."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """Bytes [start, stop) of tensor `tensor` (its index in `split`'s list)."""

    tensor: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One message: its segments, back to back, sent by rank `holder`."""

    index: int
    segments: tuple[Segment, ...]
    holder: int

    @property
    def nbytes(self) -> int:
        return sum(s.stop - s.start for s in self.segments)


@dataclasses.dataclass(frozen=True)
class HandoverPlan:
    """Who sends which chunk: every chunk goes from its holder to every receiver."""

    chunks: tuple[Chunk, ...]
    receivers: tuple[int, ...]

    def sends(self, rank: int) -> list[tuple[Chunk, int]]:
        """(chunk, destination) that `rank` sends, in order."""
        return [(c, dst) for c in self.chunks if c.holder == rank for dst in self.receivers]

    def sent_bytes(self, rank: int) -> int:
        return sum(c.nbytes for c, _ in self.sends(rank))


def plan_handover(nbytes: Sequence[int], holders: Sequence[int], receivers: Sequence[int],
                  chunk_bytes: int | None = None) -> HandoverPlan:
    """The chunks of tensors of `nbytes` bytes each (in order), chunk i served
    by ``holders[i % len(holders)]`` to every rank of `receivers`. A tensor
    larger than `chunk_bytes` is cut into pieces of `chunk_bytes` (the last
    shorter); consecutive smaller ones are packed into one chunk up to
    `chunk_bytes` (default: `CHUNK_BYTES`, read at the call). Pure and
    deterministic: every rank computes the same plan."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if not holders:
        raise ValueError("holders: no rank holds the state to hand over")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    both = sorted(set(holders) & set(receivers))
    if both:
        raise ValueError(f"receivers: ranks {both} are holders too")
    groups: list[tuple[Segment, ...]] = []
    packed: list[Segment] = []
    packed_bytes = 0
    for tensor, size in enumerate(nbytes):
        if size == 0:
            continue
        if size >= chunk_bytes:
            groups += [(Segment(tensor, a, min(a + chunk_bytes, size)),)
                       for a in range(0, size, chunk_bytes)]
            continue
        if packed_bytes + size > chunk_bytes:
            groups.append(tuple(packed))
            packed, packed_bytes = [], 0
        packed.append(Segment(tensor, 0, size))
        packed_bytes += size
    if packed:
        groups.append(tuple(packed))
    return HandoverPlan(tuple(Chunk(i, g, holders[i % len(holders)]) for i, g in enumerate(groups)),
                        tuple(receivers))


def _dense(value: object) -> bool:
    return (isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter)
            and value.layout == torch.strided and not value.is_quantized
            and value.device.type != "meta")


def split(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """`state` with each dense tensor (in dicts, lists and tuples) replaced by
    a meta tensor of its shape and dtype, and those tensors in walk order.
    Anything else (plain data, sparse tensors) stays in the skeleton."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> Any:
        if _dense(value):
            tensors.append(value)
            return torch.empty(value.shape, dtype=value.dtype, device="meta")
        if isinstance(value, dict):
            return type(value)((k, walk(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    return walk(state), tensors


def placeholders(skeleton: Any) -> list[torch.Tensor]:
    """The meta tensors of `skeleton`, in the order `split` took them out."""
    found: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            found.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(skeleton)
    return found


def join(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """`split`'s inverse: the skeleton's meta tensors replaced by `tensors`."""
    it = iter(tensors)

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            return next(it)
        if isinstance(value, dict):
            return type(value)((k, walk(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    return walk(skeleton)


def same_layout(tensors: list[torch.Tensor], skeleton: Any) -> bool:
    """Whether `tensors` (a holder's own, from `split`) have the shapes and
    dtypes of the skeleton's, in the same order."""
    metas = placeholders(skeleton)
    return len(metas) == len(tensors) and all(
        m.shape == t.shape and m.dtype == t.dtype for m, t in zip(metas, tensors))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a flat uint8 view (`t` contiguous)."""
    return t.reshape(-1).view(torch.uint8)


def stream(plan: HandoverPlan, rank: int, held: list[torch.Tensor] | None,
           skeleton: Any) -> list[torch.Tensor] | None:
    """Runs this rank's part of `plan` (every rank calls it with the same
    plan): a holder sends its chunks of `held`; a receiver returns new host
    tensors of the skeleton's shapes and dtypes, complete (None on a rank
    that receives nothing). Raises what a failed send or receive raises."""
    if rank in plan.receivers:
        return _receive(plan, rank, skeleton)
    if any(c.holder == rank for c in plan.chunks):
        assert held is not None, f"rank {rank} serves chunks but holds no state"
        _send(plan, rank, held)
    return None


def _send(plan: HandoverPlan, rank: int, held: list[torch.Tensor]) -> None:
    flat: dict[int, torch.Tensor] = {}  # made contiguous once, kept while sending
    in_flight: collections.deque[dist.Work] = collections.deque()
    staged: dict[int, torch.Tensor] = {}
    for chunk, dst in plan.sends(rank):
        buf = staged.get(chunk.index)
        if buf is None:  # one buffer per chunk, sent to every receiver
            parts = []
            for s in chunk.segments:
                if s.tensor not in flat:
                    flat[s.tensor] = _bytes(held[s.tensor].detach().contiguous())
                parts.append(flat[s.tensor][s.start:s.stop])
            on_host = all(p.device.type == "cpu" for p in parts)
            if len(parts) == 1 and on_host:
                buf = parts[0]  # a piece of a host tensor: sent as it lies
            elif on_host:
                buf = torch.cat(parts)  # small tensors packed
            else:  # gloo sends host memory: through a pinned buffer
                buf = torch.empty(chunk.nbytes, dtype=torch.uint8, pin_memory=True)
                _copy_to_host(parts, buf)
            staged = {chunk.index: buf}  # the previous chunk's buffer lives on in its works
        work = dist.isend(buf, dst, tag=chunk.index)
        handed_to_gloo(buf)
        assert work is not None
        in_flight.append(work)
        if len(in_flight) >= IN_FLIGHT:
            in_flight.popleft().wait()
    while in_flight:
        in_flight.popleft().wait()


def _copy_to_host(parts: list[torch.Tensor], buf: torch.Tensor) -> None:
    """Device segments into the (pinned) host buffer `buf`, back to back."""
    at = 0
    for p in parts:
        buf[at:at + p.numel()].copy_(p, non_blocking=True)
        at += p.numel()
    torch.cuda.synchronize()


def _receive(plan: HandoverPlan, rank: int, skeleton: Any) -> list[torch.Tensor]:
    out = [torch.empty(m.shape, dtype=m.dtype) for m in placeholders(skeleton)]
    works: list[tuple[dist.Work, Chunk, torch.Tensor | None]] = []
    for chunk in plan.chunks:
        if len(chunk.segments) == 1:  # a piece: received in place
            s = chunk.segments[0]
            buf, landing = _bytes(out[s.tensor])[s.start:s.stop], None
        else:
            buf = landing = torch.empty(chunk.nbytes, dtype=torch.uint8)
        work = dist.irecv(buf, chunk.holder, tag=chunk.index)
        handed_to_gloo(buf)
        assert work is not None
        works.append((work, chunk, landing))
    for work, chunk, landing in works:
        work.wait()
        if landing is not None:  # unpacked as it arrives, while the rest streams in
            at = 0
            for s in chunk.segments:
                _bytes(out[s.tensor])[s.start:s.stop].copy_(landing[at:at + s.stop - s.start])
                at += s.stop - s.start
    del works
    return out
