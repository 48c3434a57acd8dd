"""The parallel layout: its defaults, its rules and its arithmetic, in one place.

A job's spec asks for degrees (``Layout``: tp, pp, ep, shard, min_pp); the
planner fixes each generation's layout (``Plan.layout``, a ``ParallelLayout``:
pp x dp x tp with dp = replicate x shard, ep over dp) from the world its
active members make; every rank reads its coordinates from it. This module
keeps all three, pure (no torch, no I/O), so the client, the coordinator
(`service/policy/planner.py`) and the ranks (`worker/state/mesh.py`, which builds
the torch `DeviceMesh`) compute one thing one way:

* Defaults (`validate`): tp, pp and ep 0 mean 1; min_pp 0 means pp (the
  stage count is fixed); shard 0 lets the planner choose.
* Which worlds fit (`fault`): tp * pp divides the world; ep divides the
  data-parallel size dp = world / (tp * pp), and so does ``layout.shard``
  when the spec fixes it. A world that does not fit is refused naming the
  field at fault.
* The dp split (`resolve`): dp = replicate x shard (HSDP). The spec's
  ``layout.shard`` when set, else shard = gcd(dp, ranks per node / tp):
  shard inside a node and replicate across nodes, so a lost node leaves a
  full replica; 1 when tp does not divide the ranks per node or the nodes
  differ in size (then every dp rank keeps a full replica, like DDP).
* Rank order (`MeshLayout.coordinates`): pp (outermost), then replicate,
  then shard, then tp (innermost),

      rank = ((pp_i * replicate + replicate_i) * shard + shard_i) * tp + tp_i

  so the ranks of one TP group are adjacent (inside one node when tp divides
  the ranks per node) and a shard group is the dp ranks of a node by
  default. ``dp_rank = replicate_i * shard + shard_i`` decides which samples
  a rank trains on: TP and PP peers (same dp_rank) get identical batches.
* Expert parallel (`MeshLayout.expert_coordinates`) sub-divides the dp
  ranks: an expert group is ``ep`` consecutive dp ranks and the groups are
  replicas of each other (``edp = dp // ep`` of them),
  ``dp_rank = edp_i * ep + ep_i``.
* Pieces (`MeshLayout.pieces`): the state a rank holds is one row per
  (pipeline stage, shard index), its (``pp_i``, ``shard_i``); the planner
  keeps a piece's live holders on the node ranks that hold it.
* Layers (`stage_layers`): a pipeline's ``num_layers`` split into ``pp``
  contiguous runs, the first ``num_layers % pp`` one layer longer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from springback.client.errors import InvalidArgument
from springback.v1 import types_pb2 as pb

MESH_DIMS = ("pp", "replicate", "shard", "tp")
"""Dimension names of a generation's mesh, outermost first."""

EXPERT_DIMS = ("edp", "ep")
"""Dimension names of the expert view of the dp ranks, outermost first: the
expert groups' replicas, then the ranks of one expert group."""


def validate(layout: pb.Layout) -> None:
    """Fills in `layout`'s defaults (module docstring) in place; raises
    `InvalidArgument` naming the bad ``layout.*`` field."""
    for degree in ("tp", "pp", "ep"):
        setattr(layout, degree, getattr(layout, degree) or 1)
    layout.min_pp = layout.min_pp or layout.pp
    if layout.min_pp > layout.pp:
        raise InvalidArgument("layout.min_pp", f"{layout.min_pp} is above layout.pp "
                              f"{layout.pp} (the most stages)")


def fault(world: int, layout: pb.Layout) -> str:
    """Why a world of `world` ranks cannot take `layout` ('' when it can),
    naming the spec field at fault."""
    tp, pp = max(layout.tp, 1), max(layout.pp, 1)
    if not world or world % (tp * pp):
        return f"layout.tp * layout.pp = {tp * pp} does not divide the world of {world} ranks"
    dp = world // (tp * pp)
    if dp % max(layout.ep, 1):
        return f"layout.ep = {layout.ep} does not divide the data-parallel size {dp}"
    if layout.shard and dp % layout.shard:
        return f"layout.shard = {layout.shard} does not divide the data-parallel size {dp}"
    return ""


def fewer_stages(layout: pb.Layout) -> range:
    """The stage counts below ``layout.pp`` a generation may run when no
    world fits pp stages, most first, down to ``layout.min_pp`` (empty when
    the stage count is fixed)."""
    lowest = max(layout.min_pp or layout.pp, 1)
    return range(layout.pp - 1, lowest - 1, -1)


def resolve(layout: pb.Layout, node_sizes: Iterable[int]) -> MeshLayout:
    """The generation's layout for nodes of `node_sizes` ranks (the dp split
    of the module docstring); their world must fit `layout` (`fault`)."""
    tp, pp, ep = layout.tp or 1, layout.pp or 1, layout.ep or 1
    sizes = list(node_sizes)
    dp = sum(sizes) // (tp * pp)
    shard = layout.shard
    if not shard:
        distinct = set(sizes)
        per_node = distinct.pop() if len(distinct) == 1 else 0
        shard = math.gcd(dp, per_node // tp) if per_node and per_node % tp == 0 else 1
    return MeshLayout(pp=pp, replicate=dp // shard, shard=shard, tp=tp, ep=ep)


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The layers (indices of ``range(num_layers)``) pipeline stage `stage`
    of `pp` holds. Raises ValueError when a stage would hold no layer."""
    if num_layers < pp:
        raise ValueError(f"num_layers={num_layers} is fewer than the pp={pp} stages")
    base, extra = divmod(num_layers, pp)
    first = stage * base + min(stage, extra)
    return range(first, first + base + (stage < extra))


@dataclass(frozen=True)
class MeshLayout:
    """The degrees of one generation; their product is the world size."""

    pp: int = 1
    replicate: int = 1
    shard: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def from_plan(cls, plan: pb.Plan) -> MeshLayout:
        """The plan's layout; a plan without one (standalone, older
        coordinators) is plain data parallel over its world. Raises
        `InvalidArgument` (field ``plan.layout``) for a layout that does not
        cover the plan's world or whose ep does not divide dp."""
        lay = plan.layout
        tp, pp = lay.tp or 1, lay.pp or 1
        dp = lay.dp or max(plan.world_size // (tp * pp), 1)
        shard = lay.shard or 1
        replicate = lay.replicate or dp // shard
        out = cls(pp=pp, replicate=replicate, shard=shard, tp=tp, ep=lay.ep or 1)
        if out.world_size != plan.world_size:
            raise InvalidArgument(
                "plan.layout", f"pp={pp} x replicate={replicate} x shard={shard} x tp={tp} "
                f"does not cover world_size {plan.world_size}")
        if out.dp % out.ep:
            raise InvalidArgument("plan.layout", f"ep={out.ep} does not divide the "
                                  f"data-parallel size {out.dp}")
        return out

    @classmethod
    def of(cls, lay: pb.ParallelLayout) -> MeshLayout:
        """The degrees a plan's layout message records, 0 read as 1 (no
        check against a world)."""
        return cls(pp=lay.pp or 1, replicate=lay.replicate or 1, shard=lay.shard or 1,
                   tp=lay.tp or 1, ep=lay.ep or 1)

    def message(self) -> pb.ParallelLayout:
        """The layout as a plan records it."""
        return pb.ParallelLayout(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep,
                                 replicate=self.replicate, shard=self.shard)

    @property
    def holds_pieces(self) -> bool:
        """Whether ranks hold different pieces of the state (pipeline stages,
        FSDP shards, TP slices or expert groups), not only whole replicas."""
        return max(self.pp, self.shard, self.tp, self.ep) > 1

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that train on different samples."""
        return self.replicate * self.shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The mesh shape in `MESH_DIMS` order."""
        return (self.pp, self.replicate, self.shard, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinate along each of `MESH_DIMS`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        out: dict[str, int] = {}
        rest = rank
        for name, size in zip(reversed(MESH_DIMS), reversed(self.shape)):
            rest, out[name] = divmod(rest, size)
        return out

    def dp_rank(self, rank: int) -> int:
        """`rank`'s data-parallel coordinate (what the sampler shards by)."""
        c = self.coordinates(rank)
        return c["replicate"] * self.shard + c["shard"]

    def expert_coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinate along each of `EXPERT_DIMS` (module docstring)."""
        edp, ep = divmod(self.dp_rank(rank), self.ep)
        return {"edp": edp, "ep": ep}

    def pieces(self, first_rank: int, size: int) -> frozenset[tuple[int, int]]:
        """The (pipeline stage, shard index) pairs of ranks ``first_rank ..
        first_rank + size - 1``: the rows of the state a node of them holds.
        O(size), no coordinate dictionaries (the planner asks for every node)."""
        tp, shard = self.tp, self.shard
        per_stage = self.replicate * shard * tp
        return frozenset((r // per_stage, (r // tp) % shard)
                         for r in range(first_rank, first_rank + size))

    def as_dict(self) -> dict[str, int]:
        """The layout as a checkpoint manifest records it."""
        return {"dp": self.dp, "replicate": self.replicate, "shard": self.shard,
                "tp": self.tp, "pp": self.pp, "ep": self.ep}
