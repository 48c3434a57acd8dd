"""Fixtures for storage tests: a real moto S3 server on 127.0.0.1 (port 0), and a
fault-injecting HTTP proxy in front of it (tests/s3faults.py)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from s3faults import FaultyS3


@pytest.fixture(scope="session")
def moto_endpoint() -> Any:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def s3_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }
    opts.update(extra)
    return opts


@pytest.fixture
def s3_bucket(moto_endpoint: str) -> tuple[str, dict[str, Any]]:
    """A fresh bucket; returns (``s3://bucket``, storage options)."""
    import boto3

    opts = s3_options(moto_endpoint)
    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    boto3.client(
        "s3", endpoint_url=moto_endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=name)
    return f"s3://{name}", opts


@pytest.fixture
def faulty_s3(moto_endpoint: str) -> Any:
    """(proxy endpoint URL, FaultInjector): an S3 endpoint that fails on demand (tests/s3faults.py)."""
    with FaultyS3(moto_endpoint) as proxy:
        yield proxy.url, proxy.injector


@pytest.fixture
def make_s3_options() -> Any:
    """The function ``s3_options(endpoint, **extra)`` building s3fs options for a test endpoint."""
    return s3_options


@pytest.fixture(params=["file", "memory", "s3"])
def base_uri(request, tmp_path, monkeypatch) -> str:
    """A fresh base URI on local files, memory:// or a real S3 server."""
    if request.param == "file":
        return f"file://{tmp_path}/ckpts"
    if request.param == "memory":
        return f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    # s3 configured only through the environment, as a deployment would
    bucket, opts = request.getfixturevalue("s3_bucket")
    monkeypatch.setenv("SPRINGBACK_S3_ENDPOINT_URL", opts["client_kwargs"]["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return f"{bucket}/ckpts"
