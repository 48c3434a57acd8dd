"""The concurrent multipart S3 writer: small files in one PUT, large ones in parts,
byte-exact; a failed upload leaves no object behind."""

from __future__ import annotations

import os
import zlib

import pytest

from springback.storage.s3upload import S3PartWriter
from springback.storage.store import ObjectStore


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [0, 3 << 20, 5 << 20, (5 << 20) + 1, (5 << 20) * 3 + 12345])
def test_upload_is_byte_exact_and_checksummed_for_single_put_and_multipart(s3_bucket, size):
    bucket, opts = s3_bucket
    store = ObjectStore(bucket, storage_options=opts, part_size=5 << 20, max_concurrency=3)
    data = os.urandom(size)
    uri = f"{bucket}/obj-{size}"

    def produce(f):
        for i in range(0, len(data), 777_777):
            f.write(data[i : i + 777_777])
        return f

    w = store.write_file(uri, produce)
    assert store.get_bytes(uri) == data
    assert w.tell() == size and w.crc32() == zlib.crc32(data)
    multipart = size > 5 << 20  # a file of at most one part is a single PUT
    assert (w._pool is not None) == multipart


@pytest.mark.timeout(120)
def test_an_error_mid_upload_aborts_and_leaves_no_object(s3_bucket):
    bucket, opts = s3_bucket
    store = ObjectStore(bucket, storage_options=opts)
    path = f"{bucket.removeprefix('s3://')}/broken"
    with pytest.raises(RuntimeError):
        with S3PartWriter(store.fs, path, part_size=5 << 20) as w:
            w.write(os.urandom(11 << 20))  # starts a multipart upload and sends a part
            raise RuntimeError("producer failed")
    assert not store.exists(f"{bucket}/broken")
    uploads = store.fs.call_s3("list_multipart_uploads", Bucket=bucket.removeprefix("s3://")).get("Uploads", [])
    assert uploads == []


def test_part_size_below_the_s3_minimum_is_rejected(s3_bucket):
    bucket, opts = s3_bucket
    with pytest.raises(ValueError, match="5 MiB"):
        S3PartWriter(ObjectStore(bucket, storage_options=opts).fs, "x/y", part_size=1 << 20)


@pytest.mark.parametrize(("la", "lb"), [(0, 5), (7, 0), (100, 33), (5 << 20, 1_234_567)])
def test_crc32_combine_matches_zlib_over_the_concatenation(la, lb):
    from springback.storage.s3upload import crc32_combine

    a, b = os.urandom(la), os.urandom(lb)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b)
