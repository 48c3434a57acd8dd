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

With an ``ep`` degree in the layout, ``springback.worker.expert_mesh(mesh)``
is the ``("edp", "ep")`` view of the dp ranks for expert-parallel parameters
(experts stacked ``[E, ...]``, placed ``(Replicate(), Shard(0))``; see
`worker/state/mesh.py` and tests/worker/moe_train.py); they reshard like any
DTensor.

With a ``pp`` degree, `build` returns this rank's pipeline *stage*: the full
model with the other stages' layers deleted (``springback.worker.stage_layers(
mesh, num_layers)`` says which this stage keeps; `worker/state/mesh.py`), so
the state keys stay the full model's names whichever stage holds a layer,
and an optimizer over the stage's parameters (the same param groups on every
stage: the source rank's settings are set on all). The script makes its
``PipelineStage`` and schedule over ``mesh["pp"].get_group()`` from
``gen.model`` in each generation (tests/worker/pp_train.py). Each rank is
filled with its own stage's keys only, from the stage's live dp replicas
(plain parameters declared `replicated`, or DTensors); `unfilled` judges a
fill on every rank's model keys, so the stages decide alike. Each stage's
optimizer step first waits for every rank to reach it (an optimizer step
pre-hook that `Generation` registers: an all-reduce over the world that
carries the previous step's vote, `worker/train/boundary.py`), so no stage
applies a step that another stage broke in.

`build` is called at the start of every generation on that generation's mesh
(each generation has a new process group, and FSDP2 modules are bound to
their mesh); the state is then carried over from the previous generation's
shards in memory (`worker/state/reshard.py`), or restored from a checkpoint, or,
on a fresh start, kept as `build` made it (seed the model's initialisation
identically on every rank, as with plain FSDP2).

When every value of the new model will be overwritten (from the survivors'
shards, peer copies or a checkpoint), `build` runs under the meta device and
the result is given uninitialised memory (``to_empty``): the random
initialisation that the fill would overwrite is skipped, which was most of a
recovery's time (5 x Linear(2048) with AdamW, FSDP2 on 2 ranks: build 0.19 s
of 0.27 s). FSDP2 keeps its parameter objects through ``to_empty``, so the
optimizer `build` made stays bound to them; plain parameters are replaced
there, and the optimizer's groups are pointed at the new ones (while it
holds no state: it was just built). A build that does not work on the
meta device (it raises there, moves tensors off it, or leaves tensors outside
the parameters and buffers on it), and a model with non-persistent buffers
when the state comes from a checkpoint (which does not hold them), is built
again for real: `build` may run twice in a generation.
``Session(build_on_meta=False)`` always builds for real.

Failure semantics: an exception raised by `build` ends the rank with
`BuildFailed` naming it (not a RuntimeError, so it is never taken for a
membership change); the agent reports the rank's failure. The previous
generation's model and optimizer are released before `build` runs, once
their shards have been taken (`capture`): peak memory is one model's state
plus the held shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import torch

from springback.worker.state.reshard import NotReshardable, Box, box_of

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

BuildFn = Callable[["DeviceMesh"], tuple[torch.nn.Module, torch.optim.Optimizer]]
"""The script's build function: ``(mesh) -> (model, optimizer)``."""

Held = dict[str, tuple[torch.Tensor, Box]]
"""Tensors by key: local data and the block of the global tensor it is."""


class BuildFailed(Exception):
    """The script's build function raised (the rank fails with this)."""


@dataclasses.dataclass
class Captured:
    """What a rank holds of the previous generation's model and optimizer,
    taken when a generation starts and kept until one starts (`agreement`)."""

    held: Held
    """Every tensor's local data and the block it is."""
    loose: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Per parameter (by name): optimizer state entries that are not tensors."""
    digests: dict[str, str] = dataclasses.field(default_factory=dict)
    """Plain (not DTensor) tensors, taken as replicated: SHA-256 of their bytes,
    so the agreement can prove every holder has the same values."""
    refused: str = ""
    """Why this rank's state cannot be resharded in memory (a placement or a
    plain parameter `box_of` does not handle): a restore is agreed instead."""


class ShardedModel:
    """The model and optimizer of the generation, rebuilt on every mesh."""

    def __init__(self, build: BuildFn, *, on_meta: bool = True,
                 replicated: Collection[str] = ()) -> None:
        # imported now, not inside the first generation's collectives (seconds
        # on a loaded machine, longer than a short collective timeout); dynamo
        # is what FSDP2's first `fully_shard` imports (0.5 s here): a joiner
        # pays for it before it joins, not in the build the others wait for
        import torch._dynamo  # noqa: F401
        import torch.distributed.device_mesh  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.tensor  # noqa: F401

        self.build = build
        self.replicated = frozenset(replicated)
        """Plain (not DTensor) parameters the script declares identical on
        every rank; any other plain parameter is refused (`shards`)."""
        self.on_meta = on_meta
        """Build on the meta device when the state is filled from elsewhere."""
        self.uninitialised = False
        """The model holds uninitialised memory: every value must be filled."""
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.mesh: DeviceMesh | None = None
        """The mesh the model was built on."""
        self._params: dict[str, torch.Tensor] = {}

    def capture(self) -> Captured:
        """This rank's shards of the current model and optimizer (`shards`),
        with what travels beside them, and releases the model. Never raises
        for a placement: a `NotReshardable` is kept as `Captured.refused`.
        Empty before the first build."""
        try:
            captured = Captured(self.shards(), self.loose_state(), self._plain_digests())
        except NotReshardable as e:
            captured = Captured({}, refused=str(e))
        self.release()
        return captured

    def release(self) -> None:
        """Drops the model and optimizer (a start that failed built them; they
        are never a source)."""
        self.model = self.optimizer = None
        self._params = {}

    def shards(self) -> Held:
        """This rank's shards of the current model and optimizer (no
        collective; the tensors are referenced, not copied); NotReshardable
        for a placement the reshard does not handle, and for a plain (not
        DTensor) parameter not declared `replicated`: its values may be this
        rank's own slice (hand-written tensor or expert parallel), which a
        joiner must not take for the whole. Plain buffers are replicated, as
        FSDP2 leaves them (the agreement checks their digests). Empty before
        the first build."""
        if self.model is None:
            return {}
        from torch.distributed.tensor import DTensor

        held: Held = {}
        for fqn, p in self._params.items():
            if not isinstance(p, DTensor) and fqn not in self.replicated:
                raise NotReshardable(
                    f"parameter {fqn!r} is a plain tensor, not a DTensor: it may hold this "
                    "rank's slice only (declare it with Session(replicated=[...]) if every "
                    "rank holds the same values)")
            held[f"param/{fqn}"] = box_of(p)
            for name, value in (self.optimizer.state.get(p, {}) if self.optimizer else {}).items():
                if isinstance(value, torch.Tensor):
                    held[f"optim/{fqn}/{name}"] = box_of(value)
        for fqn, b in self.model.named_buffers():
            held[f"buffer/{fqn}"] = box_of(b)
        return held

    def loose_state(self) -> dict[str, dict[str, Any]]:
        """Per parameter: its optimizer state entries that are not tensors."""
        if self.optimizer is None:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for fqn, p in self._params.items():
            loose = {k: v for k, v in self.optimizer.state.get(p, {}).items()
                     if not isinstance(v, torch.Tensor)}
            if loose:
                out[fqn] = loose
        return out

    def _plain_digests(self) -> dict[str, str]:
        """SHA-256 of every plain (not DTensor) tensor's bytes, by key."""
        from torch.distributed.tensor import DTensor

        if self.model is None:
            return {}
        plain = [(f"param/{fqn}", p) for fqn, p in self._params.items()
                 if not isinstance(p, DTensor)]
        plain += [(f"buffer/{fqn}", b) for fqn, b in self.model.named_buffers()]
        return {key: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8)
                                    .numpy().tobytes()).hexdigest()
                for key, t in plain}

    def set_loose_state(self, loose: dict[str, dict[str, Any]]) -> None:
        """Puts the source's non-tensor optimizer state into the new optimizer."""
        assert self.optimizer is not None
        for fqn, entries in loose.items():
            if fqn not in self._params:
                raise BuildFailed(f"build() made no parameter {fqn!r}; the state has one")
            self.optimizer.state[self._params[fqn]].update(entries)

    def own_keys(self) -> set[str]:
        """The ``param/`` and ``buffer/`` keys of the new model (a pipeline
        stage: its own layers' only)."""
        assert self.model is not None
        own = {f"param/{fqn}" for fqn in self._params}
        return own | {f"buffer/{fqn}" for fqn, _ in self.model.named_buffers()}

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

    def rebuild(self, mesh: DeviceMesh, device: torch.device, *, filled: bool = False,
                from_checkpoint: bool = False) -> None:
        """Calls the script's build function on `mesh` (raises BuildFailed).
        With `filled` (every value will be overwritten; `from_checkpoint`:
        by a checkpoint, which holds no non-persistent buffers) it runs on the
        meta device where it can and the model gets uninitialised memory on
        `device` (`uninitialised`; module docstring)."""
        self.mesh = mesh
        if filled and self.on_meta:
            try:
                with torch.device("meta"):
                    self._adopt(*self._call(mesh))
                if self._materialise(device, from_checkpoint):
                    return
            except Exception as e:  # noqa: BLE001 - any failure here: build for real
                log.info("building on the meta device failed (%s: %s): building for real",
                         type(e).__name__, e)
        self.uninitialised = False
        self._adopt(*self._call(mesh))

    def _call(self, mesh: DeviceMesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
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
        return model, optimizer

    def _adopt(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._params = dict(model.named_parameters())

    def _materialise(self, device: torch.device, from_checkpoint: bool) -> bool:
        """Gives the meta-built model uninitialised memory on `device`; False
        (build for real) where the fill could leave a value unset."""
        model, optimizer = self.model, self.optimizer
        assert model is not None and optimizer is not None
        if from_checkpoint and any(m._non_persistent_buffers_set for m in model.modules()):
            return False
        loose = [f"{name}.{attr}" for name, m in model.named_modules()
                 for attr, v in vars(m).items() if isinstance(v, torch.Tensor) and v.is_meta]
        if loose:
            log.info("tensors outside the parameters and buffers (%s) on the meta device: "
                     "building for real", ", ".join(loose[:3]))
            return False
        before = {id(p): name for name, p in model.named_parameters()}
        model.to_empty(device=device)
        _rebind(optimizer, before, dict(model.named_parameters()))
        params = {id(p) for p in model.parameters()}
        if any(id(p) not in params for g in optimizer.param_groups for p in g["params"]) or any(
                t.is_meta for t in (*model.parameters(), *model.buffers())):
            return False
        self._params = dict(model.named_parameters())
        self.uninitialised = True
        return True

    def targets(self, keys: dict[str, Box]) -> Held:
        """The views of the new model and optimizer that the held `keys` (of
        any rank) go into, for the keys this model has (a pipeline stage's
        own: the other stages' keys are skipped); creates optimizer state entries the new optimizer
        does not have yet, shaped and placed like their parameter."""
        assert self.model is not None and self.optimizer is not None
        buffers = dict(self.model.named_buffers())
        own = self.own_keys()
        out: Held = {}
        for key, rows in keys.items():
            kind, _, rest = key.partition("/")
            if _model_key(key) not in own:
                continue  # another pipeline stage's
            if kind == "param":
                out[key] = box_of(self._params[rest])
            elif kind == "buffer":
                out[key] = box_of(buffers[rest])
            else:
                fqn, _, name = rest.rpartition("/")
                out[key] = box_of(self._optimizer_entry(fqn, name, rows))
        return out

    def _optimizer_entry(self, fqn: str, name: str, rows: Box) -> torch.Tensor:
        param = self._params[fqn]
        state = self.optimizer.state[param]  # type: ignore[union-attr]
        if name not in state:
            dtype = getattr(torch, rows.dtype)
            if rows.shape == tuple(param.shape):
                state[name] = torch.empty_like(param, dtype=dtype)
            else:
                state[name] = torch.zeros(rows.shape, dtype=dtype)
        return state[name]


def _rebind(optimizer: torch.optim.Optimizer, before: dict[int, str],
            after: dict[str, torch.Tensor]) -> None:
    """Points a fresh optimizer's parameter groups at the parameters
    ``to_empty`` made (a plain parameter is replaced there, a DTensor one
    is kept): `before` names the meta parameters by id, `after` the new ones
    by name. The lists are changed in place (an optimizer may keep a
    reference to them). Nothing is changed when the optimizer already holds
    state or a group names a tensor that was no parameter of the model: the
    check after it then builds for real."""
    groups = [g["params"] for g in optimizer.param_groups]
    if optimizer.state or any(id(p) not in before for ps in groups for p in ps):
        return
    for ps in groups:
        ps[:] = [after[before[id(p)]] for p in ps]


def _model_key(key: str) -> str:
    """The ``param/`` or ``buffer/`` key a held key belongs to (an optimizer
    entry ``optim/<fqn>/<name>`` to its parameter's)."""
    kind, _, rest = key.partition("/")
    return f"param/{rest.rpartition('/')[0]}" if kind == "optim" else key


def unfilled(keys: Collection[str], owns: list[set[str]]) -> list[str]:
    """What a fill from the held `keys` leaves undone when the new models'
    keys (`ShardedModel.own_keys`) are `owns`, one set per rank: every
    model's parameters and buffers that no held key fills, and held keys
    that no new model has a place for (the build made another model). A
    pure function of its arguments, so ranks that all-gathered their
    `owns` decide alike (a pipeline's stages own different keys)."""
    held = set(keys)
    out = sorted({k for own in owns for k in own} - held)
    placed = set().union(*owns)
    out += [f"{key} (not in the new model)" for key in sorted(held)
            if _model_key(key) not in placed]
    return out
