"""The sharded-model form of a `Session`: the script says how to build and
parallelize its model and optimizer on a mesh, the library calls it.

    def build(mesh):                       # a DeviceMesh: pp, replicate, shard, tp
        model = Net()
        dp = mesh["replicate", "shard"]    # HSDP; FSDP when replicate is 1
        for block in model.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    session = Session(build=build)
    for gen in session.generations():
        with gen:
            model, opt = gen.model, gen.optimizer
            for batch in gen.batches(): ...

`build` is called at the start of every generation on that generation's mesh
(each generation has a new process group, and FSDP2 modules are bound to
their mesh); the state is then carried over from the previous generation's
shards in memory (`worker/reshard.py`), or restored from a checkpoint, or,
on a fresh start, kept as `build` made it (seed the model's initialisation
identically on every rank, as with plain FSDP2).

Failure semantics: an exception raised by `build` ends the rank with
`BuildFailed` naming it (not a RuntimeError, so it is never taken for a
membership change); the agent reports the rank's failure. The previous
generation's model and optimizer are released before `build` runs, once
their shards have been taken (`capture`): peak memory is one model's state
plus the held shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from springback.worker.reshard import Rows, rows_of

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

BuildFn = Callable[["DeviceMesh"], tuple[torch.nn.Module, torch.optim.Optimizer]]
"""The script's build function: ``(mesh) -> (model, optimizer)``."""

Held = dict[str, tuple[torch.Tensor, Rows]]
"""Tensors by key: local data and the rows of dim 0 it is."""


class BuildFailed(Exception):
    """The script's build function raised (the rank fails with this)."""


class ShardedModel:
    """The model and optimizer of the generation, rebuilt on every mesh."""

    def __init__(self, build: BuildFn) -> None:
        # imported now, not inside the first generation's collectives (seconds
        # on a loaded machine, longer than a short collective timeout)
        import torch.distributed.device_mesh  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.tensor  # noqa: F401

        self.build = build
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._params: dict[str, torch.Tensor] = {}

    def capture(self) -> Held:
        """This rank's shards of the current model and optimizer (`shards`)
        and releases the model. Empty before the first build."""
        held = self.shards()
        self.model = self.optimizer = None
        self._params = {}
        return held

    def shards(self) -> Held:
        """This rank's shards of the current model and optimizer (no
        collective; the tensors are referenced, not copied); NotReshardable
        for a placement the reshard does not handle. Empty before the first
        build."""
        if self.model is None:
            return {}
        held: Held = {}
        for fqn, p in self._params.items():
            held[f"param/{fqn}"] = rows_of(p)
            for name, value in (self.optimizer.state.get(p, {}) if self.optimizer else {}).items():
                if isinstance(value, torch.Tensor):
                    held[f"optim/{fqn}/{name}"] = rows_of(value)
        for fqn, b in self.model.named_buffers():
            held[f"buffer/{fqn}"] = rows_of(b)
        return held

    def hyperparameters(self) -> list[dict[str, Any]]:
        """The optimizer's param-group settings (lr, betas, ...), in group order."""
        assert self.optimizer is not None
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def set_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        assert self.optimizer is not None
        if len(groups) != len(self.optimizer.param_groups):
            raise BuildFailed(f"build() made an optimizer with {len(self.optimizer.param_groups)} "
                              f"param groups; the state has {len(groups)}")
        for mine, theirs in zip(self.optimizer.param_groups, groups):
            mine.update(theirs)

    def rebuild(self, mesh: DeviceMesh) -> None:
        """Calls the script's build function on `mesh` (raises BuildFailed)."""
        try:
            built = self.build(mesh)
            model, optimizer = built
        except Exception as e:  # noqa: BLE001 - the script's own error, passed on named
            raise BuildFailed(f"the build function {getattr(self.build, '__name__', self.build)!r}"
                              f" raised {type(e).__name__}: {e}") from e
        if not isinstance(model, torch.nn.Module) or not isinstance(optimizer,
                                                                    torch.optim.Optimizer):
            raise BuildFailed("the build function must return (torch.nn.Module, "
                              f"torch.optim.Optimizer), got {type(built).__name__}")
        self.model, self.optimizer = model, optimizer
        self._params = dict(model.named_parameters())

    def targets(self, keys: dict[str, Rows]) -> Held:
        """The views of the new model and optimizer that the held `keys` (of
        any rank) go into; creates optimizer state entries the new optimizer
        does not have yet, shaped and placed like their parameter."""
        assert self.model is not None and self.optimizer is not None
        buffers = dict(self.model.named_buffers())
        out: Held = {}
        for key, rows in keys.items():
            kind, _, rest = key.partition("/")
            if kind == "param":
                out[key] = rows_of(self._params[rest])
            elif kind == "buffer":
                out[key] = rows_of(buffers[rest])
            else:
                fqn, _, name = rest.rpartition("/")
                out[key] = rows_of(self._optimizer_entry(fqn, name, rows))
        return out

    def _optimizer_entry(self, fqn: str, name: str, rows: Rows) -> torch.Tensor:
        param = self._params[fqn]
        state = self.optimizer.state[param]  # type: ignore[union-attr]
        if name not in state:
            dtype = getattr(torch, rows.dtype)
            if rows.shape == tuple(param.shape):
                state[name] = torch.empty_like(param, dtype=dtype)
            else:
                state[name] = torch.zeros(rows.shape, dtype=dtype)
        return state[name]
