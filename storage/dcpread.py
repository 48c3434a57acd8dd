"""Reading a DCP checkpoint through a store that fails now and then.

Two pieces, used by `springback.storage.restoring`:

* DCP readers (`FileReader`, `S3Reader`: torch's ``FileSystemReader`` and
  ``FsspecReader``) that read through the restore's `ObjectStore`: the items
  of a plan that lie back to back in a file are read by one ranged request
  (`ObjectStore.read_range`, at most `_RUN_BYTES`), and a request that fails
  (a reset, a 503, a body shorter than its range) is retried alone, read
  again from its start, never the whole load. A read whose request spent its
  retry budget is classified *on the rank that met it*: a transient error is
  raised as `TransientReadError` from it. DCP gathers every rank's failure into one
  ``CheckpointException`` by pickling it, and a pickled exception loses its
  ``__cause__`` chain -- s3fs's ``OSError(EIO)`` for a 503 would arrive on the
  other ranks as a bare OSError, a permanent error. The readers also serve the
  checkpoint's ``Metadata`` once `read_metadata` read it (`prime`), so DCP
  does not read it again: DCP's own read unpickles ``.metadata`` freely and
  turns any error into a bare ``AssertionError``.
* `collective_retry`: for what a request's retry cannot fix, run one whole
  unit (reading the metadata, a whole ``dcp.load``) on every rank again
  (counted apart: ``RetryStats.collective_retries``), agreeing after each try, with one
  ``all_gather_object``, whether every rank succeeded, whether to try again
  (every failure transient and every rank within the retry budget) or to fail.
  Every rank takes the same decision, so the retries stay collective and no
  rank waits in a collective that the others left.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec.core
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from springback.storage import compat, safeload
from springback.storage.commit import DCP_METADATA_NAME
from springback.storage.errors import CorruptCheckpoint, StorageError, TransientReadError, TransientStorageError
from springback.storage.retry import is_transient
from springback.storage.store import ObjectStore, join

log = logging.getLogger(__name__)

T = TypeVar("T")


def _classified(uri: str, what: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except Exception as exc:
        if is_transient(exc):
            raise TransientReadError(f"{what} {uri}: {exc!r}", uri=uri) from exc
        raise


_RUN_BYTES = 32 << 20
"""Items that lie back to back in a file are read by one request, up to this
many bytes (a bigger item is one request by itself): many small tensors cost
few requests, and a retry rereads at most this much again."""


class _Classifying(compat.RangeReads):
    """Mixin over a DCP ``StorageReader``: each run of items is read by one
    retried request of the store (`ObjectStore.read_range`); transient read
    errors that still escape become `TransientReadError`; `prime` fixes the
    metadata DCP is served."""

    _sb_uri: str = ""
    _sb_metadata: Any = None
    _sb_store: ObjectStore
    _sb_runs: dict[tuple[str, int, int], tuple[str, int, int]]
    _sb_cached: tuple[tuple[str, int, int], bytes] | None = None

    def _sb_init(self, uri: str, store: ObjectStore) -> None:
        self._sb_uri = uri
        self._sb_store = store
        self._sb_runs = {}
        self.use_range_reads()

    def prime(self, metadata: Any) -> None:
        self._sb_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The primed metadata: DCP's own read would unpickle ``.metadata``
        freely (`read_metadata` below reads it with `safeload`)."""
        if self._sb_metadata is None or args or kwargs:
            raise StorageError(f"the metadata of {self._sb_uri} is read by dcpread.read_metadata, "
                               "then primed; not by DCP", uri=self._sb_uri)
        return self._sb_metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's ``read_data``, with each run of back-to-back items read by one
        request, retried alone (`read_range`). Blocks until every item is read;
        a request whose retry budget ran out fails the read (`TransientReadError`)."""
        self._sb_runs = _runs(self.item_ranges(plan))
        self._sb_cached = None

        def read() -> Any:
            fut = super(_Classifying, self).read_data(plan, planner)  # type: ignore[misc]
            fut.wait()  # the readers finish synchronously; an error surfaces here, on this rank
            return fut

        try:
            return _classified(self._sb_uri, "reading", read)
        finally:
            self._sb_cached = None

    def read_range(self, relative_path: str, offset: int, length: int) -> bytes:
        run = self._sb_runs.get((relative_path, offset, length), (relative_path, offset, length))
        if self._sb_cached is None or self._sb_cached[0] != run:
            path, start, size = run
            self._sb_cached = run, self._sb_store.read_range(join(self._sb_uri, path), start, size)
        start = offset - run[1]
        return self._sb_cached[1][start:start + length]


def _runs(ranges: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], tuple[str, int, int]]:
    """Each item range -> the run (path, offset, length) it is read with:
    consecutive items of one file that lie back to back, up to `_RUN_BYTES`."""
    out: dict[tuple[str, int, int], tuple[str, int, int]] = {}
    group: list[tuple[str, int, int]] = []

    def close() -> None:
        if group:
            run = (group[0][0], group[0][1], group[-1][1] + group[-1][2] - group[0][1])
            out.update(dict.fromkeys(group, run))
            group.clear()

    for r in ranges:
        if group and not (r[0] == group[-1][0] and r[1] == group[-1][1] + group[-1][2]
                          and r[1] + r[2] - group[0][1] <= _RUN_BYTES):
            close()
        group.append(r)
    close()
    return out


class FileReader(_Classifying, dcp.FileSystemReader):
    """``FileSystemReader`` reading through ``store`` (see the module docstring)."""

    def __init__(self, path: str, *, uri: str, store: ObjectStore) -> None:
        super().__init__(path)
        self._sb_init(uri, store)


class S3Reader(_Classifying, compat.FsspecReader):
    """``FsspecReader`` reading through ``store`` (see the module docstring)."""

    def __init__(self, uri: str, *, store: ObjectStore) -> None:
        super().__init__(uri, **store.storage_options)
        self._sb_init(uri, store)


def reader_for(ckpt_uri: str, store: ObjectStore) -> FileReader | S3Reader:
    """The DCP reader for ``ckpt_uri`` on ``store``, reading through it."""
    if store.is_local:
        return FileReader(fsspec.core.strip_protocol(ckpt_uri), uri=ckpt_uri, store=store)
    return S3Reader(ckpt_uri, store=store)


def read_metadata(reader: FileReader | S3Reader, ckpt_uri: str, store: ObjectStore) -> Metadata:
    """The checkpoint's DCP ``Metadata``, read from ``.metadata`` with
    `safeload.loads` (no code runs from storage). A transient read error
    raises `TransientReadError`; a file that is not DCP metadata raises
    `CorruptCheckpoint` naming it."""
    uri = join(ckpt_uri, DCP_METADATA_NAME)
    data = _classified(ckpt_uri, "reading the metadata of", lambda: store.get_bytes(uri))
    try:
        metadata = safeload.loads(data)
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise CorruptCheckpoint(f"unreadable DCP metadata {uri}: {exc}", uri=uri) from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpoint(f"unreadable DCP metadata {uri}: it holds a {type(metadata).__name__}",
                                uri=uri)
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id  # what DCP's own read sets
    return metadata


def _group(process_group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    return 0, 1


def collective_retry(fn: Callable[[], T], *, what: str, uri: str, store: ObjectStore, process_group: Any = None) -> T:
    """Run ``fn`` on every rank until every rank succeeded, retrying it whole.

    Collective when torch.distributed is initialized: every rank of
    ``process_group`` must call it, with the same ``what``. After each try the
    ranks exchange their outcome (one ``all_gather_object``) and all decide
    alike: every rank succeeded -> each returns its result; any rank met a
    permanent error -> every rank raises (its own error, or a `StorageError`
    naming the rank and its error); every failure transient -> all sleep the
    backoff and try again, unless any rank spent the store's `RetryPolicy`
    (attempts or ``deadline_s``, counted from the first try), in which case all
    raise `TransientStorageError` naming ``what`` and ``uri``, chained to the
    last local error. ``fn`` must be idempotent (a retry redoes all of it).
    Counts ``store.stats.collective_retries`` and ``gave_up`` on the group's
    rank 0 only. Each request inside ``fn`` is retried on its own first
    (`ObjectStore`), so this runs again only after a request spent its budget.
    """
    policy = store.retry
    rank, world = _group(process_group)
    start = time.monotonic()
    backoff = policy.initial_backoff_s
    attempt = 0
    while True:
        attempt += 1
        error: BaseException | None = None
        result: T | None = None
        try:
            result = fn()
        except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
            error = exc
        verdict = "ok" if error is None else ("transient" if is_transient(error) else "permanent")
        spent = attempt >= policy.max_attempts or time.monotonic() - start >= policy.deadline_s
        mine = (verdict, spent, "" if error is None else repr(error)[:400])
        outcomes: list[Any] = [mine]
        if world > 1:
            outcomes = [None] * world
            dist.all_gather_object(outcomes, mine, group=process_group)
        if all(v == "ok" for v, _, _ in outcomes):
            return result  # type: ignore[return-value]
        permanent = [(r, msg) for r, (v, _, msg) in enumerate(outcomes) if v == "permanent"]
        if permanent:
            if error is not None and verdict == "permanent":
                raise error
            r, msg = permanent[0]
            raise StorageError(f"{what} {uri} failed on rank {r} of the group: {msg}", uri=uri) from error
        first = next(msg for v, _, msg in outcomes if v != "ok")
        if any(s for _, s, _ in outcomes):
            if rank == 0:
                store.stats._add(gave_up=1)
            raise TransientStorageError(
                f"{what} {uri} failed after {attempt} attempts in {time.monotonic() - start:.1f}s "
                f"(retry budget spent): {first}", uri=uri) from error
        if rank == 0:
            store.stats._add(collective_retries=1)
        log.warning("transient error %s %s (attempt %d), trying it again: %s", what, uri, attempt, first)
        time.sleep(min(policy.max_backoff_s, backoff))
        backoff = max(backoff * 2, 1e-3)
