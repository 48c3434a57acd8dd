"""Streaming S3 upload with concurrent multipart parts, for large checkpoint shards.

s3fs's file objects upload multipart parts one after the other; this writer
uploads up to ``max_concurrency`` parts at once, which is what a raw
``s3fs.pipe`` achieves for an in-memory blob, without first materializing the
whole shard. Parts go up while the producer is still writing: the multipart
upload starts as soon as the second part begins, so serialization overlaps the
upload. A file that fits in one part goes up in a single PUT (``pipe`` uses one
below two parts; starting at one part trades two small requests for overlap).

The writer also computes the CRC-32 of everything written (:meth:`crc32`): each
part's CRC on its upload thread (``zlib.crc32`` releases the GIL, so it overlaps
the producer and the other parts), combined in file order at the end. The part's
CRC also goes with the request (``ChecksumCRC32``): the server verifies it, and
botocore does not compute the same checksum a second time.

Host memory: part buffers are recycled; at most ``max_concurrency + 1`` of them
(``part_size`` each) exist. Failure: any error aborts the multipart upload (no
object appears) and is raised from ``write`` or ``close``; retrying is the
caller's business (the ObjectStore rewrites the whole file).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import functools
import zlib
from typing import Any

_CRC32_POLY = 0xEDB88320  # reflected CRC-32 (zlib, S3 ChecksumCRC32)


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_compose(a: list[int], b: list[int]) -> list[int]:
    """The operator "b, then a" (32x32 bit matrices, one int per column)."""
    return [_gf2_times(a, col) for col in b]


@functools.lru_cache(maxsize=16)
def _zeros_operator(nbytes: int) -> list[int]:
    """The linear map from crc32(A) to the CRC register after appending ``nbytes`` zero bytes."""
    op = [1 << n for n in range(32)]
    sq = [_CRC32_POLY] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):
        sq = _gf2_compose(sq, sq)  # one zero byte
    while nbytes:
        if nbytes & 1:
            op = _gf2_compose(sq, op)
        nbytes >>= 1
        if nbytes:
            sq = _gf2_compose(sq, sq)
    return op


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(A + B)`` from ``crc1 = zlib.crc32(A)``, ``crc2 = zlib.crc32(B)`` and ``len(B)`` (as zlib's)."""
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2


def _crc_header(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


class S3PartWriter:
    """A write-only binary stream that uploads to ``s3://bucket/key``, complete on ``close``."""

    def __init__(self, fs: Any, path: str, *, part_size: int = 50 << 20, max_concurrency: int = 4) -> None:
        if part_size < 5 << 20:
            raise ValueError(f"part_size must be >= 5 MiB (S3 minimum), got {part_size}")
        self.fs = fs
        self.bucket, self.key, _ = fs.split_path(path)
        self.path = path
        self.part_size = part_size
        self.max_concurrency = max(1, max_concurrency)
        self._free: list[bytearray] = []  # part buffers whose upload finished, for reuse
        self._cur = bytearray(part_size)  # the part being filled
        self._n = 0
        self._pos = 0
        self._crc = 0
        self._upload_id: str | None = None
        self._parts: list[cf.Future[tuple[dict[str, Any], int, int]]] = []  # (part, its CRC, its length)
        self._pool: cf.ThreadPoolExecutor | None = None
        self._closed = False
        self._complete = False

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        total = mv.nbytes
        while mv.nbytes:
            if self._n == self.part_size:
                self._part_full()  # only now that more bytes come: a file of one part stays a single PUT
            k = min(mv.nbytes, self.part_size - self._n)
            self._cur[self._n : self._n + k] = mv[:k]
            self._n += k
            mv = mv[k:]
        self._pos += total
        return total

    def tell(self) -> int:
        return self._pos

    def crc32(self) -> int:
        """CRC-32 of all the bytes written; valid once ``close`` returned without error."""
        if not self._complete:
            raise RuntimeError(f"upload of {self.path} is not complete")
        return self._crc

    def _part_full(self) -> None:
        if self._upload_id is None:  # the file is larger than one part: switch to a multipart upload
            self._upload_id = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)["UploadId"]
            self._pool = cf.ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="springback-s3-part")
        full, self._n = self._cur, 0
        self._submit(full, self.part_size)
        self._cur = self._free.pop() if self._free else bytearray(self.part_size)

    def _submit(self, buf: bytearray, n: int) -> None:
        assert self._pool is not None
        # bounded: wait for the oldest part when max_concurrency are in flight
        pending = [f for f in self._parts if not f.done()]
        if len(pending) >= self.max_concurrency:
            cf.wait(pending, return_when=cf.FIRST_COMPLETED)
        for f in self._parts:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        body = buf if n == len(buf) else bytes(memoryview(buf)[:n])  # the short last part: one copy (botocore takes no memoryview)
        number = len(self._parts) + 1
        self._parts.append(self._pool.submit(self._upload_part, number, body, buf))

    def _upload_part(self, number: int, body: bytes | bytearray, buf: bytearray) -> tuple[dict[str, Any], int, int]:
        try:
            crc = zlib.crc32(body)
            out = self.fs.call_s3(
                "upload_part", Bucket=self.bucket, Key=self.key, PartNumber=number, UploadId=self._upload_id, Body=body,
                ChecksumCRC32=_crc_header(crc),
            )
        finally:
            self._free.append(buf)  # list.append is atomic
        return {"PartNumber": number, "ETag": out["ETag"]}, crc, len(body)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._upload_id is None:
                body = bytes(memoryview(self._cur)[: self._n])
                self._crc = zlib.crc32(body)
                self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=body, ChecksumCRC32=_crc_header(self._crc))
            else:
                if self._n:
                    self._submit(self._cur, self._n)
                parts = []
                for i, f in enumerate(self._parts):
                    part, crc, length = f.result()
                    parts.append(part)
                    self._crc = crc if i == 0 else crc32_combine(self._crc, crc, length)
                self.fs.call_s3(
                    "complete_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
            self._complete = True
        except BaseException:
            self.abort()
            raise
        finally:
            self._shutdown()
            self.fs.invalidate_cache(self.path)

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._cur, self._free = bytearray(), []

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
            self._shutdown()
        else:
            self.close()
