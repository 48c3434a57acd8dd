"""A generation's parallel layout as coordinates and as a named DeviceMesh.

The planner fixes the layout of each generation (``Plan.layout``: pp, dp =
replicate x shard, tp, ep over dp; see `service/planner.py`). Global ranks are
ordered pp (outermost), then dp (replicate, then shard), then tp (innermost):

    rank = ((pp_i * replicate + replicate_i) * shard + shard_i) * tp + tp_i

so the ranks of one TP group are adjacent (inside one node when tp divides
the ranks per node) and a shard group is the dp ranks of a node by default.
The data-parallel coordinate ``dp_rank = replicate_i * shard + shard_i``
decides which samples a rank trains on: TP and PP peers (same dp_rank) get
identical batches.

Expert parallel sub-divides the data-parallel ranks (``ep`` divides dp; the
planner waits otherwise): an *expert group* is ``ep`` consecutive dp ranks,
and the groups are replicas of each other (``edp = dp // ep`` of them),

    dp_rank = edp_i * ep + ep_i

so an expert stacked as ``[E, ...]`` and placed ``(Replicate(), Shard(0))``
on `expert_mesh`'s ``("edp", "ep")`` is held in ``ep`` slices by every expert
group. When ep divides the dp ranks of a node (with pp = 1) an expert group
lies inside one node and, with two nodes or more, its replicas on the
others: a lost node leaves every expert a live holder, and the survivors'
reshard (`worker/state/reshard.py`) fills the new layout from them. The
expert mesh is a view of the same ranks: `MESH_DIMS` and the ranks along
them are the same with and without ep.

Pipeline parallel keeps ``pp`` across generations unless the spec lets it
shrink (``layout.min_pp``: the planner re-partitions the layers): the stage
a rank holds is its ``pp`` coordinate, and `stage_layers` says which of a
model's layers that stage holds. A stage's state keeps the full model's
names (the script deletes the other stages' layers, `worker/state/sharded.py`),
so a lost node's stage is refilled from any live dp replica of it, and a rank
that moves to another stage takes that stage's layers from their holders.

`build_mesh` is a collective over the generation's default group (every rank
calls it in the same order); torch creates one sub-group per mesh dimension
(and, with ep > 1, one for the flattened dp ranks and one per expert dimension).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from springback.v1 import types_pb2 as pb

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pp", "replicate", "shard", "tp")
"""Dimension names of `build_mesh`'s mesh, outermost first."""

EXPERT_DIMS = ("edp", "ep")
"""Dimension names of `expert_mesh`'s view of the dp ranks, outermost first:
the expert groups' replicas, then the ranks of one expert group."""

_FLAT_DP = "_springback_dp"
"""The name of the flattened dp dimension the expert view is cut from."""

_VIEW_ATTR = "_springback_expert_view"
"""The attribute of a generation's mesh that keeps its expert view (so the
view lives and goes with the mesh)."""


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
        coordinators) is plain data parallel over its world."""
        lay = plan.layout
        tp, pp = lay.tp or 1, lay.pp or 1
        dp = lay.dp or max(plan.world_size // (tp * pp), 1)
        shard = lay.shard or 1
        replicate = lay.replicate or dp // shard
        out = cls(pp=pp, replicate=replicate, shard=shard, tp=tp, ep=lay.ep or 1)
        if out.world_size != plan.world_size:
            raise ValueError(
                f"plan layout pp={pp} x replicate={replicate} x shard={shard} x tp={tp} "
                f"does not cover world_size {plan.world_size}")
        if out.dp % out.ep:
            raise ValueError(f"plan layout ep={out.ep} does not divide the data-parallel "
                             f"size {out.dp}")
        return out

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

    def as_dict(self) -> dict[str, int]:
        """The layout as a checkpoint manifest records it."""
        return {"dp": self.dp, "replicate": self.replicate, "shard": self.shard,
                "tp": self.tp, "pp": self.pp, "ep": self.ep}


def stage_layers(mesh: DeviceMesh, num_layers: int) -> range:
    """The layers (indices of ``range(num_layers)``) that this rank's
    pipeline stage holds in the generation's `mesh`: ``num_layers`` split
    into ``pp`` contiguous runs, the first ``num_layers % pp`` stages one
    layer longer; stage i is this rank's ``pp`` coordinate. No collective.
    Raises ValueError when a stage would hold no layer (``num_layers < pp``)
    or for a mesh that is not on `MESH_DIMS`."""
    if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(f"stage_layers needs the generation's mesh (dims {MESH_DIMS}), "
                         f"got dims {mesh.mesh_dim_names}")
    pp, stage = mesh.size(0), mesh.get_local_rank("pp")
    if num_layers < pp:
        raise ValueError(f"num_layers={num_layers} is fewer than the pp={pp} stages")
    base, extra = divmod(num_layers, pp)
    first = stage * base + min(stage, extra)
    return range(first, first + base + (stage < extra))


def build_mesh(layout: MeshLayout, device_type: str) -> DeviceMesh:
    """The named DeviceMesh of `layout` over the default process group, and
    with ep > 1 its expert view (`expert_mesh`), made now so that its groups
    exist before the ranks exchange their sockets' addresses (a peer's death
    seen on them is then named). Collective; raises what a failed collective
    raises, which ends the generation like a failed step."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
    if layout.ep > 1:
        _expert_view(mesh, layout.ep)
    return mesh


def expert_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ``("edp", "ep")`` view (`EXPERT_DIMS`) of this rank's dp ranks in
    the generation's `mesh`, for expert-parallel parameters (module
    docstring): ``(dp // ep, ep)`` ranks, the plan's ep degree.

    The view `build_mesh` made with the mesh; for a layout without ep (ep = 1,
    e.g. a standalone run) it is made on the first call, a collective then:
    every rank must call it in the same order (the build function, which
    every rank runs, is such a place), it raises what a failed collective
    raises, and a peer's death seen first on its groups is not named (the
    liveness timeout finds it). Idempotent: later calls return the same
    view. Raises ValueError for a mesh that is not on `MESH_DIMS`."""
    view = getattr(mesh, _VIEW_ATTR, None)
    if view is not None:
        return view
    if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(f"expert_mesh needs the generation's mesh (dims {MESH_DIMS}), "
                         f"got dims {mesh.mesh_dim_names}")
    return _expert_view(mesh, 1)


def _expert_view(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    dp = mesh["replicate", "shard"]._flatten(_FLAT_DP)
    view = dp._unflatten(0, (dp.size() // ep, ep), EXPERT_DIMS)
    setattr(mesh, _VIEW_ATTR, view)
    return view
