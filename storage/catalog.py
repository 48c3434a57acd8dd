"""Finding, verifying and deleting checkpoints under a base URI.

A base URI holds one directory per checkpoint (``step-<step>-g<generation>``).
In a job the base URI is the job's own directory under the spec's
``checkpoint.uri`` (:func:`job_checkpoint_uri`).
A checkpoint is *committed* when its ``manifest.json`` exists and parses, otherwise
*partial*. Every function here is safe to run concurrently with writers: it never
deletes the newest committed checkpoint, and deletes a partial one only when no
writer can still commit it (see :func:`clean_partial`; the step of an older
generation's commit is no such proof, since a rewind makes steps go back). Deleting a checkpoint
removes its manifest first, so an interrupted delete leaves a partial directory
(cleaned later), never a committed checkpoint with missing shards.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from springback.client.jobdir import job_directory
from springback.storage.errors import CheckpointNotFound, StorageError
from springback.storage.manifest import MANIFEST_NAME, Manifest, crc32_hex, parse_checkpoint_dir_name
from springback.storage.store import ObjectStore, join

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory under a base URI."""

    uri: str
    step: int
    generation: int
    manifest: Manifest | None
    """None for a partial checkpoint (or one whose manifest does not parse)."""
    problem: str = ""

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    @property
    def state(self) -> str:
        return "committed" if self.committed else "partial"


def job_checkpoint_uri(checkpoint_uri: str, job_id: str) -> str:
    """Where a job's checkpoints go: ``<checkpoint_uri>/<job_id>``.

    Jobs are namespaced so that two jobs given the same ``checkpoint.uri`` (the
    same job.yaml submitted twice) never write into each other's directories.
    Raises ``ValueError`` for a job id that is empty or not one path segment,
    or a URI with ``.`` / ``..`` segments (`springback.client.jobdir`).
    """
    return job_directory(checkpoint_uri, job_id)


def _store(uri: str, store: ObjectStore | None, storage_options: dict[str, Any] | None) -> ObjectStore:
    return store if store is not None else ObjectStore(uri, storage_options=storage_options)


def read_manifest(ckpt_uri: str, *, store: ObjectStore | None = None, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Read and parse ``<ckpt_uri>/manifest.json``.

    Raises :class:`CheckpointNotFound` if absent (the checkpoint is partial or gone),
    :class:`StorageError` if it does not parse.
    """
    s = _store(ckpt_uri, store, storage_options)
    uri = join(ckpt_uri, MANIFEST_NAME)
    try:
        data = s.get_bytes(uri)
    except FileNotFoundError as exc:
        raise CheckpointNotFound(f"no committed checkpoint at {ckpt_uri} ({MANIFEST_NAME} missing)", uri=ckpt_uri) from exc
    try:
        return Manifest.from_json(data, uri=uri)
    except ValueError as exc:
        raise StorageError(str(exc), uri=uri) from exc


def list_checkpoints(
    base_uri: str, *, store: ObjectStore | None = None, storage_options: dict[str, Any] | None = None
) -> list[CheckpointInfo]:
    """All checkpoint directories under ``base_uri``, oldest first (by step, then generation)."""
    s = _store(base_uri, store, storage_options)
    out = []
    for name, is_dir in s.list(base_uri):
        parsed = parse_checkpoint_dir_name(name)
        if parsed is None or not is_dir:
            continue
        uri = join(base_uri, name)
        manifest, problem = None, ""
        try:
            manifest = read_manifest(uri, store=s)
        except CheckpointNotFound:
            pass
        except StorageError as exc:
            problem = str(exc)
        out.append(CheckpointInfo(uri=uri, step=parsed[0], generation=parsed[1], manifest=manifest, problem=problem))
    out.sort(key=lambda c: (c.step, c.generation))
    return out


def committed_checkpoints(
    base_uri: str, *, store: ObjectStore | None = None, storage_options: dict[str, Any] | None = None
) -> list[CheckpointInfo]:
    """Committed checkpoints under ``base_uri``, oldest first."""
    return [c for c in list_checkpoints(base_uri, store=store, storage_options=storage_options) if c.committed]


def verify(
    ckpt_uri: str,
    *,
    store: ObjectStore | None = None,
    storage_options: dict[str, Any] | None = None,
    ranks: tuple[int, int] | None = None,
) -> list[str]:
    """Check every file listed in the manifest (existence, size, CRC-32).

    Returns a list of problems, one per bad file, each naming the file's URI; an
    empty list means the checkpoint is intact. A missing manifest is a problem
    too. ``ranks=(i, n)`` checks only files ``j`` with ``j % n == i`` (to split the
    reading across ``n`` restoring ranks). Reads every byte: cost is one full read;
    a transient read error (reset, truncated body) rereads the file within the
    store's retry policy, so only a file that stays unreadable is a problem.
    """
    s = _store(ckpt_uri, store, storage_options)
    try:
        manifest = read_manifest(ckpt_uri, store=s)
    except StorageError as exc:
        return [str(exc)]
    problems = []
    for j, entry in enumerate(manifest.files):
        if ranks is not None and j % ranks[1] != ranks[0]:
            continue
        uri = join(ckpt_uri, entry.path)
        try:
            crc, size = s.checksum(uri)
        except FileNotFoundError:
            problems.append(f"{uri}: missing")
            continue
        except (OSError, StorageError) as exc:
            problems.append(f"{uri}: unreadable: {exc!r}")
            continue
        if size != entry.size_bytes:
            problems.append(f"{uri}: size {size} != {entry.size_bytes} in manifest")
        elif crc32_hex(crc) != entry.crc32:
            problems.append(f"{uri}: crc32 {crc32_hex(crc)} != {entry.crc32} in manifest (corrupt)")
    return problems


def delete_checkpoint(ckpt_uri: str, *, store: ObjectStore | None = None, storage_options: dict[str, Any] | None = None) -> None:
    """Delete one checkpoint: manifest first (it becomes partial), then the rest. Idempotent."""
    s = _store(ckpt_uri, store, storage_options)
    s.rm(join(ckpt_uri, MANIFEST_NAME))
    s.rm_tree(ckpt_uri)


def clean_partial(
    base_uri: str,
    *,
    current_generation: int | None = None,
    store: ObjectStore | None = None,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Delete partial checkpoints that can no longer commit; return their URIs.

    A partial directory of generation ``g`` at step ``s`` is deleted when its
    writers can no longer commit it:

    - a checkpoint of a *newer* generation is committed, or ``current_generation``
      is given and ``g`` is older (generation ``g`` is fenced);
    - a checkpoint of the *same* generation at a higher step is committed (the
      committing rank commits one step after the other, so it gave up on ``s``).

    A commit of an older generation says nothing about a partial of a newer one:
    after a rewind (restore to an older step) the current generation's saves run
    at steps below older commits, and such a save in flight is kept.
    """
    s = _store(base_uri, store, storage_options)
    return _delete_partials(list_checkpoints(base_uri, store=s), current_generation, s)


def _can_never_commit(c: CheckpointInfo, all_ckpts: list[CheckpointInfo], current_generation: int | None) -> bool:
    """The rule of :func:`clean_partial` for one partial checkpoint ``c``."""
    if current_generation is not None and c.generation < current_generation:
        return True
    return any(
        d.committed and (d.generation > c.generation or (d.generation == c.generation and d.step > c.step))
        for d in all_ckpts
    )


def _delete_partials(all_ckpts: list[CheckpointInfo], current_generation: int | None,
                     s: ObjectStore) -> list[str]:
    """`clean_partial` over a listing already made."""
    deleted = []
    for c in all_ckpts:
        if not c.committed and _can_never_commit(c, all_ckpts, current_generation):
            log.info("deleting partial checkpoint %s", c.uri)
            delete_checkpoint(c.uri, store=s)
            deleted.append(c.uri)
    return deleted


def prune_to_record(
    base_uri: str,
    recorded_uris: Iterable[str],
    *,
    current_generation: int,
    store: ObjectStore | None = None,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Make storage converge to the coordinator's record; return what was deleted.

    ``recorded_uris`` are the checkpoints the coordinator still records (matched
    by directory name). Deleted: every other *committed* directory whose step is
    not above the newest recorded one (a retired checkpoint whose delete failed
    earlier, or one completed by a fenced writer: neither can ever be restored),
    and partial directories as :func:`clean_partial` decides. Recorded
    checkpoints and anything newer than the newest recorded one are kept. A
    failing delete raises; what was not deleted is found again next time.
    """
    s = _store(base_uri, store, storage_options)
    recorded = {u.rstrip("/").rsplit("/", 1)[-1] for u in recorded_uris}
    all_ckpts = list_checkpoints(base_uri, store=s)
    newest = max((c.step for c in all_ckpts if _name(c) in recorded), default=-1)
    deleted = []
    for c in all_ckpts:
        if c.committed and _name(c) not in recorded and c.step <= newest:
            log.info("deleting checkpoint %s: not recorded by the coordinator", c.uri)
            delete_checkpoint(c.uri, store=s)
            deleted.append(c.uri)
    remaining = [c for c in all_ckpts if c.uri not in deleted]
    return deleted + _delete_partials(remaining, current_generation, s)


def _name(c: CheckpointInfo) -> str:
    return c.uri.rstrip("/").rsplit("/", 1)[-1]
