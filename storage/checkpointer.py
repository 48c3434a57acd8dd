"""Asynchronous sharded checkpointing, one :class:`Checkpointer` per rank.

The rank's share of the state is copied into reusable host buffers
(:mod:`springback.storage.snapshot`) on one background thread per rank;
serialization, upload and the commit run on another
(:mod:`springback.storage.commit`), at a lower CPU priority (`WRITER_NICE`):
the copy is what the next optimizer step may wait for, the write is not, and
on a machine whose cores the step loop keeps busy the write then takes the
cycles training leaves, instead of slowing the steps while it runs
(bench/checkpoint_stall.py's total cost). ``save(..., urgent=True)`` (a drain
or final checkpoint, which the caller waits for) writes on the copy thread, at
the normal priority. When to copy:

- ``save(..., optimizer=opt)``: the parameters and optimizer state of ``opt``
  are copied on the background thread, overlapping the next forward/backward.
  They change only in ``opt.step()``, so a step pre-hook that the checkpointer
  registers on ``opt`` waits for that copy before the step runs. Everything else
  in the state dict (buffers, objects, tensors of other optimizers) is copied
  inside ``save()``. The stall is ``save()`` plus the wait in the hook
  (``stats.last_stall_s + stats.last_hook_wait_s``). Code that mutates the
  parameters outside ``opt.step()`` must call :meth:`Checkpointer.wait_snapshot`
  first.
- without ``optimizer``: ``save()`` copies everything before it returns.

Either way the checkpoint holds exactly the state at the time of ``save()``. No collective is used, so a dead peer never
hangs a save: the committing rank gives up after ``commit_timeout_s`` and the
checkpoint stays partial.

Overlap policy -- at most one checkpoint in flight per rank, so host memory is
bounded by one copy of the rank's share:

- ``policy="block"`` (default): a ``save()`` that finds the previous one still
  running first waits for it (the wait counts as stall, see ``stats``). Every
  rank therefore writes every requested step, which keeps ranks consistent.
- ``policy="skip"``: such a ``save()`` returns ``None`` at once and counts
  ``stats.skipped``. Ranks may then disagree about which steps they wrote; a step
  that some rank skipped never commits (its partial directory is cleaned later).

Failure semantics: a background failure (storage error after retries, commit
timeout, a failing commit callback) never raises into the training loop. It is
logged, counted (``stats.failed``, ``stats.last_error``), passed to ``on_error``
(the training library reports it to the coordinator as the job's checkpoint
error), and leaves the previous committed checkpoint valid. ``wait()`` re-raises
it for callers that want it (e.g. a drain checkpoint). A checkpoint that ends
this way after :meth:`Checkpointer.abandon` (the generation that asked for it
broke, so a peer's shard may never come) is counted as ``stats.abandoned``,
logged as a warning and not passed to ``on_error``: it was never going to
commit, and the previous committed checkpoint stays the one to restore.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from springback.storage.commit import DoneRecord, commit, wait_for_records, write_shard
from springback.storage.manifest import ManifestCursor, Manifest, checkpoint_dir_name
from springback.storage.retry import RetryPolicy
from springback.storage.snapshot import PlainHolders, ShardSnapshot, StagingArea, storage_keys
from springback.storage.store import ObjectStore, join

log = logging.getLogger(__name__)

SavePolicy = Literal["block", "skip"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommitInfo:
    """A checkpoint that was just committed on storage (manifest written)."""

    uri: str
    manifest: Manifest

    def to_checkpoint_ref(self) -> Any:
        """As a ``springback.v1.CheckpointRef`` for the CommitCheckpoint RPC."""
        from springback.v1 import types_pb2

        m = self.manifest
        return types_pb2.CheckpointRef(
            step=m.step,
            uri=self.uri,
            generation=m.generation,
            world_size=m.world_size,
            size_bytes=m.size_bytes,
            cursor=types_pb2.DataCursor(epoch=m.cursor.epoch, offset=m.cursor.offset),
        )


@dataclasses.dataclass
class CheckpointerStats:
    saves: int = 0
    """save() calls that started a checkpoint."""
    committed: int = 0
    """Checkpoints this rank committed (rank 0 only)."""
    failed: int = 0
    abandoned: int = 0
    """Checkpoints that did not commit after :meth:`Checkpointer.abandon` (their
    generation ended first): expected partials, not failures."""
    skipped: int = 0
    last_stall_s: float = 0.0
    """Time the last save() blocked the caller (waiting for the previous + snapshot)."""
    last_hook_wait_s: float = 0.0
    """Time the optimizer step after the last save() waited for its deferred copy."""
    total_stall_s: float = 0.0
    """Every save's stall and hook wait, summed (badput by cause)."""
    last_snapshot_s: float = 0.0
    last_upload_s: float = 0.0
    last_error: str = ""


def _default_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _as_cursor(cursor: ManifestCursor | tuple[int, int] | dict[str, int] | None) -> ManifestCursor:
    if cursor is None:
        return ManifestCursor()
    if isinstance(cursor, ManifestCursor):
        return cursor
    if isinstance(cursor, dict):
        return ManifestCursor(**cursor)
    return ManifestCursor(epoch=int(cursor[0]), offset=int(cursor[1]))


WRITER_NICE = 10
"""How much lower (Linux nice increments) the writer thread runs than the
training loop. At 10 a busy step loop keeps about nine tenths of the cores it
competes for; the write still progresses on a saturated machine (the next
periodic save skips while it runs, a drain save writes at full priority)."""


def _lower_priority() -> None:
    """The writer thread's initializer: lowers its own priority by `WRITER_NICE`
    (Linux: nice is per thread). Elsewhere, or when refused, it keeps the
    caller's priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       os.getpriority(os.PRIO_PROCESS, 0) + WRITER_NICE)
    except (AttributeError, OSError) as e:
        log.debug("checkpoint writer keeps the normal priority: %s", e)


def capture_rng() -> dict[str, torch.Tensor]:
    """This process's torch RNG states (CPU, and CUDA when available)."""
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


class Checkpointer:
    """Writes this rank's shard of each checkpoint in the background; rank 0 commits.

    Args:
        base_uri: where checkpoints go; each one is ``<base_uri>/step-<step>-g<gen>``.
        rank, world_size: this rank in the *generation*; default from
            torch.distributed, else ``RANK`` / ``WORLD_SIZE``.
        storage_options: fsspec options (s3 endpoint, credentials); see store.py.
        commit_timeout_s: how long rank 0 waits for all ranks' shards to become
            durable before giving up on a checkpoint (it stays partial).
        policy: ``"block"`` or ``"skip"`` when a save is due while one is in flight.
        save_rng: store each rank's torch RNG state with its shard.
        on_commit: called on rank 0's background thread after the manifest is
            written; the training library sends CommitCheckpoint from it. An
            exception from it counts as a failed checkpoint (files stay on storage).
        on_error: called with the exception of any failed background save.
        Retention is not decided here: in a job the coordinator's record says
        what to keep and :func:`~springback.storage.catalog.prune_to_record`
        deletes the rest.
    """

    def __init__(
        self,
        base_uri: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        commit_timeout_s: float = 600.0,
        poll_interval_s: float = 0.2,
        policy: SavePolicy = "block",
        save_rng: bool = True,
        on_commit: Callable[[CommitInfo], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        store: ObjectStore | None = None,
    ) -> None:
        if policy not in ("block", "skip"):
            raise ValueError(f"policy must be 'block' or 'skip', got {policy!r}")
        if commit_timeout_s <= 0:
            raise ValueError(f"commit_timeout_s must be > 0, got {commit_timeout_s}")
        d_rank, d_world = _default_rank_world()
        self.rank = d_rank if rank is None else rank
        self.world_size = d_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        self.base_uri = base_uri.rstrip("/")
        self.store = store or ObjectStore(base_uri, storage_options=storage_options, retry=retry)
        self.commit_timeout_s = commit_timeout_s
        self.poll_interval_s = poll_interval_s
        self.policy = policy
        self.save_rng = save_rng
        self.on_commit = on_commit
        self.on_error = on_error
        self.stats = CheckpointerStats()
        self._staging = StagingArea()
        # the copy (and urgent writes) at the caller's priority; periodic writes below it
        self._copier = cf.ThreadPoolExecutor(max_workers=1,
                                             thread_name_prefix=f"springback-copy-r{self.rank}")
        self._executor = cf.ThreadPoolExecutor(max_workers=1, initializer=_lower_priority,
                                               thread_name_prefix=f"springback-ckpt-r{self.rank}")
        self._inflight: cf.Future[CommitInfo | DoneRecord] | None = None
        self._copying: ShardSnapshot | None = None  # the snapshot whose deferred copy the hooks wait for
        self._hooks: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()  # step pre-hooks
        self._last: tuple[int, int] | None = None  # (generation, step) of the last save started
        self._abandoned = threading.Event()  # see abandon()
        self._lock = threading.Lock()

    @property
    def staging_bytes(self) -> int:
        """Host memory held by the staging buffers."""
        return self._staging.num_bytes

    def in_flight(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    def save(
        self,
        step: int,
        state_dict: dict[str, Any],
        *,
        generation: int,
        cursor: ManifestCursor | tuple[int, int] | dict[str, int] | None = None,
        layout: dict[str, int] | None = None,
        extra: dict[str, Any] | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        urgent: bool = False,
        holders: PlainHolders | None = None,
    ) -> cf.Future[CommitInfo | DoneRecord] | None:
        """Snapshot this rank's share of ``state_dict`` and write it in the background.

        With ``optimizer`` (one or several), the copy of its parameters and state
        is deferred to the background thread and its next ``step()`` waits for it
        (see the module docstring); without, everything is copied before returning.

        Every rank of the generation must call it for the same ``step`` and
        ``generation``, with the same keys/shapes for non-DTensor entries. Returns
        a future (rank 0: :class:`CommitInfo`; others: their done-record) or
        ``None`` when skipped. ``cursor``, ``layout`` and ``extra`` (JSON-able) go
        into the manifest from rank 0. ``urgent`` (the caller will wait for it)
        writes at the normal CPU priority. ``holders``: which ranks hold each
        non-DTensor entry, when not every rank holds every one (pipeline
        stages; see `snapshot.PlainHolders`). Saving the step of the previous save again
        (e.g. a drain checkpoint right after a periodic one) returns the previous
        future instead of rewriting files a committer may be reading. Raises
        ``ValueError`` for a step lower than the previous one in the same
        generation, or state that cannot be snapshotted; storage failures surface
        through the future.
        """
        t0 = time.perf_counter()
        with self._lock:
            if self._last is not None and self._last[0] == generation:
                if step == self._last[1]:
                    return self._inflight
                if step < self._last[1]:
                    raise ValueError(f"step {step} is lower than the previous checkpoint's step {self._last[1]} in generation {generation}")
            if self.in_flight():
                if self.policy == "skip":
                    self.stats.skipped += 1
                    log.warning("checkpoint of step %d skipped: the previous one is still in flight", step)
                    return None
                cf.wait([self._inflight])  # type: ignore[list-item]
            t1 = time.perf_counter()
            defer = self._hook_optimizers(optimizer)
            snap = self._staging.snapshot(state_dict, rank=self.rank, world_size=self.world_size,
                                          defer=defer, holders=holders)
            rng = capture_rng() if self.save_rng else None
            t2 = time.perf_counter()
            self._copying = snap if snap.pending else None
            self.stats.last_hook_wait_s = 0.0
            self.stats.saves += 1
            self._last = (generation, step)
            self.stats.last_snapshot_s = t2 - t1
            self.stats.last_stall_s = t2 - t0
            self.stats.total_stall_s += t2 - t0
            ckpt_uri = join(self.base_uri, checkpoint_dir_name(step, generation))
            args = (ckpt_uri, snap, rng, step, generation, _as_cursor(cursor), dict(layout or {}), extra)
            if urgent:
                self._inflight = self._copier.submit(self._write, None, *args)
            else:
                copy = self._copier.submit(snap.copy_pending) if snap.pending else None
                self._inflight = self._executor.submit(self._write, copy, *args)
            return self._inflight

    def _hook_optimizers(
        self, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
    ) -> frozenset[int]:
        """Makes each optimizer's next ``step()`` wait for the deferred copy (a
        step pre-hook, registered once per optimizer); returns the storage keys
        of their parameters and state, whose copy is deferred."""
        if optimizer is None:
            return frozenset()
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        for opt in optimizers:
            if opt not in self._hooks:
                self._hooks[opt] = opt.register_step_pre_hook(self._before_step)
        return storage_keys(optimizers) if optimizers else frozenset()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook: the state may change now, so the deferred copy must be done."""
        t0 = time.perf_counter()
        self.wait_snapshot()
        waited = time.perf_counter() - t0
        self.stats.last_hook_wait_s += waited
        self.stats.total_stall_s += waited

    def wait_snapshot(self) -> None:
        """Block until the state passed to the last ``save()`` is in host memory.

        Optimizer steps call it through their pre-hook; call it yourself before
        changing parameters or optimizer state in any other way. Returns at once
        when there is nothing pending (a failed copy fails the checkpoint instead).
        """
        snap = self._copying
        if snap is not None:
            snap.wait_copied()
            self._copying = None

    def _write(
        self,
        copy: cf.Future[None] | None,
        ckpt_uri: str,
        snap: ShardSnapshot,
        rng: dict[str, torch.Tensor] | None,
        step: int,
        generation: int,
        cursor: ManifestCursor,
        layout: dict[str, int],
        extra: dict[str, Any] | None,
    ) -> CommitInfo | DoneRecord:
        try:
            if copy is None:
                snap.copy_pending()
            else:
                copy.result()  # the copy thread's; its failure is this checkpoint's
            t0 = time.perf_counter()
            record = write_shard(
                self.store, ckpt_uri, snap, rank=self.rank, world_size=self.world_size,
                step=step, generation=generation, rng=rng,
            )
            self.stats.last_upload_s = time.perf_counter() - t0
            if self.rank != 0:
                return record
            records = wait_for_records(
                self.store, ckpt_uri, self.world_size, timeout_s=self.commit_timeout_s,
                poll_interval_s=self.poll_interval_s,
            )
            manifest = commit(
                self.store, ckpt_uri, records, step=step, generation=generation,
                cursor=cursor, layout=layout, extra=extra,
            )
            info = CommitInfo(uri=ckpt_uri, manifest=manifest)
            log.info("committed checkpoint %s (%d bytes)", ckpt_uri, manifest.size_bytes)
            if self.on_commit is not None:
                self.on_commit(info)
            self.stats.committed += 1
            return info
        except BaseException as exc:
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            if self._abandoned.is_set():
                self.stats.abandoned += 1
                log.warning("checkpoint %s abandoned on rank %d: its generation ended before it "
                            "committed (%s)", ckpt_uri, self.rank, self.stats.last_error)
                raise
            self.stats.failed += 1
            log.error("checkpoint %s failed on rank %d: %s", ckpt_uri, self.rank, self.stats.last_error)
            if self.on_error is not None:
                try:
                    self.on_error(exc)
                except Exception:  # noqa: BLE001 - a broken error hook must not hide the error
                    log.exception("on_error hook failed")
            raise

    def abandon(self) -> None:
        """The generation that asked for the in-flight checkpoint has ended
        without a clean boundary: its upload and commit go on in the background,
        but if they fail (a dead peer's shard never comes, cleanup deletes the
        partial directory) that is the expected end of a partial checkpoint,
        counted in ``stats.abandoned`` instead of ``stats.failed`` and not passed
        to ``on_error``. One that still commits is committed as usual. Lasts
        for the rest of this checkpointer's life."""
        self._abandoned.set()

    def wait(self, timeout_s: float | None = None) -> CommitInfo | DoneRecord | None:
        """Wait for the in-flight checkpoint (if any) and return its result.

        Re-raises the background error; raises ``TimeoutError`` after ``timeout_s``
        (the save keeps running). Use it before exiting, e.g. after a drain save.
        """
        fut = self._inflight
        if fut is None:
            return None
        return fut.result(timeout=timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the in-flight checkpoint (errors are logged, not raised), then stop the thread."""
        try:
            self.wait(timeout_s)
        except Exception:  # noqa: BLE001 - already counted and logged by _write
            pass
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()
        self._executor.shutdown(wait=False)
        self._copier.shutdown(wait=False)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
