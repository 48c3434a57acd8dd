"""Throw-away certificates for an etcd behind TLS in tests.

`make_certs` writes, with the product's `springback.cli.etcd_credentials`
(what `springback up` uses), a CA, a server certificate (SAN 127.0.0.1 and
localhost) and a client certificate whose CN (`CLIENT_CN`) is deliberately not
an etcd user, and returns an `EtcdServerTls` for `springback.cli.local.EtcdServer`.
"""

from __future__ import annotations

import datetime
import os

from springback.cli.etcd_credentials import CLIENT_CN, FILES, issue_certs, random_password
from springback.cli.local import EtcdServerTls

__all__ = ["CLIENT_CN", "make_certs", "random_password"]


def make_certs(directory: str, *, password: str | None = None) -> EtcdServerTls:
    """A CA, a server and a client certificate under `directory`, valid one
    day; with `password`, the etcd enables auth for user ``springback`` with it."""
    os.makedirs(directory, exist_ok=True)
    paths = {field: os.path.join(directory, name) for field, name in FILES.items()}
    issue_certs(paths, validity=datetime.timedelta(days=1))
    return EtcdServerTls(**paths, password=password)
