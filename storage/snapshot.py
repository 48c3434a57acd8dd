"""Per-rank write planning and the host-memory snapshot of one rank's share.

Planning is local and deterministic: no collective runs, so a checkpoint never
hangs on a dead peer. Which rank writes what:

- a ``DTensor`` entry: the rank writes its local shard, unless it is a replica
  (its mesh coordinate is not 0 along a ``Replicate`` dimension; HSDP / 2-D; or
  the tensor lives on a slice of a larger mesh and this rank's slice is not the
  one at coordinate 0 of the dimensions left out: FSDP2's data-parallel mesh
  under tensor parallel, whose TP indices hold the same shard -- but not the
  pipeline dimension: other stages hold other layers);
- a plain ``torch.Tensor`` entry is taken to be *replicated* on every rank (DDP),
  and exactly one rank writes it; ranks are chosen by a size-balanced greedy
  assignment computed identically on every rank (largest first, to the least
  loaded rank, ties to the lowest rank) -- like DCP's save-plan dedup, but without
  gathering plans;
- any other object (ints, lists, ...) is replicated too and assigned the same way.

This matches DCP semantics (one copy per key), and requires that every rank of a
generation passes the same keys with the same shapes for non-DTensor entries,
unless the caller says which ranks hold each of them (`PlainHolders`: pipeline
stages hold only their own layers' plain entries, gathered once by the
training library): each is then written by one of its holders, by the same
balanced assignment over the holders only.

The snapshot copies the owned tensors into staging buffers that are kept and
reused across saves (pinned when the source is on an accelerator), so host memory
stays bounded by one copy of the rank's share and steady-state saves allocate
nothing. The caller must not start a new snapshot while the previous one is still
being written; :class:`~springback.storage.checkpointer.Checkpointer` ensures it.

Deferred copies: tensors whose storage is in ``defer`` (the parameters and
optimizer state of the caller's optimizers, which only ``optimizer.step`` mutates)
are not copied by :meth:`StagingArea.snapshot`; they are listed in
``ShardSnapshot.pending`` and copied later by :meth:`ShardSnapshot.copy_pending`
(on the checkpoint thread), which the caller must let finish before the state
changes (:meth:`ShardSnapshot.wait_copied`, from an optimizer step pre-hook).
Everything else (buffers, objects) is copied at once.
"""

from __future__ import annotations

import dataclasses
import heapq
import io
import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from springback.storage import compat

_OBJECT_WEIGHT = 64
STAGE_DIM = "pp"
"""The mesh dimension of pipeline stages (`worker/state/mesh.py` names it so)."""  # nominal bytes of a non-tensor entry, for the balance


@dataclasses.dataclass
class ShardSnapshot:
    """One rank's owned entries, in host memory, ready to serialize.

    ``data[i]`` is the staged tensor (a staging buffer; do not keep it past the
    next snapshot) or the ``torch.save`` bytes of object ``items[i]``.
    """

    items: list[WriteItem]
    data: list[torch.Tensor | bytes]
    mappings: dict[str, Any]
    num_bytes: int
    pending: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    """``(staging buffer, source)`` copies still to do; empty once :meth:`copy_pending` ran."""
    after: Any = None
    """A CUDA event recorded at snapshot time that device copies must wait for, or None."""
    copied: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set when no copy is pending any more (also after a failed copy)."""
    held: tuple[str, ...] = ()
    """The flattened keys of every entry this rank passed, written by it or
    not: the committer checks that some rank wrote each of them."""

    def __post_init__(self) -> None:
        if not self.pending:
            self.copied.set()

    def copy_pending(self) -> None:
        """Do the deferred copies (blocking; device copies on a side stream), then set ``copied``.

        The sources must not have changed since :meth:`StagingArea.snapshot`.
        ``copied`` is set even when a copy fails, so nobody waits forever on it.
        """
        try:
            device = next((src.device for _, src in self.pending if src.device.type == "cuda"), None)
            if device is not None:
                stream = torch.cuda.Stream(device=device)
                with torch.cuda.stream(stream):
                    if self.after is not None:
                        stream.wait_event(self.after)
                    for buf, src in self.pending:
                        buf.copy_(src, non_blocking=True)
                stream.synchronize()
            else:
                for buf, src in self.pending:
                    buf.copy_(src)
            self.pending = []
        finally:
            self.copied.set()

    def wait_copied(self) -> None:
        """Block until the deferred copies are done (at once if there are none)."""
        self.copied.wait()


def _owns_dtensor(t: DTensor) -> bool:
    coord = t.device_mesh.get_coordinate()
    if coord is None:  # this rank is not in the tensor's mesh
        return False
    for dim, p in enumerate(t.placements):
        if p.is_partial():
            raise ValueError("cannot checkpoint a DTensor with a Partial placement; redistribute it first")
        if p.is_replicate() and coord[dim] != 0:
            return False
    return _first_of_parallel_meshes(t.device_mesh)


def _first_of_parallel_meshes(mesh: Any) -> bool:
    """Whether this rank's copy of a DTensor on `mesh`, a slice of a larger
    mesh, is the one written: the slices parallel to it (the ranks at the
    same coordinates along the dimensions the slice leaves out, e.g. the
    other tensor-parallel indices of an FSDP2 mesh["replicate", "shard"])
    hold the same data, and only the slice at coordinate 0 on each of those
    dimensions writes it, as a Replicate placement would. The pipeline
    dimension (`STAGE_DIM`) is not one of them: the slices along it are other
    stages, which hold other layers."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    if root is mesh:
        return True
    where = root.get_coordinate()
    if where is None:
        return False
    members = set(mesh.mesh.flatten().tolist())
    grid = root.mesh
    names = root.mesh_dim_names or ()
    for dim in range(grid.dim()):
        if dim < len(names) and names[dim] == STAGE_DIM:
            continue  # another stage's slice holds other tensors: this one is written here
        # the slice is constant along `dim` when all its ranks share this rank's index there
        index = [slice(None)] * grid.dim()
        index[dim] = where[dim]
        if members <= set(grid[tuple(index)].flatten().tolist()) and where[dim] != 0:
            return False
    return True


PlainHolders = dict[str, tuple[int, tuple[int, ...]]]
"""Flattened key of a non-DTensor entry -> (its size in bytes, the ranks that
hold it), the same on every rank."""


def assign_replicated(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Map each replicated key to the rank that writes it (deterministic, size-balanced)."""
    heap = [(0, r) for r in range(world_size)]
    owner: dict[str, int] = {}
    for fqn in sorted(sizes, key=lambda k: (-sizes[k], k)):
        load, r = heapq.heappop(heap)
        owner[fqn] = r
        heapq.heappush(heap, (load + sizes[fqn], r))
    return owner


def assign_among_holders(holders: PlainHolders) -> dict[str, int]:
    """Map each key to the holder that writes it: largest first, to its least
    loaded holder, ties to the lowest rank (deterministic, size-balanced)."""
    load: dict[int, int] = {}
    owner: dict[str, int] = {}
    for fqn in sorted(holders, key=lambda k: (-holders[k][0], k)):
        size, ranks = holders[fqn]
        r = min(ranks, key=lambda q: (load.get(q, 0), q))
        owner[fqn] = r
        load[r] = load.get(r, 0) + size
    return owner


def plain_entries(state_dict: dict[str, Any]) -> dict[str, int]:
    """This rank's non-DTensor entries of `state_dict` (flattened keys) and their
    sizes, as `snapshot` weighs them: what to gather for `PlainHolders`."""
    flat, _ = compat.flatten_state_dict(state_dict)
    return {fqn: obj.numel() * obj.element_size() if isinstance(obj, torch.Tensor)
            else _OBJECT_WEIGHT for fqn, obj in flat.items() if not isinstance(obj, DTensor)}


class StagingArea:
    """Reusable host buffers for snapshots of one rank's state."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._encoded: dict[str, tuple[Any, bytes]] = {}
        """Plain settings (the optimizer's lr, betas, ... per parameter) as
        serialized at an earlier save, reused while their value is the same:
        hundreds of them, each a torch.save, would otherwise cost the stall
        milliseconds."""

    def _encode(self, fqn: str, obj: Any) -> bytes:
        """`obj` as torch.save bytes (a BYTE_IO item)."""
        cached = self._encoded.get(fqn)
        if cached is not None and _plain(obj) and type(cached[0]) is type(obj) and cached[0] == obj:
            return cached[1]
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = buf.getvalue()
        if _plain(obj):
            self._encoded[fqn] = (obj, data)
        return data

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _buffer(self, key: tuple[str, tuple[int, ...]], src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            pin = src.device.type != "cpu" and torch.cuda.is_available()
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        return buf

    def snapshot(
        self, state_dict: dict[str, Any], *, rank: int, world_size: int,
        defer: frozenset[int] = frozenset(), holders: PlainHolders | None = None,
    ) -> ShardSnapshot:
        """Copy this rank's owned entries of ``state_dict`` into the staging buffers.

        Entries whose storage (``untyped_storage().data_ptr()``) is in ``defer``
        (see :func:`storage_keys`) are left in ``pending`` for
        :meth:`ShardSnapshot.copy_pending`; the caller must keep them unchanged
        until ``copied`` is set. Every other copy is complete (device streams
        synchronized) when this returns, so the caller may mutate those entries at
        once. Raises ``ValueError`` for entries it cannot checkpoint (Partial
        DTensors), and for a non-DTensor entry `holders` (when given) does not
        list this rank for.
        """
        flat, mappings = compat.flatten_state_dict(state_dict)
        owned = _owned_items(flat, rank=rank, world_size=world_size, holders=holders)

        items: list[WriteItem] = []
        data: list[torch.Tensor | bytes] = []
        live: set[tuple[str, tuple[int, ...]]] = set()
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        any_device = False
        num_bytes = 0
        for item, src in owned:
            if item.type == WriteItemType.BYTE_IO:
                data.append(self._encode(item.index.fqn, src))
                num_bytes += len(data[-1])
            else:
                key = _key(item.index)
                live.add(key)
                src = src.detach()
                staged = self._buffer(key, src)
                if defer and _storage_key(src) in defer:
                    pending.append((staged, src))
                else:
                    any_device |= src.device.type != "cpu"
                    staged.copy_(src, non_blocking=src.device.type != "cpu")
                data.append(staged)
                num_bytes += staged.numel() * staged.element_size()
            items.append(item)
        if any_device and torch.cuda.is_available():
            torch.cuda.synchronize()
        after = None
        if any(src.device.type == "cuda" for _, src in pending):  # device copies start after the work queued so far
            after = torch.cuda.Event()
            after.record()
        for key in list(self._buffers):  # drop buffers of entries that went away
            if key not in live:
                del self._buffers[key]
        held = tuple(sorted(flat))
        return ShardSnapshot(items=items, data=data, mappings=mappings, num_bytes=num_bytes,
                             pending=pending, after=after, held=held)


def _plain(obj: Any) -> bool:
    """Numbers, strings, None, and tuples or lists of them: compared by value."""
    if isinstance(obj, (tuple, list)):
        return all(_plain(v) for v in obj)
    return obj is None or isinstance(obj, (bool, int, float, str))


def _owned_items(flat: dict[str, Any], *, rank: int, world_size: int,
                 holders: PlainHolders | None = None) -> list[tuple[WriteItem, Any]]:
    """The write items this rank stores, with their data: the local shards of
    its DTensors, plus the replicated entries (plain tensors, other objects)
    that `assign_replicated` gives it (`assign_among_holders` with `holders`)."""
    owned: list[tuple[WriteItem, Any]] = []
    replicated: dict[str, tuple[WriteItem, Any]] = {}
    sizes: dict[str, int] = {}
    for fqn, obj in flat.items():
        if isinstance(obj, DTensor):
            if _owns_dtensor(obj):
                (item,) = compat.create_write_items(fqn, obj)
                owned.append((item, obj.to_local()))
        elif isinstance(obj, torch.Tensor):
            (item,) = compat.create_write_items(fqn, obj)
            replicated[fqn] = (item, obj)
            sizes[fqn] = obj.numel() * obj.element_size()
        else:
            replicated[fqn] = (compat.create_write_items(fqn, obj)[0], obj)
            sizes[fqn] = _OBJECT_WEIGHT
    if holders is None:
        owner = assign_replicated(sizes, world_size)
    else:
        stray = sorted(fqn for fqn in replicated if rank not in holders.get(fqn, (0, ()))[1])
        if stray:
            raise ValueError(f"rank {rank} holds {', '.join(stray[:5])}, which the gathered "
                             "holders do not list it for")
        owner = assign_among_holders(holders)
    owned.extend(v for fqn, v in replicated.items() if owner[fqn] == rank)
    return owned


def _storage_key(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.untyped_storage().data_ptr()


def storage_keys(optimizers: Iterable[torch.optim.Optimizer]) -> frozenset[int]:
    """Storages of the optimizers' parameters and state tensors: what only ``optimizer.step`` mutates."""
    keys: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            keys.update(_storage_key(p) for p in group["params"])
        for state in opt.state.values():
            keys.update(_storage_key(v) for v in state.values() if isinstance(v, torch.Tensor))
    keys.discard(0)  # empty tensors have no storage
    return frozenset(keys)


def _key(index: MetadataIndex) -> tuple[str, tuple[int, ...]]:
    return index.fqn, tuple(index.offset or ())
