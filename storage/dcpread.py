"""Reading a DCP checkpoint through a store that fails now and then.

Two pieces, used by `springback.storage.restore`:

* DCP readers (`FileReader`, `S3Reader`: torch's ``FileSystemReader`` and
  ``FsspecReader``) that classify their own read errors *on the rank that met
  them*: a transient one (a reset, refused or closed connection, a 5xx, a
  truncated body; see `springback.storage.retry`) is raised as
  `TransientReadError` from it. DCP gathers every rank's failure into one
  ``CheckpointException`` by pickling it, and a pickled exception loses its
  ``__cause__`` chain -- s3fs's ``OSError(EIO)`` for a 503 would arrive on the
  other ranks as a bare OSError, a permanent error. The readers also serve the
  checkpoint's ``Metadata`` once `read_metadata` read it (`prime`), so DCP
  does not read it again: DCP's own read unpickles ``.metadata`` freely and
  turns any error into a bare ``AssertionError``.
* `collective_retry`: run one whole unit (reading the metadata, a whole
  ``dcp.load``) on every rank, and agree after each try, with one
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


class _Classifying:
    """Mixin over a DCP ``StorageReader``: transient read errors become
    `TransientReadError`; `prime` fixes the metadata DCP is served."""

    _sb_uri: str = ""
    _sb_metadata: Any = None

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
        def read() -> Any:
            fut = super(_Classifying, self).read_data(plan, planner)  # type: ignore[misc]
            fut.wait()  # the readers finish synchronously; an error surfaces here, on this rank
            return fut

        return _classified(self._sb_uri, "reading", read)


class FileReader(_Classifying, dcp.FileSystemReader):
    """``FileSystemReader`` that classifies its errors (see the module docstring)."""

    def __init__(self, path: str, *, uri: str) -> None:
        super().__init__(path)
        self._sb_uri = uri


class S3Reader(_Classifying, compat.FsspecReader):
    """``FsspecReader`` that classifies its errors (see the module docstring)."""

    def __init__(self, uri: str, **storage_options: Any) -> None:
        super().__init__(uri, **storage_options)
        self._sb_uri = uri


def reader_for(ckpt_uri: str, store: ObjectStore) -> FileReader | S3Reader:
    """The classifying DCP reader for ``ckpt_uri`` on ``store``."""
    if store.is_local:
        return FileReader(compat.strip_protocol(store.fs, ckpt_uri), uri=ckpt_uri)
    return S3Reader(ckpt_uri, **store.storage_options)


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
    Counts ``store.stats`` retries and give-ups on the group's rank 0 only.
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
            store.stats._add(retries=1)
        log.warning("transient error %s %s (attempt %d), trying it again: %s", what, uri, attempt, first)
        time.sleep(min(policy.max_backoff_s, backoff))
        backoff = max(backoff * 2, 1e-3)
