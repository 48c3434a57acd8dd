"""Upload throughput to S3 (a moto server on 127.0.0.1): springback's checkpointer vs a
raw s3fs upload of the same bytes. Prints MB/s of both and the ratio (target >= 0.9).

springback's time is the background write of the shard (serialize + CRC + upload,
``stats.last_upload_s``); the raw upload writes the bytes of that very shard file
with ``s3fs`` (``fs.pipe``, and an ``open``/``write`` stream). Medians of --reps.

    .venv/bin/python bench/s3_throughput.py [--mb 128] [--reps 3] [--endpoint URL]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import torch

from springback.storage import Checkpointer
from springback.storage.store import Store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--endpoint", default=None, help="S3 endpoint URL (default: start a moto server on 127.0.0.1)")
    args = ap.parse_args()
    server = None
    endpoint = args.endpoint
    if endpoint is None:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
    import boto3
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    n = args.mb * 2**20 // 4 // 16
    sd = {f"t{i}": torch.randn(n) for i in range(16)}
    store = Store(f"s3://{bucket}", storage_options=opts)
    ck = Checkpointer(f"s3://{bucket}/ckpt", rank=0, world_size=1, store=store, keep_last=1)
    ours, pipe, stream = [], [], []
    for i in range(args.reps):
        info = ck.save(i, sd, generation=1)
        uri = info.result().uri
        ours.append(ck.stats.last_upload_s)
        data = store.get_bytes(f"{uri}/__0_0.distcp")
        path = f"{bucket}/raw/{i}.bin"
        t0 = time.perf_counter()
        store.fs.pipe(path, data)
        pipe.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with store.fs.open(path + ".s", "wb") as f:
            f.write(data)
        stream.append(time.perf_counter() - t0)
    ck.close()
    mb = len(data) / 2**20
    m_ours, m_pipe, m_stream = (mb / statistics.median(x) for x in (ours, pipe, stream))
    print(f"shard {mb:.0f} MiB, {args.reps} reps, endpoint {endpoint}")
    print(f"springback checkpointer: {m_ours:8.1f} MiB/s")
    print(f"raw s3fs pipe:           {m_pipe:8.1f} MiB/s")
    print(f"raw s3fs open/write:     {m_stream:8.1f} MiB/s")
    print(f"springback / raw pipe         = {m_ours / m_pipe:.2f}  (target >= 0.9)")
    print(f"springback / raw open/write   = {m_ours / m_stream:.2f}")
    if server is not None:
        server.stop()


if __name__ == "__main__":
    main()
