"""Asynchronous sharded checkpoints on fsspec storage (file://, s3://, memory://).

Public API for the training library (worker) -- one ``Checkpointer`` per rank::

    from springback.storage import Checkpointer, restore_model, model_state_dict

    base_uri = job_checkpoint_uri(spec.checkpoint.uri, job_id)      # <uri>/<job_id>: one directory per job
    ckpt = Checkpointer(base_uri, rank=rank, world_size=world,      # of the generation
                        storage_options=None,                       # or {"client_kwargs": {"endpoint_url": ...}}
                        on_commit=lambda info: stub.CommitCheckpoint(
                            CommitCheckpointRequest(job_id=..., member_id=..., generation=gen,
                                                    checkpoint=info.to_checkpoint_ref())),
                        on_error=lambda exc: report_checkpoint_error(exc))
    sd = model_state_dict(model, optim)            # DDP or FSDP2; add more entries if needed
    ckpt.save(step, sd, generation=gen, cursor=(epoch, offset), layout={"dp": world},
              optimizer=optim)                     # params + optimizer state are copied in the background;
    ...                                            # optim.step() waits for that copy (a step pre-hook).
                                                   # Without optimizer=, save() returns after the full copy.
    ckpt.wait()                                    # e.g. after a drain checkpoint, before exit

    res = restore_model(base_uri, model, optim, restore_rng=True)   # collective; any world size
    res.manifest.step, res.manifest.cursor                           # resume point
    # or restore(base_uri, state_dict, step=N) / load(ckpt_uri, state_dict) for raw state dicts

    delete_checkpoint(ref.uri)                     # for each CheckpointRef the coordinator retires
    clean_partial(base_uri, current_generation=gen)           # e.g. once per new generation
    prune_to_record(base_uri, [r.uri for r in retained], current_generation=gen)
                                                   # after a commit: storage converges to etcd's record;
                                                   # retention is the coordinator's rule alone (service/core/commits.py)
    verify(ckpt_uri) -> list[str]                  # problems, each naming the bad file

Semantics (commit protocol, failures) are in ``commit.py``, ``checkpointer.py`` and
``restoring.py``; ``springback ckpt`` is in the CLI package (``cli/checkpoints.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each name is imported from its module on first use (PEP 562): the package
# itself imports nothing, so a process that needs only the object store (a
# node agent shipping rank logs: `storage.ranklogs`, `storage.store`) never
# imports torch, which the checkpoint modules do (seconds of CPU per process).
_EXPORTS = {
    # catalog
    "CheckpointInfo": "catalog",
    "clean_partial": "catalog",
    "committed_checkpoints": "catalog",
    "delete_checkpoint": "catalog",
    "job_checkpoint_uri": "catalog",
    "list_checkpoints": "catalog",
    "prune_to_record": "catalog",
    "read_manifest": "catalog",
    "verify": "catalog",
    # checkpointer
    "Checkpointer": "checkpointer",
    "CheckpointerStats": "checkpointer",
    "CommitInfo": "checkpointer",
    # errors
    "CheckpointExists": "errors",
    "CheckpointMismatch": "errors",
    "CheckpointNotFound": "errors",
    "CommitTimeout": "errors",
    "CorruptCheckpoint": "errors",
    "StorageError": "errors",
    "TransientStorageError": "errors",
    # manifest
    "ManifestCursor": "manifest",
    "FileEntry": "manifest",
    "Manifest": "manifest",
    # restoring
    "RestoreResult": "restoring",
    "apply_model_state_dict": "restoring",
    "load": "restoring",
    "model_state_dict": "restoring",
    "restore": "restoring",
    "restore_model": "restoring",
    # resume
    "RestartCheckpoints": "resume",
    # retry
    "RetryPolicy": "retry",
    # store
    "ObjectStore": "store",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from springback.storage.catalog import (
        CheckpointInfo,
        clean_partial,
        committed_checkpoints,
        delete_checkpoint,
        job_checkpoint_uri,
        list_checkpoints,
        prune_to_record,
        read_manifest,
        verify,
    )
    from springback.storage.checkpointer import Checkpointer, CheckpointerStats, CommitInfo
    from springback.storage.errors import (
        CheckpointExists,
        CheckpointMismatch,
        CheckpointNotFound,
        CommitTimeout,
        CorruptCheckpoint,
        StorageError,
        TransientStorageError,
    )
    from springback.storage.manifest import ManifestCursor, FileEntry, Manifest
    from springback.storage.restoring import (
        RestoreResult,
        apply_model_state_dict,
        load,
        model_state_dict,
        restore,
        restore_model,
    )
    from springback.storage.resume import RestartCheckpoints
    from springback.storage.retry import RetryPolicy
    from springback.storage.store import ObjectStore


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'springback.storage' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"springback.storage.{module}"), name)
    globals()[name] = value  # once: later lookups find it here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
