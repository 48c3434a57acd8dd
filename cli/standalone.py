"""``springback run --standalone``: torchrun's single-node shortcut.

Starts what `springback up` starts (a local etcd and one coordinator), both on
free loopback ports with their state in a temporary directory, submits a
one-node job, and runs one agent against it; everything is stopped and
removed when the agent ends. The etcd is `springback up`'s secured one
(`springback.cli.etcd_credentials`): https on loopback with client
certificates and etcd's auth, the coordinator a user limited to
``/springback/``, its credentials made afresh in the temporary directory
(0700, files 0600), so no other local process can read or write the run's
job through etcd. The job succeeds when every rank exits 0
(restart mode) or the library's ``max_steps`` is reached (library mode).

Failure semantics: an etcd or coordinator that does not come up within
`START_TIMEOUT_S` raises RuntimeError before any rank starts; the agent's
exit status is the command's.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable

log = logging.getLogger("springback.agent")

START_TIMEOUT_S = 20.0
MAX_STEPS = 2**62
"""A standalone job has no step budget of its own: it ends with its ranks."""


def standalone_spec(name: str, nnodes: tuple[int, int] | None) -> dict:
    """The spec of the one-node job (min = max = 1; --nnodes must agree)."""
    if nnodes is not None and nnodes != (1, 1):
        raise ValueError(f"--standalone runs one node: --nnodes must be 1, got "
                         f"{nnodes[0]}:{nnodes[1]}")
    return {"name": name, "min_workers": 1, "max_workers": 1,
            "data": {"num_samples": 1, "global_batch_size": 1}, "max_steps": MAX_STEPS}


def run_standalone(name: str, nnodes: tuple[int, int] | None,
                   run_agent: Callable[[str, str], int]) -> int:
    """Brings up etcd + a coordinator, submits the job, returns
    ``run_agent(coordinator_address, job_id)``, then tears everything down."""
    from springback.client.api import Client
    from springback.cli.etcd_credentials import local_credentials
    from springback.cli.local import EtcdServer
    from springback.service.transport.config import CoordinatorConfig
    from springback.service.transport.server import CoordinatorServer

    spec = standalone_spec(name, nnodes)
    state_dir = tempfile.mkdtemp(prefix="springback-standalone-")
    credentials = f"{state_dir}/etcd-credentials"
    etcd: EtcdServer | None = None
    server: CoordinatorServer | None = None
    try:
        etcd = EtcdServer(f"{state_dir}/etcd", tls=local_credentials(credentials))
        etcd.start(timeout_s=START_TIMEOUT_S)
        server = CoordinatorServer(CoordinatorConfig(etcd=etcd.endpoint, listen="127.0.0.1:0",
                                                     etcd_security=etcd.client_security))
        server.start()
        if not server.wait_for_leadership(timeout_s=START_TIMEOUT_S):
            raise RuntimeError(f"the standalone coordinator did not lead within "
                               f"{START_TIMEOUT_S:.0f}s")
        with Client(server.address) as client:
            job = client.create_job(spec)
        log.info("standalone: etcd %s (credentials in %s), coordinator %s, job %s",
                 etcd.endpoint, credentials, server.address, job.id)
        return run_agent(server.address, job.id)
    finally:
        if server is not None:
            server.stop(grace_s=0.5)
        if etcd is not None:
            etcd.stop(kill=True)
        shutil.rmtree(state_dir, ignore_errors=True)
