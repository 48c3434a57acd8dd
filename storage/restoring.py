"""Restoring a committed checkpoint at any world size.

The files are DCP, so loading is ``torch.distributed.checkpoint.load``: every rank
passes a state dict laid out for the *current* world size (plain tensors for DDP,
DTensors for FSDP2) and DCP reads the chunks it needs, whatever world size wrote
them (N writers -> M readers). Before loading, the checkpoint's files are verified
against the manifest's CRCs (the reading is split across the ranks and the verdict
agreed with one ``all_gather_object``), and a bad checkpoint is skipped in favour
of the previous committed one, with a warning naming the bad files.

Collective: when torch.distributed is initialized, :func:`restore` and
:func:`restore_model` must be called by every rank of the group (like
``dcp.load``); they block until all ranks finished and raise on every rank alike.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from springback.storage import catalog, compat, dcpread, safeload
from springback.storage.commit import load_record
from springback.storage.errors import CheckpointMismatch, CheckpointNotFound, CorruptCheckpoint
from springback.storage.manifest import Manifest
from springback.storage.store import ObjectStore

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    uri: str
    """Directory of the checkpoint that was loaded."""
    manifest: Manifest
    """Step, generation, data cursor, world size that wrote it, ``extra``."""
    skipped: list[tuple[str, list[str]]]
    """Newer committed checkpoints passed over, with the problems that disqualified them."""

    @property
    def step(self) -> int:
        return self.manifest.step


def _dist_group(process_group: Any) -> tuple[int, int, bool]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group), True
    return 0, 1, False


def load(
    ckpt_uri: str,
    state_dict: dict[str, Any],
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
    store: ObjectStore | None = None,
    optimizer_state_as_saved: bool = False,
    unsaved: dict[str, Any] | None = None,
) -> Manifest:
    """Load one committed checkpoint into ``state_dict`` in place (no verification, no fallback).

    Before anything is read, the keys of ``state_dict`` are checked against the
    checkpoint's DCP metadata: a key the checkpoint lacks raises
    :class:`CheckpointMismatch` naming the keys, with ``state_dict`` untouched.
    With ``optimizer_state_as_saved``, a parameter whose optimizer state the
    checkpoint does not hold at all (it had never been stepped when saved, e.g.
    an unused module) has its ``state.<fqn>.*`` entries removed from
    ``state_dict["optim"]`` instead (and put in `unsaved`, by key), so it can
    be restored without state, as it was saved. Raises
    :class:`CheckpointNotFound` if it is not committed.

    A flaky store is survived: each request (resets, refused connections,
    5xx, truncated bodies) is retried on its own within the store's
    `RetryPolicy`; only when one spent that budget are the metadata read or
    the whole ``dcp.load`` retried, collectively (every rank decides alike, see
    :func:`springback.storage.dcpread.collective_retry`), while every failure
    is transient, within the same policy (attempts and ``deadline_s``); then
    :class:`TransientStorageError` names the URI. A permanent error (a missing
    or unreadable file) is raised at once, on every rank. After a failed read
    ``state_dict`` may be partly loaded: load into copies to keep the originals,
    as :func:`restore_model` does.
    """
    s = store or ObjectStore(ckpt_uri, storage_options=storage_options)
    unsaved = {} if unsaved is None else unsaved
    manifest = catalog.read_manifest(ckpt_uri, store=s)
    reader = dcpread.reader_for(ckpt_uri, s)
    metadata = dcpread.collective_retry(lambda: dcpread.read_metadata(reader, ckpt_uri, s),
                                        what="reading the metadata of", uri=ckpt_uri,
                                        store=s, process_group=process_group)
    reader.prime(metadata)  # dcp.load reads it from here, not from the store again
    saved = set(metadata.state_dict_metadata)
    if optimizer_state_as_saved:
        unsaved.update(_drop_unsaved_optimizer_state(state_dict, saved))
    missing = sorted(k for k in compat.flatten_state_dict(state_dict)[0] if k not in saved)
    if missing and NESTED_OPTIMIZER_KEY in saved:
        raise CheckpointMismatch(
            f"checkpoint {ckpt_uri} holds the optimizer's settings by param group index "
            f"({NESTED_OPTIMIZER_KEY}), as Springback wrote them before they were saved by "
            "parameter name: this release cannot restore it; nothing was loaded", uri=ckpt_uri)
    if missing:
        raise CheckpointMismatch(
            f"checkpoint {ckpt_uri} holds no entry for {', '.join(missing[:10])}"
            f"{f' (and {len(missing) - 10} more)' if len(missing) > 10 else ''}: "
            "the state to restore does not match the state that was saved; nothing was loaded",
            uri=ckpt_uri)
    dcpread.collective_retry(
        lambda: dcp.load(state_dict, storage_reader=reader, planner=safeload.SafeLoadPlanner(),
                         process_group=process_group),
        what="reading", uri=ckpt_uri, store=s, process_group=process_group)
    return manifest


def _drop_unsaved_optimizer_state(state_dict: dict[str, Any], saved: set[str]) -> dict[str, Any]:
    """Remove the optimizer state of parameters the checkpoint holds none for
    (``optim.state.<fqn>.<entry>``, the flattened form of `model_state_dict`);
    return the removed entries by key."""
    optim = state_dict.get("optim")
    if not isinstance(optim, dict):
        return {}
    by_param: dict[str, list[str]] = {}
    for key in optim:
        if key.startswith("state."):
            by_param.setdefault(key[len("state."):].rsplit(".", 1)[0], []).append(key)
    dropped = {key: optim.pop(key) for keys in by_param.values()
               if not any(f"optim.{k}" in saved for k in keys) for key in keys}
    if dropped:
        log.info("no optimizer state was saved for %s (never stepped): restored without state",
                 sorted({k[len("state."):].rsplit(".", 1)[0] for k in dropped}))
    return dropped


def _agreed_problems(ckpt_uri: str, store: ObjectStore, rank: int, world: int, distributed: bool, pg: Any) -> list[str]:
    mine = catalog.verify(ckpt_uri, store=store, ranks=(rank, world))
    if not distributed:
        return mine
    gathered: list[list[str] | None] = [None] * world
    dist.all_gather_object(gathered, mine, group=pg)
    return sorted(p for part in gathered for p in (part or []))


def restore(
    base_uri: str,
    state_dict: dict[str, Any],
    *,
    step: int | None = None,
    max_step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
    verify_checksums: bool = True,
    restore_rng: bool = False,
    store: ObjectStore | None = None,
    optimizer_state_as_saved: bool = False,
    unsaved: dict[str, Any] | None = None,
) -> RestoreResult:
    """Load the newest intact committed checkpoint under ``base_uri`` into ``state_dict``.

    With ``step``, only checkpoints of that step are candidates (an operator's
    explicit choice is never silently replaced by another step); without it, the
    newest committed one (at most ``max_step``, when given) is tried first and
    older ones in turn. A candidate whose
    files fail verification is skipped with a warning naming the bad files.
    ``restore_rng`` sets this rank's torch RNG state to the one saved by rank
    ``rank % writers``. Raises :class:`CheckpointNotFound` when there is no
    committed candidate, :class:`CorruptCheckpoint` (with all problems) when every
    candidate is bad, :class:`CheckpointMismatch` when ``state_dict`` has entries
    the chosen checkpoint lacks (see :func:`load`; nothing is loaded then).
    `optimizer_state_as_saved` and `unsaved`: as for :func:`load`.
    """
    s = store or ObjectStore(base_uri, storage_options=storage_options)
    rank, world, distributed = _dist_group(process_group)
    candidates = [c.uri for c in reversed(catalog.committed_checkpoints(base_uri, store=s)) if (step is None or c.step == step) and (max_step is None or c.step <= max_step)]
    if distributed:  # everyone tries the same list, even if a commit lands meanwhile
        box = [candidates]
        dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0) if process_group else 0, group=process_group)
        candidates = box[0]
    if not candidates:
        what = f"step {step}" if step is not None else "any step"
        raise CheckpointNotFound(f"no committed checkpoint for {what} under {base_uri}", uri=base_uri)
    skipped: list[tuple[str, list[str]]] = []
    for uri in candidates:
        problems = _agreed_problems(uri, s, rank, world, distributed, process_group) if verify_checksums else []
        if problems:
            log.warning("checkpoint %s is damaged, falling back to the previous one: %s", uri, "; ".join(problems))
            skipped.append((uri, problems))
            continue
        manifest = load(uri, state_dict, process_group=process_group, store=s,
                        optimizer_state_as_saved=optimizer_state_as_saved, unsaved=unsaved)
        if restore_rng:
            rng = load_record(s, uri, rank % manifest.world_size).rng or {}
            if "cpu" in rng:
                torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        if skipped:
            log.warning("restored %s after skipping %d damaged checkpoint(s)", uri, len(skipped))
        return RestoreResult(uri=uri, manifest=manifest, skipped=skipped)
    all_problems = [p for _, ps in skipped for p in ps]
    raise CorruptCheckpoint(
        f"every committed checkpoint under {base_uri} is damaged: {'; '.join(all_problems)}",
        uri=base_uri,
        problems=all_problems,
    )


NESTED_OPTIMIZER_KEY = "optim.param_groups.0.params"
"""A key only checkpoints with the optimizer's param groups by index hold
(written before `model_state_dict` flattened them by parameter name)."""


def _flat_optimizer_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


_FLAT_OPTIMIZER = _flat_optimizer_options()


def model_state_dict(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra_state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` via ``torch.distributed.checkpoint.state_dict.get_state_dict``.

    The optimizer's part is flattened by parameter name
    (``state.<fqn>.<entry>``, ``param_groups.<fqn>.<setting>``), so ranks that
    hold different parameters (pipeline stages) write disjoint keys, and a
    checkpoint restores into any split of the model; param groups by index
    (``param_groups.0.params``) would differ from stage to stage.

    Works for plain / DDP modules and FSDP2 (``fully_shard``) modules, whose
    entries are DTensors. ``extra_state`` (name -> object with ``state_dict()``,
    e.g. an LR scheduler, replicated on every rank) adds
    ``"extra_state": {name: obj.state_dict()}``. Pass the result to
    ``Checkpointer.save`` (it may be extended with more entries) or restore it
    with :func:`restore_model`.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    sd: dict[str, Any]
    if optimizer is None:
        sd = {"model": get_model_state_dict(model)}
    else:
        msd, osd = get_state_dict(model, optimizer, options=_FLAT_OPTIMIZER)
        sd = {"model": msd, "optim": osd}
    if extra_state:
        sd["extra_state"] = {name: obj.state_dict() for name, obj in extra_state.items()}
    return sd


def apply_model_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                           sd: dict[str, Any], unsaved: dict[str, Any] | None = None) -> None:
    """Inverse of :func:`model_state_dict`: push loaded values into the module and optimizer.

    The model's entries must be complete (strict). `unsaved`: the optimizer
    entries `restore` found no saved state for (``state.<fqn>.*``, never
    stepped when saved); those parameters end up without state, exactly as
    the saved optimizer was (torch's loader of the flattened form needs
    every parameter's entries, so they are passed in and taken out after).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    set_model_state_dict(model, sd["model"])
    if optimizer is None:
        return
    set_optimizer_state_dict(model, optimizer, {**sd["optim"], **(unsaved or {})},
                             options=StateDictOptions(strict=False,
                                                      flatten_optimizer_state_dict=True))
    stateless = {k[len("state."):].rsplit(".", 1)[0] for k in unsaved or {}}
    for name, param in model.named_parameters():
        if stateless & compat.state_dict_names(model, name):
            optimizer.state.pop(param, None)


def detached_copy(tree: Any) -> Any:
    """A copy of a (nested) state dict whose tensors share no memory with the original.

    Plain tensors are copied to host memory (the values are copied to their
    device when applied); DTensors are cloned where they live (their mesh
    fixes the device), costing device memory of one local shard each.
    """
    if isinstance(tree, dict):
        return {k: detached_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [detached_copy(v) for v in tree]
    if isinstance(tree, DTensor):
        return tree.detach().clone()
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    return copy.deepcopy(tree)


def restore_model(
    base_uri: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra_state: dict[str, Any] | None = None,
    **kwargs: Any,
) -> RestoreResult:
    """:func:`restore` into ``model`` (and ``optimizer``), at the current world size and sharding.

    All or nothing: the checkpoint is loaded into copies of the current state
    (one extra copy of the rank's share while it runs: host memory for plain
    tensors, device memory for DTensor shards) and applied only once
    every entry was read, so a restore that fails (damaged files, a checkpoint
    that does not match the model, a read error) leaves the model and the
    optimizer as they were. Parameters that had no optimizer state when saved
    (never stepped) are restored without state. ``extra_state`` (name -> object
    with ``state_dict()`` / ``load_state_dict()``, e.g. an LR scheduler) is
    restored from the entries :func:`model_state_dict` saved under
    ``extra_state.<name>``; a checkpoint without them raises
    :class:`CheckpointMismatch`.
    """
    # torch's get_state_dict gives a fresh optimizer state by a zero-lr step;
    # a failed restore takes that back too
    pristine = copy.deepcopy(optimizer.state_dict()) if optimizer is not None and not optimizer.state else None
    try:
        staged = detached_copy(model_state_dict(model, optimizer, extra_state=extra_state))
        unsaved: dict[str, Any] = {}
        result = restore(base_uri, staged, optimizer_state_as_saved=True, unsaved=unsaved, **kwargs)
    except BaseException:  # DCP raises CheckpointException, a BaseException
        if pristine is not None and optimizer is not None:
            optimizer.load_state_dict(pristine)
        raise
    apply_model_state_dict(model, optimizer, staged, unsaved)
    for name, obj in (extra_state or {}).items():
        obj.load_state_dict(staged["extra_state"][name])
    return result


