"""Streaming S3 upload with concurrent multipart parts, for large checkpoint shards.

s3fs's file objects upload multipart parts one after the other; this writer
uploads up to ``max_concurrency`` parts at once, which is what a raw
``s3fs.pipe`` achieves for an in-memory blob, without first materializing the
whole shard. Small files (below ``2 * part_size``) go up in a single PUT, as with
``pipe``.

Host memory: at most ``2 * part_size`` buffered plus ``max_concurrency`` parts in
flight. Failure: any error aborts the multipart upload (no object appears) and is
raised from ``write`` or ``close``; retrying is the caller's business (the Store
rewrites the whole file).
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any


class S3PartWriter:
    """A write-only binary stream that uploads to ``s3://bucket/key`` on ``close``."""

    def __init__(self, fs: Any, path: str, *, part_size: int = 50 << 20, max_concurrency: int = 4) -> None:
        if part_size < 5 << 20:
            raise ValueError(f"part_size must be >= 5 MiB (S3 minimum), got {part_size}")
        self.fs = fs
        self.bucket, self.key, _ = fs.split_path(path)
        self.path = path
        self.part_size = part_size
        self.max_concurrency = max(1, max_concurrency)
        self._cur = bytearray(part_size)  # the part being filled; parts are never copied again
        self._n = 0
        self._held: list[bytearray] = []  # full parts kept back until the file is known to be large
        self._upload_id: str | None = None
        self._parts: list[cf.Future[dict[str, Any]]] = []
        self._pool: cf.ThreadPoolExecutor | None = None
        self._closed = False

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        total = mv.nbytes
        while mv.nbytes:
            k = min(mv.nbytes, self.part_size - self._n)
            self._cur[self._n : self._n + k] = mv[:k]
            self._n += k
            mv = mv[k:]
            if self._n == self.part_size:
                self._part_full()
        return total

    def _part_full(self) -> None:
        full, self._cur, self._n = self._cur, bytearray(self.part_size), 0
        if self._upload_id is not None:
            self._submit(full)
            return
        self._held.append(full)
        if len(self._held) >= 2:  # large file: switch to a multipart upload
            self._upload_id = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)["UploadId"]
            self._pool = cf.ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="springback-s3-part")
            for part in self._held:
                self._submit(part)
            self._held = []

    def _submit(self, body: bytes | bytearray) -> None:
        assert self._pool is not None
        # bounded: wait for the oldest part when max_concurrency are in flight
        pending = [f for f in self._parts if not f.done()]
        if len(pending) >= self.max_concurrency:
            cf.wait(pending, return_when=cf.FIRST_COMPLETED)
        for f in self._parts:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        number = len(self._parts) + 1
        self._parts.append(self._pool.submit(self._upload_part, number, body))

    def _upload_part(self, number: int, body: bytes | bytearray) -> dict[str, Any]:
        out = self.fs.call_s3(
            "upload_part", Bucket=self.bucket, Key=self.key, PartNumber=number, UploadId=self._upload_id, Body=body
        )
        return {"PartNumber": number, "ETag": out["ETag"]}

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            tail = self._cur[: self._n]
            if self._upload_id is None:
                body = b"".join([*self._held, tail]) if self._held else tail
                self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=body)
            else:
                if tail:
                    self._submit(tail)
                parts = [f.result() for f in self._parts]
                self.fs.call_s3(
                    "complete_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
        except BaseException:
            self.abort()
            raise
        finally:
            self._cur, self._held = bytearray(), []
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        """Drop the upload: nothing appears at the key. Idempotent, never raises."""
        self._closed = True
        if self._upload_id is not None:
            for f in self._parts:
                f.cancel()
            try:
                self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self._upload_id)
            except Exception:  # noqa: BLE001 - best effort; S3 lifecycle rules reap leftovers
                pass
            self._upload_id = None

    def __enter__(self) -> S3PartWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()
