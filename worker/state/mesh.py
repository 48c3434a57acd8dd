"""A generation's parallel layout as a named torch DeviceMesh.

The layout's rules and arithmetic are `springback.client.layout`'s (defaults,
which worlds fit, the dp split, rank <-> coordinate <-> piece); this module
re-exports its `MeshLayout`, `MESH_DIMS` and `EXPERT_DIMS` for the ranks and
keeps what needs torch: `build_mesh` makes the mesh of a plan's layout, with
dims `MESH_DIMS` (pp, replicate, shard, tp) in the layout's rank order.

An expert stacked as ``[E, ...]`` and placed ``(Replicate(), Shard(0))`` on
`expert_mesh`'s ``("edp", "ep")`` view is held in ``ep`` slices by every
expert group (ep consecutive dp ranks, `MeshLayout.expert_coordinates`).
When ep divides the dp ranks of a node (with pp = 1) an expert group lies
inside one node and, with two nodes or more, its replicas on the others: a
lost node leaves every expert a live holder, and the survivors' reshard
(`worker/state/reshard.py`) fills the new layout from them. The expert mesh
is a view of the same ranks: `MESH_DIMS` and the ranks along them are the
same with and without ep.

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

from typing import TYPE_CHECKING

from springback.client import layout as layouts
from springback.client.layout import EXPERT_DIMS, MESH_DIMS, MeshLayout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["EXPERT_DIMS", "MESH_DIMS", "MeshLayout", "build_mesh", "expert_mesh",
           "stage_layers"]

_FLAT_DP = "_springback_dp"
"""The name of the flattened dp dimension the expert view is cut from."""

_VIEW_ATTR = "_springback_expert_view"
"""The attribute of a generation's mesh that keeps its expert view (so the
view lives and goes with the mesh)."""


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
    return layouts.stage_layers(num_layers, mesh.size(0), mesh.get_local_rank("pp"))


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
