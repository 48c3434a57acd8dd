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

`build_mesh` is a collective over the generation's default group (every rank
calls it in the same order); torch creates one sub-group per mesh dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from springback.v1 import types_pb2 as pb

MESH_DIMS = ("pp", "replicate", "shard", "tp")
"""Dimension names of `build_mesh`'s mesh, outermost first."""


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
        return out

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

    def as_dict(self) -> dict[str, int]:
        """The layout as a checkpoint manifest records it."""
        return {"dp": self.dp, "replicate": self.replicate, "shard": self.shard,
                "tp": self.tp, "pp": self.pp, "ep": self.ep}


def build_mesh(layout: MeshLayout, device_type: str) -> torch.distributed.device_mesh.DeviceMesh:
    """The named DeviceMesh of `layout` over the default process group
    (collective; raises what a failed collective raises, which ends the
    generation like a failed step)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
