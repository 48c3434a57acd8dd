"""Writing one rank's shard, and the commit protocol that makes a checkpoint count.

Protocol, for the checkpoint directory ``D`` of one step:

1. Every rank ``r`` claims its slot (``D/_springback/rank-r.claim``, see
   below), writes its DCP shard file ``D/__r_0.distcp`` (skipped when it
   owns nothing), then its *done-record* ``D/_springback/rank-r.pkl``: the file's
   size and CRC-32, its DCP write items and results (its part of the DCP
   metadata), and its RNG state. The done-record is written only after the shard
   is durable, so its presence means "rank r's share is safe".
2. The committing rank (rank 0 of the generation) polls for all ``world_size``
   done-records until a deadline. If one is missing at the deadline it raises
   :class:`~springback.storage.errors.CommitTimeout`: nothing more is written and
   the directory stays *partial*. A dead peer therefore costs one deadline, never a
   hang.
3. It merges the records into DCP ``Metadata`` (checking that the chunks tile every
   tensor exactly), writes ``D/.metadata``, and finally ``D/manifest.json``
   (atomically). Only then is the checkpoint committed.

Crash at any point: before step 3 ends there is no manifest, so readers ignore the
directory and cleanup deletes it; the previous committed checkpoint is untouched.

Create-only: a committed directory is never written again. A writer checks that
the manifest is absent before writing anything, and the done-records,
``.metadata`` and ``manifest.json`` are created with create-only writes
(:meth:`~springback.storage.store.ObjectStore.put_bytes`), so of two writers of one
checkpoint (a duplicate rank, two jobs pointed at one directory) exactly one
commits and the other fails with
:class:`~springback.storage.errors.CheckpointExists` naming the directory. Before
writing its shard, rank ``r`` creates ``D/_springback/rank-r.claim``
(create-only), so a second writer of the same rank fails before it writes a
byte and never touches the winner's shard.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import uuid
import zlib
from collections import ChainMap
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from springback.client.polling import wait_until
from springback.storage import compat, safeload
from springback.storage.errors import CheckpointExists, CommitTimeout, StorageError
from springback.storage.manifest import (
    MANIFEST_NAME,
    ManifestCursor,
    FileEntry,
    Manifest,
    crc32_hex,
    crc32_of,
    library_versions,
    utc_now_iso,
)
from springback.storage.s3upload import S3PartWriter
from springback.storage.snapshot import ShardSnapshot
from springback.storage.store import ObjectStore, join

DCP_METADATA_NAME = ".metadata"
RECORDS_DIR = "_springback"


def shard_file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def record_name(rank: int) -> str:
    return f"{RECORDS_DIR}/rank-{rank:05d}.pkl"


def claim_name(rank: int) -> str:
    """Created (create-only) before rank ``rank`` writes anything: one writer per rank."""
    return f"{RECORDS_DIR}/rank-{rank:05d}.claim"


@dataclasses.dataclass
class DoneRecord:
    """What rank ``rank`` durably wrote for one checkpoint (pickled into the directory)."""

    rank: int
    world_size: int
    step: int
    generation: int
    shard: FileEntry | None
    items: list[WriteItem]
    results: list[WriteResult]
    mappings: dict[str, Any]
    rng: dict[str, torch.Tensor] | None = None
    entry: FileEntry | None = None
    """Size and CRC of the record file itself; set when read back by the committer."""
    held: tuple[str, ...] = ()
    """The rank's keys, written by it or by another rank (`ShardSnapshot.held`)."""


class _HashingWriter:
    """Write-through wrapper that counts and CRCs the bytes; ``tell`` is the offset in the file.

    An :class:`S3PartWriter` computes the CRC itself, on a background thread
    (overlapping serialization and upload); then :meth:`crc_hex` asks it, which
    is valid once the stream is closed.
    """

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.pos = 0
        self.crc = 0
        self.delegated = isinstance(raw, S3PartWriter)

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self.raw.write(mv)
        if not self.delegated:
            self.crc = zlib.crc32(mv, self.crc)
        self.pos += mv.nbytes
        return mv.nbytes

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:  # torch.save flushes; the real flush happens on close
        pass

    def crc_hex(self) -> str:
        return crc32_hex(self.raw.crc32() if self.delegated else self.crc)


def _serialize(stream: Any, snap: ShardSnapshot, file_name: str) -> tuple[list[WriteResult], _HashingWriter]:
    w = _HashingWriter(stream)
    results = []
    for item, data in zip(snap.items, snap.data):
        offset = w.tell()
        if item.type == WriteItemType.BYTE_IO:
            w.write(data)
        else:
            torch.save(data, cast(IO[bytes], w))  # a write-only binary stream
        length = w.tell() - offset
        results.append(
            WriteResult(index=item.index, size_in_bytes=length, storage_data=compat.StorageInfo(file_name, offset, length))
        )
    return results, w


def write_shard(
    store: ObjectStore,
    ckpt_uri: str,
    snap: ShardSnapshot,
    *,
    rank: int,
    world_size: int,
    step: int,
    generation: int,
    rng: dict[str, torch.Tensor] | None = None,
) -> DoneRecord:
    """Write rank ``rank``'s shard file and then its done-record; return the record.

    Retries transient errors by rewriting the whole file from the snapshot. On any
    failure no done-record is written, so the checkpoint can never commit.
    Raises :class:`CheckpointExists` (writing nothing) when the checkpoint is
    already committed or another writer already recorded this rank's shard.
    """
    refuse_committed(store, ckpt_uri)
    claim = f"{uuid.uuid4().hex} host={socket.gethostname()} pid={os.getpid()}\n".encode()
    _create(store, join(ckpt_uri, claim_name(rank)), claim, ckpt_uri,
            f"rank {rank} of checkpoint {ckpt_uri} is already claimed by another writer")
    shard: FileEntry | None = None
    results: list[WriteResult] = []
    if snap.items:
        name = shard_file_name(rank)
        results, w = store.write_file(join(ckpt_uri, name), lambda f: _serialize(f, snap, name))
        shard = FileEntry(path=name, size_bytes=w.pos, crc32=w.crc_hex(), rank=rank)  # the stream is closed now
    record = DoneRecord(
        rank=rank,
        world_size=world_size,
        step=step,
        generation=generation,
        shard=shard,
        items=snap.items,
        results=results,
        mappings=snap.mappings,
        rng=rng,
        held=snap.held,
    )
    _create(store, join(ckpt_uri, record_name(rank)), pickle.dumps(record), ckpt_uri)
    return record


def refuse_committed(store: ObjectStore, ckpt_uri: str) -> None:
    """Raise :class:`CheckpointExists` if ``ckpt_uri`` holds a manifest (is committed)."""
    if any(name == MANIFEST_NAME for name, _ in store.list(ckpt_uri)):  # one LIST, fresh
        raise CheckpointExists(
            f"{ckpt_uri} is already committed: a committed checkpoint is never written again "
            "(another writer of the same step and generation, or two jobs sharing one directory?)",
            uri=ckpt_uri)


def _create(store: ObjectStore, uri: str, data: bytes, ckpt_uri: str, conflict: str = "") -> None:
    """Create-only write; :class:`CheckpointExists` when another writer was first."""
    try:
        store.put_bytes(uri, data, create_only=True)
    except FileExistsError as exc:
        raise CheckpointExists(
            conflict or f"{uri} was already written by another writer of checkpoint {ckpt_uri}; not overwritten",
            uri=ckpt_uri) from exc


def wait_for_records(
    store: ObjectStore, ckpt_uri: str, world_size: int, *, timeout_s: float, poll_interval_s: float = 0.2
) -> list[DoneRecord]:
    """Poll until every rank's done-record exists, then read them all (ordered by rank).

    Raises :class:`CommitTimeout` listing the missing ranks after ``timeout_s``,
    and :class:`StorageError` at once when a record seen earlier disappears (the
    directory was deleted under the committer: waiting longer cannot help).
    Reading a record that fails to unpickle raises :class:`StorageError` naming it.
    """
    wanted = {f"rank-{r:05d}.pkl": r for r in range(world_size)}
    seen: set[str] = set()
    missing = sorted(wanted.values())

    def all_present() -> bool:
        nonlocal missing
        present = {name for name, _ in store.list(join(ckpt_uri, RECORDS_DIR))}
        gone = sorted(wanted[name] for name in seen - present)
        if gone:  # done-records are never removed by their writers
            raise StorageError(
                f"checkpoint {ckpt_uri} not committed: the done-records of ranks {gone} disappeared "
                "while waiting (the directory was deleted, e.g. by cleanup)", uri=ckpt_uri)
        seen.update(present & wanted.keys())
        missing = sorted(r for name, r in wanted.items() if name not in present)
        return not missing

    if not wait_until(all_present, timeout_s=timeout_s, interval_s=poll_interval_s):
        raise CommitTimeout(
            f"checkpoint {ckpt_uri} not committed: ranks {missing} did not finish their shards "
            f"within {timeout_s:.1f}s",
            uri=ckpt_uri,
            missing_ranks=missing,
        )
    records = []
    for r in range(world_size):
        uri = join(ckpt_uri, record_name(r))
        data = store.get_bytes(uri)
        record = _load_record_bytes(data, uri)
        if (record.rank, record.world_size) != (r, world_size):
            raise StorageError(
                f"done-record {uri} is from rank {record.rank} of {record.world_size}, expected {r} of {world_size}",
                uri=uri,
            )
        record.entry = FileEntry(path=record_name(r), size_bytes=len(data), crc32=crc32_of(data), rank=r)
        records.append(record)
    return records


def build_metadata(records: list[DoneRecord], ckpt_uri: str) -> Metadata:
    """Merge the ranks' parts into DCP ``Metadata``; ``ValueError`` if the chunks
    do not tile, or if a rank held an entry that no rank wrote (ranks that pass
    different plain entries -- pipeline stages -- without saying which ranks
    hold each, `snapshot.PlainHolders`; a DTensor on a mesh whose every rank
    took itself for a replica)."""
    written = {item.index.fqn for r in records for item in r.items}
    for r in records:
        lost = [fqn for fqn in r.held if fqn not in written]
        if lost:
            raise ValueError(
                f"no rank wrote {', '.join(lost[:4])}{' ...' if len(lost) > 4 else ''} "
                f"({len(lost)} entries rank {r.rank} holds) for {ckpt_uri}; ranks whose "
                "plain (non-DTensor) entries differ, as pipeline stages' do, must pass `holders`")
    plans = [SavePlan(items=list(r.items)) for r in records]
    try:
        _, md = create_default_global_save_plan(plans, rewrite_index_hints=False)
    except AssertionError as exc:
        raise ValueError(f"ranks wrote overlapping entries for {ckpt_uri}: {exc}") from exc
    errors = compat.validate_global_plan(plans, md)
    if errors:
        raise ValueError(f"inconsistent shards for {ckpt_uri}: {'; '.join(map(str, errors))[:500]}")
    md.planner_data = dict(ChainMap(*[r.mappings for r in records]))
    md.storage_data = {wr.index: wr.storage_data for r in records for wr in r.results}
    md.storage_meta = StorageMeta(checkpoint_id=ckpt_uri, save_id=uuid.uuid4().hex)
    md.version = CURRENT_DCP_VERSION
    return md


def commit(
    store: ObjectStore,
    ckpt_uri: str,
    records: list[DoneRecord],
    *,
    step: int,
    generation: int,
    cursor: ManifestCursor,
    layout: dict[str, int],
    extra: dict[str, Any] | None = None,
) -> Manifest:
    """Write ``.metadata`` then ``manifest.json`` for a checkpoint whose shards are all durable.

    Create-only: raises :class:`CheckpointExists` (overwriting nothing) when the
    checkpoint is committed already (its ``.metadata`` exists) or another
    committer wrote ``.metadata`` first; of two concurrent committers exactly
    one wins. The manifest is the
    commit point; a failure before it leaves the checkpoint partial (and a
    rerun then fails on ``.metadata``: the directory is cleaned up as partial).
    """
    md = build_metadata(records, ckpt_uri)
    md_bytes = pickle.dumps(md)
    _create(store, join(ckpt_uri, DCP_METADATA_NAME), md_bytes, ckpt_uri)
    files = [FileEntry(path=DCP_METADATA_NAME, size_bytes=len(md_bytes), crc32=crc32_of(md_bytes))]
    for r in records:
        if r.shard is not None:
            files.append(r.shard)
    files.extend(r.entry for r in records if r.entry is not None)  # records hold RNG states: verify them too
    manifest = Manifest(
        step=step,
        generation=generation,
        world_size=len(records),
        layout=dict(layout),
        cursor=cursor,
        files=tuple(files),
        versions=library_versions(),
        created_at=utc_now_iso(),
        extra=dict(extra or {}),
    )
    _create(store, join(ckpt_uri, MANIFEST_NAME), manifest.to_json().encode(), ckpt_uri)
    return manifest


def load_record(store: ObjectStore, ckpt_uri: str, rank: int) -> DoneRecord:
    """Read one rank's done-record (used to restore RNG state); raises
    :class:`StorageError` naming it when it is not a done-record."""
    uri = join(ckpt_uri, record_name(rank))
    return _load_record_bytes(store.get_bytes(uri), uri)


def _load_record_bytes(data: bytes, uri: str) -> DoneRecord:
    """A done-record read with `safeload.loads` (no code runs from storage)."""
    try:
        record = safeload.loads(data)
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise StorageError(f"unreadable done-record {uri}: {exc}", uri=uri) from exc
    if not isinstance(record, DoneRecord):
        raise StorageError(f"unreadable done-record {uri}: it holds a {type(record).__name__}", uri=uri)
    return record


