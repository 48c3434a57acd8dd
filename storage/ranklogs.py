"""Rank logs kept beside a job's checkpoints: their layout on storage.

Node agents ship what their ranks print (`springback.worker.agent.ranklogs`) as
chunks in the job's own directory, beside its checkpoints::

    {checkpoint.uri}/{job_id}/logs/{member_id}/{unix_ms:013d}-{seq:06d}.log

Every function here takes that directory as its base URI
(`springback.client.jobdir.job_directory`), never the spec's
``checkpoint.uri`` itself: jobs sharing a ``checkpoint.uri`` then never read or
delete each other's logs. ``logs`` is not a checkpoint directory name
(``step-<step>-g<generation>``), so listing, retention and verification of
the job's checkpoints pass it by.

Each chunk is written once, atomically (on S3 an object is complete or
absent), so a reader never sees half a chunk and appends need no
read-modify-write on object stores. Names sort by time within a member;
`list_chunks` merges members by the time in the name. Logs are not subject to
checkpoint retention: they stay until ``springback job delete --checkpoints``
removes the job's storage (`delete_logs`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from springback.storage.store import ObjectStore, join

LOGS_DIR = "logs"
_CHUNK = re.compile(r"^(\d{13})-(\d{6})\.log$")


class Chunk(NamedTuple):
    unix_ms: int
    member_id: str
    seq: int
    uri: str


def logs_uri(base_uri: str) -> str:
    """Where the job whose own directory is `base_uri` (``<checkpoint.uri>/<job
    id>``) keeps its rank logs."""
    return join(base_uri, LOGS_DIR)


def write_chunk(store: ObjectStore, base_uri: str, member_id: str, unix_ms: int, seq: int,
                data: bytes) -> str:
    """Writes one chunk (atomically; retried by `store`); returns its URI.
    Raises the store's error when its retries run out (nothing partial is left)."""
    uri = join(logs_uri(base_uri), member_id, f"{unix_ms:013d}-{seq:06d}.log")
    store.put_bytes(uri, data, atomic=True)
    return uri


def members(store: ObjectStore, base_uri: str) -> list[str]:
    """Members that shipped logs, sorted."""
    return sorted(name for name, is_dir in store.list(logs_uri(base_uri)) if is_dir)


def list_chunks(store: ObjectStore, base_uri: str, member_id: str | None = None) -> list[Chunk]:
    """Every chunk (of one member, or of all), oldest first."""
    chunks = []
    for member in [member_id] if member_id else members(store, base_uri):
        directory = join(logs_uri(base_uri), member)
        for name, is_dir in store.list(directory):
            match = _CHUNK.match(name)
            if match and not is_dir:
                chunks.append(Chunk(int(match[1]), member, int(match[2]), join(directory, name)))
    return sorted(chunks)


def delete_logs(store: ObjectStore, base_uri: str) -> None:
    """Deletes every rank log of the job whose directory is `base_uri`, and
    only its (idempotent)."""
    store.rm_tree(logs_uri(base_uri))
