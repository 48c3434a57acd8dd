"""Peer copies: every rank's shards kept in the host memory of a rank on
another node, so that a lost node's rows survive it (the sharded form).

With pure FSDP (no replica of a row on another node) a lost node takes the
only live copy of its rows with it. Every K steps (``peer_copies.every_steps``
in the job spec) each rank therefore

1. takes a *snapshot* of its shards (parameters, buffers, optimizer state)
   into one flat host-memory buffer, together with what every rank holds
   whole at that step (the optimizer's hyperparameters, the other ``state=``
   entries, its RNG state); the step fixes the data cursor (the sample stream is a function
   of the step);
2. sends the shard part to its *partner*: the same local rank on the next
   member of the plan (the ring of nodes), which keeps it as a *copy*. The
   send and the receive are started at the end of step k and waited for at
   the end of step k + 1, overlapping that step's compute the way the step
   boundary's all-reduce does (`worker/train/boundary.py`).

A snapshot and the copies of one step replace those of the step before only
once this rank's send and receive of the newer one have completed, so a
rank holds one snapshot and one copy per sender between copy steps, and two
of each during the one step a transfer is in flight. The replaced pieces'
buffers are kept and filled by the next copy: the host memory stays at that
peak (2 x (1 + senders) x the rank's shards) instead of being given back and
faulted in again at every copy, which cost as much CPU as the copy itself.

When a generation starts and the current state has rows no live rank holds
(`agreement.StateAgreement`), the ranks all-gather which steps their
snapshots and copies are of, and take the newest step whose pieces cover
every row (at least as new as the newest commit: a newer commit redoes fewer
steps): every rank is rolled back to it, its shards filled from those pieces
over the new group (`reshard.exchange`), the whole-held state from the
lowest rank that has a snapshot of that step, and the steps after it are
trained again on the same samples. The start is reported as
``RESTORE_KIND_PEER_COPY`` at that step, so the coordinator counts the steps
redone.

Failure semantics:

* A copy is used only once its receive completed; one still in flight when
  its sender or the group died is dropped. A node lost in the step after a
  copy step can leave the newest copy incomplete on its partner: the ranks
  then fall back to the previous step's pieces where every rank still holds
  them, else to the newest commit.
* A shard and its copy both lost (the node and its partner's node): the
  newest committed checkpoint, as without copies; never a fresh start while a
  commit exists.
* A failed send or receive raises what a failed collective raises, at the
  boundary it is waited for: ``with gen:`` takes it for a membership change.
* Copies are not made with one member (nothing to lose them to), when every
  rank's blocks already have a replica on another member (HSDP across nodes;
  with expert parallel, a replica in the same place of another expert group),
  or for state the in-memory reshard does not handle (`Partial`, plain
  parameters not declared replicated). Tensor-parallel slices are copied
  like FSDP's shards.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, cast

import torch
import torch.distributed as dist

from springback.client import plans
from springback.client.spec import peer_copy_every_steps
from springback.v1 import types_pb2 as pb
from springback.worker.rank import rngstate
from springback.worker.state.mesh import MeshLayout
from springback.worker.rank.rendezvous import handed_to_gloo
from springback.worker.state.peerobjects import all_gather_objects, broadcast_object
from springback.worker.state.reshard import (
    NotReshardable,
    Piece,
    Box,
    Transfer,
    agree_written,
    exchange,
    plan_transfers,
)

from springback.worker.state.sharded import unfilled

if TYPE_CHECKING:
    from springback.worker.rank.context import RankContext
    from springback.worker.state.sharded import Held, ShardedModel

log = logging.getLogger(__name__)

COPY_TAG = 0x5BC0
"""The point-to-point tag of peer-copy transfers (one message per pair and copy)."""
_ALIGN = 64  # bytes: every tensor's offset in a flat buffer, so any dtype can view it

Index = dict[str, tuple[int, Box, tuple[int, ...]]]
"""Key -> (byte offset in the flat buffer, block, local shape)."""


@dataclasses.dataclass
class Snapshot:
    """One rank's shards at one step in a flat host-memory buffer."""

    step: int
    index: Index
    flat: torch.Tensor
    whole: dict[str, Any] | None = None
    """The rank's own snapshot only: hyperparameters and other state= entries."""

    def boxes(self) -> dict[str, Box]:
        return {k: box for k, (_, box, _) in self.index.items()}

    def piece(self, key: str) -> Piece:
        offset, rows, shape = self.index[key]
        dtype = getattr(torch, rows.dtype)
        size = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        return self.flat[offset:offset + size].view(dtype).view(shape), rows


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def index_of(held: Held) -> tuple[Index, int]:
    """Where each of `held`'s tensors goes in a flat buffer, and its size."""
    index: Index = {}
    offset = 0
    for key in sorted(held):
        local, rows = held[key]
        index[key] = (offset, rows, tuple(local.shape))
        size = local.numel() * local.element_size()
        offset += -(-size // _ALIGN) * _ALIGN
    return index, offset


def new_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A flat host buffer of `nbytes` bytes (page-locked with `pin`)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def take_snapshot(held: Held, step: int, whole: dict[str, Any] | None,
                  buffer: Callable[[int, bool], torch.Tensor] = new_buffer) -> Snapshot:
    """Copies `held` into a flat host buffer from `buffer(nbytes, pin)`
    (pinned for CUDA tensors)."""
    index, size = index_of(held)
    pin = any(t.is_cuda for t, _ in held.values())
    snap = Snapshot(step, index, buffer(size, pin), whole)
    for key, (local, _) in held.items():
        snap.piece(key)[0].copy_(local.detach().reshape(snap.index[key][2]))
    return snap


def partners(plan: pb.Plan) -> dict[int, int]:
    """Rank -> the rank that keeps its copy: the same local rank (modulo
    that node's ranks) on the next node in plan order; empty with fewer
    than two nodes."""
    nodes = plans.node_starts(plan)
    if len(nodes) < 2:
        return {}
    out: dict[int, int] = {}
    for i, (first, size) in enumerate(nodes):
        next_first, next_size = nodes[(i + 1) % len(nodes)]
        for local in range(size):
            out[first + local] = next_first + local % next_size
    return out


def replicated_elsewhere(plan: pb.Plan) -> bool:
    """Every rank's rows have a replica (same pp, shard, tp and expert-group
    coordinate, another replicate index) on another member: HSDP across
    nodes. With ep > 1 a rank's expert slice is the same as another's only
    at the same ``ep`` coordinate (`worker/state/mesh.py`), so a replica of
    its shard that holds other experts is none."""
    layout = MeshLayout.from_plan(plan)
    node = {first + i: n for n, (first, size) in enumerate(plans.node_starts(plan))
            for i in range(size)}
    coords = {r: {**layout.coordinates(r), **layout.expert_coordinates(r)}
              for r in range(layout.world_size)}

    def key(r: int) -> tuple[int, int, int, int]:
        return coords[r]["pp"], coords[r]["shard"], coords[r]["tp"], coords[r]["ep"]

    return all(any(key(o) == key(r) and node[o] != node[r] for o in coords if o != r)
               for r in coords)


class PeerCopyStore:
    """A rank's snapshots and the copies it keeps for others, across the
    generations of its Session (the pieces are of global rows, so they stay
    usable when the layout changes)."""

    def __init__(self) -> None:
        self.own: list[Snapshot] = []
        self.copies: list[Snapshot] = []
        self._free: list[torch.Tensor] = []
        """Buffers of pieces a newer copy replaced, for the next copy's pieces."""

    def nbytes(self) -> int:
        """Host memory held: pieces and the buffers kept for the next copy."""
        return sum(s.flat.numel() for s in self.own + self.copies) + \
            sum(b.numel() for b in self._free)

    def buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A flat buffer for a new piece: a replaced piece's of that size if
        one is kept (fresh host memory costs a page fault per page, about
        as much as the copy into it), else a new one."""
        for i, b in enumerate(self._free):
            if b.numel() == nbytes and b.is_pinned() == pin:
                return self._free.pop(i)
        return new_buffer(nbytes, pin)

    def keep_from(self, step: int) -> None:
        """Drops the pieces of steps before `step` (a newer copy completed;
        their own transfers completed a copy earlier). Their buffers are kept
        for the next copy: a copy in flight needs a second set of buffers
        anyway, so this does not raise the peak, only keeps it between copies.
        Buffers of another size than the pieces held now (the layout changed)
        are let go."""
        dropped = [s for s in self.own + self.copies if s.step < step]
        self.own = [s for s in self.own if s.step >= step]
        self.copies = [s for s in self.copies if s.step >= step]
        sizes = {s.flat.numel() for s in self.own + self.copies}
        self._free = [b for b in self._free + [s.flat for s in dropped] if b.numel() in sizes]

    def drop_after(self, step: int) -> None:
        """Drops pieces newer than the state the ranks agreed on (after a
        rollback they belong to steps that are trained again)."""
        self.own = [s for s in self.own if s.step <= step]
        self.copies = [s for s in self.copies if s.step <= step]

    def clear(self) -> None:
        self.own, self.copies, self._free = [], [], []

    def offer(self) -> dict[int, dict[str, Any]]:
        """Per step: whether this rank has its own snapshot, and the rows of
        every piece it holds."""
        out: dict[int, dict[str, Any]] = {}
        for snap in self.own + self.copies:
            entry = out.setdefault(snap.step, {"own": False, "rows": []})
            entry["own"] = entry["own"] or snap.whole is not None
            entry["rows"].append(snap.boxes())
        return out

    def piece_for(self, step: int, t: Transfer) -> Piece:
        """A piece of step `step` on this rank that holds `t`'s block."""
        for snap in self.own + self.copies:
            if snap.step == step and t.key in snap.index:
                if snap.index[t.key][1].contains(t.span):
                    return snap.piece(t.key)
        raise KeyError(f"no piece of step {step} holds {t}")

    def own_at(self, step: int) -> Snapshot | None:
        return next((s for s in self.own if s.step == step), None)

    def roll_back(self, ctx: RankContext, sm: ShardedModel, world: int, rank: int,
                  newest_commit: int) -> tuple[int, int] | None:
        """Collective: fills the built model from the newest step whose pieces
        cover every row (not older than `newest_commit`), and rolls the
        whole-held state back to it. Returns (source rank, restore kind), or
        None on every rank when no such step exists. A step whose pieces do
        not fill every tensor of the new model, or whose exchange left a
        row unwritten on any rank (`agree_written`), is passed over. A
        failure mid-way leaves the snapshots and copies as they were, and
        the session's step unchanged (a later start may use them again)."""
        offers = cast(list[dict[int, dict[str, Any]]], all_gather_objects(self.offer(), world))
        # every rank's new model's keys: a fill is judged over all of them
        # (a pipeline's stages own different keys), alike on every rank
        owns = [set(cast(list[str], o)) for o in all_gather_objects(sorted(sm.own_keys()), world)]
        for step in sorted({s for o in offers for s in o}, reverse=True):
            if step < newest_commit:
                break
            owners = [r for r, o in enumerate(offers) if o.get(step, {}).get("own")]
            pieces = [(r, rows) for r, o in enumerate(offers) for rows in o.get(step, {}).get("rows", [])]
            if not owners:
                continue
            keys = {k: rows for _, have in pieces for k, rows in have.items()}
            if unfilled(keys, owns):
                continue  # this step's pieces do not fill the new models
            targets = sm.targets(keys)
            needs = all_gather_objects({k: r for k, (_, r) in targets.items()}, world)
            transfers = plan_transfers([have for _, have in pieces],
                                       needs,  # type: ignore[arg-type]
                                       owners=[r for r, _ in pieces])
            if transfers is None:
                continue
            received = exchange(transfers, rank, lambda t: self.piece_for(step, t), targets,
                                host=True)
            if not agree_written(transfers, rank, targets):
                continue
            self._restore_whole(ctx, sm, owners[0], rank, step)
            log.warning("a lost node's shards came from peer copies: rolled back to step %d "
                        "(%d transfers, %d bytes received here)", step, len(transfers), received)
            return owners[0], pb.RESTORE_KIND_PEER_COPY
        return None

    def _restore_whole(self, ctx: RankContext, sm: ShardedModel, source: int, rank: int,
                       step: int) -> None:
        mine = self.own_at(step)
        whole = broadcast_object(mine.whole if rank == source and mine else None, source, rank)
        sm.set_hyperparameters(whole["hyper"])
        sm.set_loose_state(whole["loose"])
        for k, v in ctx.state.items():
            if k not in ("model", "optimizer"):
                v.load_state_dict(copy.deepcopy(whole["extra"][k]))
        # its own RNG state at the copy step where it has it: the replay draws alike
        rngstate.apply(mine.whole["rng"] if mine is not None and mine.whole else whole["rng"])
        ctx.held.rolled_back(step)
        self.drop_after(step)


@dataclasses.dataclass
class _InFlight:
    step: int
    works: list[dist.Work | None]
    received: list[Snapshot]
    views: list[torch.Tensor]


class GenerationCopies:
    """One generation's peer copies on one rank (`Generation` calls
    `after_step` at every step boundary, `settle` when it leaves cleanly,
    `abandon` when it breaks)."""

    def __init__(self, store: PeerCopyStore, ctx: RankContext, sm: ShardedModel,
                 plan: pb.Plan, rank: int, every_steps: int) -> None:
        self.store, self.ctx, self.sm = store, ctx, sm
        self.rank, self.world = rank, plan.world_size
        self.every_steps = every_steps
        pairs = partners(plan)
        self.partner = pairs.get(rank)
        self.senders = sorted(r for r, p in pairs.items() if p == rank and r != rank)
        self._indexes: list[tuple[Index, int]] | None = None
        self._in_flight: _InFlight | None = None
        self._abandoned: _InFlight | None = None
        self.snapshot_s = 0.0
        """Time the step loop spent in snapshots and waits for transfers."""

    @classmethod
    def for_generation(cls, store: PeerCopyStore, ctx: RankContext, sm: ShardedModel,
                       plan: pb.Plan, rank: int) -> GenerationCopies | None:
        """The generation's copies, or None where none are made (see the
        module docstring); the same answer on every rank."""
        every = peer_copy_every_steps(plan.spec)
        if every == 0 or not partners(plan) or replicated_elsewhere(plan):
            return None
        return cls(store, ctx, sm, plan, rank, every)

    def after_step(self, step: int) -> None:
        """At the end of `step` (every rank, same steps): completes the copy
        in flight, and at a copy step snapshots this rank's shards and starts
        their transfer. Raises what a failed transfer raises."""
        t0 = time.monotonic()
        if self._in_flight is not None:
            self._complete()
        if self.every_steps > 0 and step % self.every_steps == 0:
            try:
                held = self.sm.shards()
            except NotReshardable as e:
                log.warning("no peer copies in this generation: %s", e)
                self.every_steps = 0
                return
            self._start(step, held)
        self.snapshot_s += time.monotonic() - t0

    def settle(self) -> None:
        """Waits for the copy in flight (leaving the generation cleanly)."""
        if self._in_flight is not None:
            self._complete()

    def abandon(self) -> None:
        """Drops the copy in flight unfinished (the group is being torn down):
        its partly received buffers are never used (kept referenced until
        this object goes, after the group: gloo may still write into them).
        Idempotent."""
        if self._in_flight is not None:
            self._abandoned, self._in_flight = self._in_flight, None

    def _start(self, step: int, held: Held) -> None:
        if self._indexes is None:  # once per generation, at its first copy step
            self._indexes = cast(list[tuple[Index, int]],
                                 all_gather_objects(index_of(held), self.world))
        whole = {"hyper": copy.deepcopy(self.sm.hyperparameters()),
                 "loose": copy.deepcopy(self.sm.loose_state()),
                 "extra": {k: copy.deepcopy(v.state_dict()) for k, v in self.ctx.state.items()
                           if k not in ("model", "optimizer")},
                 "rng": rngstate.capture()}
        snap = take_snapshot(held, step, whole, self.store.buffer)
        self.store.own.append(snap)
        works: list[dist.Work | None] = []
        received, views = [], []
        if self.partner is not None and self.partner != self.rank:
            view = snap.flat.view(-1)  # its own tensor: gloo's hold on it ends with the work
            works.append(dist.isend(view, self.partner, tag=COPY_TAG))
            views.append(view)
        for sender in self.senders:
            index, size = self._indexes[sender]
            copy_of = Snapshot(step, index, self.store.buffer(size, False))
            view = copy_of.flat.view(-1)
            works.append(dist.irecv(view, sender, tag=COPY_TAG))
            received.append(copy_of)
            views.append(view)
        self._in_flight = _InFlight(step, works, received, views)

    def _complete(self) -> None:
        """Waits for the copy in flight. A wait that fails (a peer died)
        leaves the copy in flight, for `abandon` to keep its buffers until
        the group is gone: gloo may still be writing into the others."""
        flight = self._in_flight
        assert flight is not None
        for work in flight.works:
            if work is not None:
                work.wait()
        self._in_flight = None
        handed_to_gloo(*flight.views)
        self.store.copies.extend(flight.received)
        self.store.keep_from(flight.step)
