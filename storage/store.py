"""A small storage layer over fsspec string URIs, with retries.

URIs are plain strings (``file:///x``, ``/x``, ``s3://bucket/x``, ``memory://x``):
``pathlib.Path`` would mangle ``s3://``. A :class:`ObjectStore` wraps the fsspec filesystem
of one URI scheme and applies :func:`~springback.storage.retry.call_with_retry` to
every call, each request on its own (a ranged read is one request,
:meth:`ObjectStore.read_range`), so transient errors (5xx, throttling, resets,
truncated bodies) are retried with backoff and anything else fails at once with
the URI in the message. That policy is the
only retry layer: on S3, s3fs's and botocore's own retries are turned off
(botocore ``config_kwargs["retries"]`` unless the caller sets one).

S3 configuration, in priority order: explicit ``storage_options`` (s3fs keyword
arguments, e.g. ``{"client_kwargs": {"endpoint_url": ...}, "key": ..., "secret":
...}``), then the environment: ``SPRINGBACK_S3_ENDPOINT_URL`` for the endpoint and
the usual ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_REGION`` that
botocore reads itself.

Durability: on local files, :meth:`ObjectStore.write_file` fsyncs before returning and
:meth:`ObjectStore.put_bytes` with ``atomic=True`` writes a temporary file and renames it,
so a crash leaves either the old content or the new. On S3 a PUT (or a completed
multipart upload) is atomic by itself. Listing and existence checks bypass fsspec's
listing cache, so polling sees other processes' writes.
"""

from __future__ import annotations

import os
import uuid
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar, cast

import fsspec
from fsspec.implementations.local import LocalFileSystem

from springback.client import env as E
from springback.storage.errors import TransientReadError
from springback.storage.retry import LOWER_RETRIES_OFF, RetryPolicy, RetryStats, call_with_retry
from springback.storage.s3upload import S3PartWriter

T = TypeVar("T")

_READ_CHUNK = 8 << 20


def join(base: str, *parts: str) -> str:
    """Join URI parts with ``/`` without touching the scheme (``s3://`` stays intact)."""
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


def resolve_storage_options(uri: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """Return fsspec options for ``uri``: the explicit ones, completed from the environment."""
    opts = dict(storage_options or {})
    if uri.startswith(("s3://", "s3a://")):
        endpoint = os.environ.get(E.S3_ENDPOINT_URL)
        client_kwargs = dict(opts.get("client_kwargs") or {})
        if endpoint and "endpoint_url" not in client_kwargs and "endpoint_url" not in opts:
            client_kwargs["endpoint_url"] = endpoint
        if client_kwargs:
            opts["client_kwargs"] = client_kwargs
        config_kwargs = dict(opts.get("config_kwargs") or {})
        config_kwargs.setdefault("retries", LOWER_RETRIES_OFF["retries"])  # one retry layer: ours
        opts["config_kwargs"] = config_kwargs
    return opts


class ObjectStore:
    """Retrying file operations on one fsspec filesystem, addressed by full URIs.

    On S3, files are uploaded by :class:`~springback.storage.s3upload.S3PartWriter`
    (``part_size`` parts, ``max_concurrency`` of them in flight). The defaults (16
    MiB x 8) start the upload early and keep it pipelined with serialization; they
    measured faster than 50 MiB x 4 in ``bench/s3_throughput.py``.

    Every method may raise :class:`~springback.storage.errors.TransientStorageError`
    when its retry budget runs out, or the underlying non-transient error
    (``FileNotFoundError`` ...) at once. All methods are safe to call from several
    threads.
    """

    def __init__(
        self,
        uri: str,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        stats: RetryStats | None = None,
        part_size: int = 16 << 20,
        max_concurrency: int = 8,
    ) -> None:
        self.storage_options = resolve_storage_options(uri, storage_options)
        self.fs, _ = fsspec.url_to_fs(uri, **self.storage_options)
        self.retry = retry or RetryPolicy.from_env()
        self.stats = stats or RetryStats()
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.is_s3 = type(self.fs).__name__ == "S3FileSystem"
        if self.is_s3:
            self.fs.retries = 1  # s3fs tries once; `retry` is the one policy
        self.part_size = part_size
        self.max_concurrency = max_concurrency

    # -- helpers -------------------------------------------------------------
    def _path(self, uri: str) -> str:
        return fsspec.core.strip_protocol(uri)

    def _call(self, what: str, uri: str, fn: Callable[[], T]) -> T:
        return call_with_retry(fn, what=what, uri=uri, policy=self.retry, stats=self.stats)

    def _ensure_parent(self, path: str) -> None:
        if self.is_local:
            self.fs.makedirs(os.path.dirname(path), exist_ok=True)

    # -- writing -------------------------------------------------------------
    def write_file(self, uri: str, produce: Callable[[BinaryIO], T]) -> T:
        """Open ``uri`` for writing and call ``produce(stream)``; return its result.

        On a transient error the whole file is rewritten by calling ``produce``
        again on a fresh stream, so ``produce`` must be repeatable. Local files are
        fsynced before this returns; on S3 the upload is complete when it returns.
        """
        path = self._path(uri)

        def attempt() -> T:
            self._ensure_parent(path)
            if self.is_s3:
                with S3PartWriter(self.fs, path, part_size=self.part_size, max_concurrency=self.max_concurrency) as w:
                    return produce(cast(BinaryIO, w))  # a write-only binary file
            with self.fs.open(path, "wb") as f:
                result = produce(f)
                if self.is_local:
                    f.flush()
                    os.fsync(f.fileno())
            return result

        return self._call("write", uri, attempt)

    def put_bytes(self, uri: str, data: bytes, *, atomic: bool = False, create_only: bool = False) -> None:
        """Write ``data`` to ``uri``. With ``atomic``, readers see old or new content, never a mix.

        With ``create_only`` the write fails with :class:`FileExistsError` when
        ``uri`` already holds other bytes, and never replaces them: local files
        are hard-linked into place (atomic), S3 uses a conditional PUT
        (``If-None-Match: *``), memory:// an exclusive open; other filesystems
        check first (not atomic). Finding exactly ``data`` there already counts
        as success, so a retry after a lost reply is idempotent.
        """
        if create_only:
            self._create(uri, data)
            return
        path = self._path(uri)
        if not (atomic and self.is_local):
            self.write_file(uri, lambda f: f.write(data))
            return
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"

        def attempt() -> None:
            self._ensure_parent(path)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)

        self._call("write", uri, attempt)

    def _create(self, uri: str, data: bytes) -> None:
        path = self._path(uri)

        def attempt() -> None:
            try:
                if self.is_local:
                    self._ensure_parent(path)
                    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
                    try:
                        with open(tmp, "wb") as f:
                            f.write(data)
                            f.flush()
                            os.fsync(f.fileno())
                        os.link(tmp, path)  # fails if path exists: create-only and atomic
                    finally:
                        os.unlink(tmp)
                elif self.is_s3 or type(self.fs).__name__ == "MemoryFileSystem":
                    self.fs.pipe_file(path, data, mode="create")
                else:
                    if self.fs.exists(path):
                        raise FileExistsError(path)
                    self.fs.pipe_file(path, data)
            except FileExistsError:
                if self.fs.cat_file(path) != data:
                    raise
            self.fs.invalidate_cache(path)

        self._call("create", uri, attempt)

    # -- reading -------------------------------------------------------------
    def get_bytes(self, uri: str) -> bytes:
        """Read the whole file at ``uri``."""
        return self._call("read", uri, lambda: self.fs.cat_file(self._path(uri)))

    def read_range(self, uri: str, offset: int, length: int) -> bytes:
        """Read ``length`` bytes of the file at ``uri`` from ``offset``: one
        ranged GET on S3, retried on its own, whole, from ``offset`` again
        (idempotent).

        A body shorter than asked (a connection closed mid-body) is a
        transient error and is read again; on local files a short read is the
        file's real size and raises `EOFError` at once. ``FileNotFoundError``
        is raised at once too.
        """
        if length == 0:
            return b""
        path = self._path(uri)

        def attempt() -> bytes:
            data = self.fs.cat_file(path, start=offset, end=offset + length)
            if len(data) != length:
                what = f"{uri} [{offset}, {offset + length}): got {len(data)} of {length} bytes"
                if self.is_local:
                    raise EOFError(f"short file {what}")
                raise TransientReadError(f"truncated body reading {what}", uri=uri)
            return data

        return self._call("read", uri, attempt)

    def checksum(self, uri: str) -> tuple[int, int]:
        """``(crc32, size)`` of the file at ``uri``, reading it once.

        A transient error mid-stream (a reset, a truncated body) restarts the
        whole read, so the result is always over the complete file;
        ``FileNotFoundError`` is raised at once.
        """
        path = self._path(uri)

        def attempt() -> tuple[int, int]:
            crc, size = 0, 0
            with self.fs.open(path, "rb") as f:
                while chunk := f.read(_READ_CHUNK):
                    crc = zlib.crc32(chunk, crc)
                    size += len(chunk)
            return crc, size

        return self._call("read", uri, attempt)

    def exists(self, uri: str) -> bool:
        """True if a file or directory exists at ``uri`` (fresh, not from a listing cache)."""
        path = self._path(uri)

        def attempt() -> bool:
            self.fs.invalidate_cache(path)
            return bool(self.fs.exists(path))

        return self._call("exists", uri, attempt)

    def size(self, uri: str) -> int:
        """Size in bytes of the file at ``uri``."""
        path = self._path(uri)

        def attempt() -> int:
            self.fs.invalidate_cache(path)
            return int(self.fs.size(path))

        return self._call("stat", uri, attempt)

    def list(self, uri: str) -> list[tuple[str, bool]]:
        """Return ``(name, is_dir)`` for the entries directly under ``uri``; [] if it is absent."""
        path = self._path(uri).rstrip("/")

        def attempt() -> list[tuple[str, bool]]:
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                return []
            out = []
            for e in entries:
                name = e["name"].rstrip("/").rsplit("/", 1)[-1]
                if name and e["name"].rstrip("/") != path:
                    out.append((name, e.get("type") == "directory"))
            return out

        return self._call("list", uri, attempt)

    # -- deleting ------------------------------------------------------------
    def rm(self, uri: str) -> None:
        """Delete one file; a missing file is not an error (idempotent)."""
        path = self._path(uri)

        def attempt() -> None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

        self._call("delete", uri, attempt)

    def rm_tree(self, uri: str) -> None:
        """Delete a directory and everything under it; missing is not an error (idempotent)."""
        path = self._path(uri)

        def attempt() -> None:
            self.fs.invalidate_cache(path)
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass

        self._call("delete", uri, attempt)
