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

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from springback.storage import catalog
from springback.storage.commit import load_record
from springback.storage.errors import CheckpointNotFound, CorruptCheckpoint
from springback.storage.manifest import Manifest
from springback.storage.store import Store

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


def storage_reader(ckpt_uri: str, *, store: Store | None = None, storage_options: dict[str, Any] | None = None) -> Any:
    """A DCP ``StorageReader`` for ``ckpt_uri`` (``FileSystemReader`` for local paths, else ``FsspecReader``)."""
    s = store or Store(ckpt_uri, storage_options=storage_options)
    if s.is_local:
        return dcp.FileSystemReader(s.fs._strip_protocol(ckpt_uri))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(ckpt_uri, **s.storage_options)


def load(
    ckpt_uri: str,
    state_dict: dict[str, Any],
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
    store: Store | None = None,
) -> Manifest:
    """Load one committed checkpoint into ``state_dict`` in place (no verification, no fallback).

    Raises :class:`CheckpointNotFound` if it is not committed; DCP errors (missing
    keys, shape mismatch) propagate.
    """
    s = store or Store(ckpt_uri, storage_options=storage_options)
    manifest = catalog.read_manifest(ckpt_uri, store=s)
    dcp.load(state_dict, storage_reader=storage_reader(ckpt_uri, store=s), process_group=process_group)
    return manifest


def _agreed_problems(ckpt_uri: str, store: Store, rank: int, world: int, distributed: bool, pg: Any) -> list[str]:
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
    store: Store | None = None,
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
    candidate is bad.
    """
    s = store or Store(base_uri, storage_options=storage_options)
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
        manifest = load(uri, state_dict, process_group=process_group, store=s)
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


def model_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` via ``torch.distributed.checkpoint.state_dict.get_state_dict``.

    Works for plain / DDP modules and FSDP2 (``fully_shard``) modules, whose
    entries are DTensors. Pass the result to ``Checkpointer.save`` (it may be
    extended with more entries) or to :func:`restore` followed by
    :func:`apply_model_state_dict`.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def apply_model_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, sd: dict[str, Any]) -> None:
    """Inverse of :func:`model_state_dict`: push loaded values into the module and optimizer."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if optimizer is None:
        set_model_state_dict(model, sd["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def restore_model(
    base_uri: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    **kwargs: Any,
) -> RestoreResult:
    """:func:`restore` into ``model`` (and ``optimizer``), at the current world size and sharding."""
    sd = model_state_dict(model, optimizer)
    result = restore(base_uri, sd, **kwargs)
    apply_model_state_dict(model, optimizer, sd)
    return result


