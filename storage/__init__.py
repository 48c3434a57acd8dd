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
``restore.py``; ``springback ckpt`` is in the CLI package (``cli/checkpoints.py``).
"""

from __future__ import annotations

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
from springback.storage.restore import (
    RestoreResult,
    apply_model_state_dict,
    load,
    model_state_dict,
    restore,
    restore_model,
)
from springback.storage.resume import RestartCheckpoints  # noqa: F401 (restart mode's helper)
from springback.storage.retry import RetryPolicy
from springback.storage.store import ObjectStore

__all__ = [
    "CheckpointExists",
    "CheckpointInfo",
    "CheckpointMismatch",
    "CheckpointNotFound",
    "Checkpointer",
    "CheckpointerStats",
    "CommitInfo",
    "CommitTimeout",
    "CorruptCheckpoint",
    "ManifestCursor",
    "FileEntry",
    "Manifest",
    "RestoreResult",
    "RetryPolicy",
    "StorageError",
    "ObjectStore",
    "TransientStorageError",
    "apply_model_state_dict",
    "clean_partial",
    "committed_checkpoints",
    "delete_checkpoint",
    "job_checkpoint_uri",
    "list_checkpoints",
    "load",
    "model_state_dict",
    "prune_to_record",
    "read_manifest",
    "restore",
    "restore_model",
    "verify",
]
