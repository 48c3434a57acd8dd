"""A local etcd and one leading coordinator on loopback, for the benches.

    with local_coordinator(state_dir, liveness_timeout_s=2) as server:
        ...  # server.address, server.coordinator

Extra keyword arguments are `CoordinatorConfig` fields. Raises TimeoutError
when the coordinator does not lead within 20 s; both are stopped on exit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from springback.cli.local import EtcdServer
from springback.service.transport.config import CoordinatorConfig
from springback.service.transport.server import CoordinatorServer

LEADERSHIP_TIMEOUT_S = 20


@contextmanager
def local_coordinator(state_dir: str | Path, **config: object) -> Iterator[CoordinatorServer]:
    etcd = EtcdServer(str(state_dir))
    etcd.start()
    try:
        server = CoordinatorServer(CoordinatorConfig(etcd=etcd.endpoint, listen="127.0.0.1:0",
                                                     **config))
        server.start()
        try:
            if not server.wait_for_leadership(timeout_s=LEADERSHIP_TIMEOUT_S):
                raise TimeoutError(
                    f"the coordinator did not become leader within {LEADERSHIP_TIMEOUT_S} s")
            yield server
        finally:
            server.stop(grace_s=0.5)
    finally:
        etcd.stop(kill=True)
