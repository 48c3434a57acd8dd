"""Checkpoints for restart mode: a torchrun script resumes from its newest commit.

In restart mode (`springback run --mode restart`) every generation starts the
script's ranks afresh, so its state comes from storage. This helper is the
small part such a script adds (it works the same under plain ``torchrun``)::

    from springback.storage.resume import RestartCheckpoints

    ckpt = RestartCheckpoints("file:///tmp/ckpt", every_steps=20)  # or $SPRINGBACK_CHECKPOINT_URI
    start = ckpt.restore(model, optimizer)     # collective; 0 when nothing is committed
    for step in range(start + 1, total_steps + 1):
        ...                                    # forward, backward, optimizer.step()
        ckpt.step_done(step, model, optimizer, loss=loss.item())   # saves every 20th step
    ckpt.close()                               # waits for the last checkpoint's commit

Checkpoints are `springback.storage`'s own (DCP shards, a manifest with
checksums written last): a restore takes the newest *intact* committed one
and any world size can read it.

Progress reaches the coordinator through the node agent: under `springback
run`, global rank 0 writes `PROGRESS_FILE` (atomic rename) in the control
directory after every step and commit; the agent relays the step as
ReportStep and each commit as CommitCheckpoint, fenced by its generation
(`springback.worker.agent.restart`). So ``job get`` shows the script's step and
last checkpoint, the job succeeds when the step reaches the spec's
``max_steps``, and the coordinator can count the steps a restart redid (last
reported step minus the restored one). Outside an agent nothing is reported.

Failure semantics: `restore` and `save` are collectives (every rank calls
them). A rank killed mid-save leaves a partial checkpoint that is never
restored (no manifest) and is cleaned up by a later commit. A storage failure
of a save is logged and training goes on; `close` waits for the last one
and raises what its write raised.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from dataclasses import asdict, dataclass
from typing import Any

import torch

from springback.client import env as E
from springback.storage.checkpointer import Checkpointer, CommitInfo
from springback.storage.errors import CheckpointNotFound
from springback.storage.restoring import model_state_dict, restore_model

log = logging.getLogger(__name__)

PROGRESS_FILE = "progress.json"
CLOSE_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class Progress:
    """What global rank 0 tells its agent: the newest step and commit."""

    generation: int
    """Generation the ranks were started in (the agent drops older ones)."""
    step: int
    """Last step the script finished."""
    loss: float = math.nan
    checkpoint: dict[str, Any] | None = None
    """The newest commit: step, uri, world_size, size_bytes, epoch, offset."""
    restored_step: int = 0
    """The step `restore` loaded in this generation (0: none)."""
    restored_checkpoint: dict[str, Any] | None = None
    """The commit `restore` loaded (same keys as `checkpoint`): the agent
    records it in this generation when the coordinator does not hold it yet,
    e.g. a drain checkpoint written after the generation that wrote it ended."""


def write_progress(directory: str, progress: Progress) -> None:
    """Replaces `PROGRESS_FILE` in `directory` atomically (never a torn file)."""
    path = os.path.join(directory, PROGRESS_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(asdict(progress), f)
    os.replace(tmp, path)


def read_progress(directory: str) -> Progress | None:
    """The last progress written in `directory`; None when there is none."""
    try:
        with open(os.path.join(directory, PROGRESS_FILE), encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        return None
    return Progress(**raw)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def current_generation() -> int:
    """The agent's generation, else torchrun's restart count + 1, else 1: a
    restarted run never writes into the directories of an earlier attempt."""
    if os.environ.get(E.GENERATION):
        return int(os.environ[E.GENERATION])
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1


class RestartCheckpoints:
    """One rank's checkpoints of a restart-mode script; see the module docstring.

    `uri` defaults to $SPRINGBACK_CHECKPOINT_URI (ValueError naming both when
    neither is set). `every_steps` (0: only explicit `save` calls) as in the
    job spec; retention is the coordinator's (`checkpoint.keep_last`): the
    agent relaying a commit deletes what the record no longer holds. Create
    it after ``init_process_group``."""

    def __init__(self, uri: str | None = None, *, every_steps: int = 0,
                 storage_options: dict[str, Any] | None = None) -> None:
        uri = uri or os.environ.get(E.CHECKPOINT_URI, "")
        if not uri:
            raise ValueError(f"RestartCheckpoints: pass uri= or set ${E.CHECKPOINT_URI} "
                             "(the agent sets it from the job spec's checkpoint.uri)")
        if every_steps < 0:
            raise ValueError(f"RestartCheckpoints: every_steps must be >= 0, got {every_steps}")
        self.uri = uri
        self.every_steps = every_steps
        self.rank, self.world_size = _rank_world()
        self.generation = current_generation()
        self._storage_options = storage_options
        self._control_dir = os.environ.get(E.CONTROL_DIR, "") if self.rank == 0 else ""
        self._progress = Progress(generation=self.generation, step=0)
        self._lock = threading.Lock()  # the commit thread reports too
        self._ckpt = Checkpointer(uri, rank=self.rank, world_size=self.world_size,
                                  storage_options=storage_options,
                                  on_commit=self._on_commit if self.rank == 0 else None,
                                  on_error=self._on_error)
        self.restored_step = 0

    def restore(self, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer | None = None, *,
                extra_state: dict[str, Any] | None = None) -> int:
        """Loads the newest intact commit (at most $SPRINGBACK_RESTORE_MAX_STEP
        when the agent set it) into `model` (and `optimizer`, and the objects
        of `extra_state`, e.g. an LR scheduler, saved by `save` with the same
        names) and returns its step; 0 (state untouched) when nothing is
        committed. Collective; raises `CorruptCheckpoint` when every candidate
        is damaged, `CheckpointMismatch` when it lacks an `extra_state` entry."""
        max_step = int(os.environ[E.RESTORE_MAX_STEP]) if os.environ.get(
            E.RESTORE_MAX_STEP) else None
        try:
            result = restore_model(self.uri, model, optimizer, extra_state=extra_state,
                                   max_step=max_step, storage_options=self._storage_options)
        except CheckpointNotFound:
            log.info("no committed checkpoint under %s: starting at step 0", self.uri)
            return 0
        self.restored_step = result.step
        log.info("rank %d restored step %d from %s", self.rank, result.step, result.uri)
        m = result.manifest
        self._report(step=result.step, restored_step=result.step, restored_checkpoint={
            "step": m.step, "uri": result.uri, "world_size": m.world_size,
            "size_bytes": m.size_bytes, "epoch": m.cursor.epoch, "offset": m.cursor.offset})
        return result.step

    def step_done(self, step: int, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None = None, *,
                  loss: float = math.nan, extra_state: dict[str, Any] | None = None) -> None:
        """Records `step` as finished (rank 0 reports it) and saves when it is
        a multiple of `every_steps`. Collective when a save is due."""
        self.report(step, loss=loss)
        if self.every_steps and step % self.every_steps == 0:
            self.save(step, model, optimizer, extra_state=extra_state)

    def report(self, step: int, *, loss: float = math.nan) -> None:
        """Records `step` (and its loss) as finished without saving: global
        rank 0 writes it for the agent to relay; other ranks do nothing.
        Never blocks on the network."""
        self._report(step=step, loss=float(loss))

    def save(self, step: int, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer | None = None, *, wait: bool = False,
             extra_state: dict[str, Any] | None = None) -> None:
        """Checkpoints `step` in the background (collective). With `optimizer`
        its next ``step()`` waits for the copy of the state to host memory.
        `extra_state` (name -> object with ``state_dict()``, the same on every
        rank, e.g. an LR scheduler) is saved beside the model. `wait`: returns
        once the commit is written (TimeoutError after `CLOSE_TIMEOUT_S`)."""
        self._ckpt.save(step, model_state_dict(model, optimizer, extra_state=extra_state),
                        generation=self.generation, layout={"dp": self.world_size},
                        optimizer=optimizer)
        if wait:
            self._ckpt.wait(CLOSE_TIMEOUT_S)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Waits up to `timeout_s` for the in-flight checkpoint (its commit
        included); raises what its background write raised, or TimeoutError."""
        try:
            self._ckpt.wait(timeout_s)
        finally:
            self._ckpt.close(0.0)

    def _report(self, **changes: Any) -> None:
        if not self._control_dir:
            return
        with self._lock:
            current = asdict(self._progress)
            current.update(changes)
            self._progress = Progress(**current)
            write_progress(self._control_dir, self._progress)

    def _on_commit(self, info: CommitInfo) -> None:
        m = info.manifest
        log.info("checkpoint of step %d committed: %s", m.step, info.uri)
        self._report(checkpoint={"step": m.step, "uri": info.uri, "world_size": m.world_size,
                                 "size_bytes": m.size_bytes, "epoch": m.cursor.epoch,
                                 "offset": m.cursor.offset})

    def _on_error(self, error: BaseException) -> None:
        log.error("checkpoint failed on rank %d: %s", self.rank, error)
