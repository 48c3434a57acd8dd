"""Upload throughput to S3 (a moto server on 127.0.0.1, in a child process): springback's checkpointer vs a
raw s3fs upload of the same bytes. Prints MB/s of both and the ratio (target >= 0.9).

springback's time is the background write of the shard (serialize + CRC + upload,
then the small done-record PUT: ``stats.last_upload_s``); the raw uploads write the
bytes of that very shard file with ``s3fs``: ``fs.pipe`` with its defaults (the
target's reference), ``fs.pipe`` with springback's part size and concurrency (to
show how much of the difference is the part size), and an ``open``/``write``
stream. Medians of --reps, the four run in rotating order.

    .venv/bin/python bench/s3_throughput.py [--mb 128] [--reps 3] [--endpoint URL]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
import uuid

import torch

from springback.storage import Checkpointer, prune_to_record
from springback.storage.store import ObjectStore


def _serve_moto(q: mp.Queue) -> None:
    """Child process: a moto S3 server on 127.0.0.1, port 0 (its own GIL, like a real remote store)."""
    import logging
    import threading

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    q.put(server.get_host_and_port())
    threading.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=128)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--endpoint", default=None, help="S3 endpoint URL (default: start a moto server on 127.0.0.1)")
    args = ap.parse_args()
    server = None
    endpoint = args.endpoint
    if endpoint is None:
        q: mp.Queue = mp.get_context("spawn").Queue()
        server = mp.get_context("spawn").Process(target=_serve_moto, args=(q,), daemon=True)
        server.start()
        host, port = q.get(timeout=60)
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
    store = ObjectStore(f"s3://{bucket}", storage_options=opts)
    base = f"s3://{bucket}/ckpt"
    ck = Checkpointer(base, rank=0, world_size=1, store=store,  # keep only the newest, as a record of one would
                      on_commit=lambda info: prune_to_record(base, [info.uri], current_generation=1, store=store))
    # the bytes of the shard file, for the raw uploads
    first = ck.save(0, sd, generation=1).result()
    data = store.get_bytes(f"{first.uri}/__0_0.distcp")

    def run_ours(i: int) -> float:
        ck.save(i + 1, sd, generation=1).result()
        return ck.stats.last_upload_s

    def run_pipe(i: int) -> float:
        t0 = time.perf_counter()
        store.fs.pipe(f"{bucket}/raw/{i}.bin", data)
        return time.perf_counter() - t0

    def run_pipe_tuned(i: int) -> float:
        t0 = time.perf_counter()
        store.fs.pipe(f"{bucket}/raw/{i}.t", data, chunksize=store.part_size, max_concurrency=store.max_concurrency)
        return time.perf_counter() - t0

    def run_stream(i: int) -> float:
        t0 = time.perf_counter()
        with store.fs.open(f"{bucket}/raw/{i}.s", "wb") as f:
            f.write(data)
        return time.perf_counter() - t0

    # rotate the order in each repetition: the store's speed drifts (moto, shared CPUs)
    times: dict[str, list[float]] = {"ours": [], "pipe": [], "tuned": [], "stream": []}
    fns = [("ours", run_ours), ("pipe", run_pipe), ("tuned", run_pipe_tuned), ("stream", run_stream)]
    for i in range(args.reps):
        for name, fn in fns[i % 4 :] + fns[: i % 4]:
            times[name].append(fn(i))
    ck.close()
    mb = len(data) / 2**20
    rate = {k: mb / statistics.median(v) for k, v in times.items()}
    print(f"shard {mb:.0f} MiB, {args.reps} reps, endpoint {endpoint}, springback parts "
          f"{store.part_size >> 20} MiB x {store.max_concurrency}")
    for k, label in (("ours", "springback"), ("pipe", "pipe"), ("tuned", "pipe (same parts)"), ("stream", "open/write")):
        print(f"seconds per rep, {label}: {[round(x, 2) for x in times[k]]}")
    print(f"springback checkpointer:          {rate['ours']:8.1f} MiB/s")
    print(f"raw s3fs pipe:                    {rate['pipe']:8.1f} MiB/s")
    print(f"raw s3fs pipe, springback parts:  {rate['tuned']:8.1f} MiB/s")
    print(f"raw s3fs open/write:              {rate['stream']:8.1f} MiB/s")
    print(f"springback / raw pipe         = {rate['ours'] / rate['pipe']:.2f}  (target >= 0.9)")
    print(f"springback / raw pipe, same parts = {rate['ours'] / rate['tuned']:.2f}")
    print(f"springback / raw open/write   = {rate['ours'] / rate['stream']:.2f}")
    if server is not None:
        server.terminate()
        server.join(10)


if __name__ == "__main__":
    main()
