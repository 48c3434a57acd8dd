"""`springback run --standalone`'s etcd is `springback up`'s secured one
(issue 44): while a standalone run trains, a local etcd client without the
run's generated credentials is refused (no certificate: the TLS handshake
fails; the certificate without user springback's password: PERMISSION_DENIED),
and the run still trains to the end. A real `springback run --standalone`,
its etcd, coordinator, agent and rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import etcd3
import grpc
import pytest
from sbtest import wait_for

pytestmark = pytest.mark.timeout(120)

RANK = """\
import os, pathlib, time
run = pathlib.Path(os.environ["RUN_DIR"])
(run / "started").write_text(os.environ["TORCHELASTIC_RUN_ID"])
while not (run / "go").exists():
    time.sleep(0.05)
"""
"""An unmodified (restart-mode) script: says it runs, then waits for the test."""

STARTED = re.compile(r"standalone: etcd https?://127\.0\.0\.1:(\d+) \(credentials in (\S+)\), "
                     r"coordinator (\S+), job (\S+)")


def test_a_plain_etcd_client_is_refused_while_a_standalone_run_trains_to_the_end(tmp_path: Path):
    script = tmp_path / "wait_for_go.py"
    script.write_text(RANK)
    log_path = tmp_path / "standalone.log"
    with open(log_path, "wb") as log:
        run = subprocess.Popen(
            [sys.executable, "-m", "springback.cli", "run", "--standalone", "--mode", "restart",
             "--", sys.executable, str(script)],
            env={**os.environ, "RUN_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"},
            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (tmp_path / "started").exists(), 60, "the rank to start")
        found = STARTED.search(log_path.read_text(errors="replace"))
        assert found, log_path.read_text(errors="replace")
        port, credentials, job_id = int(found.group(1)), found.group(2), found.group(4)
        assert (tmp_path / "started").read_text() == job_id
        key = f"/springback/v1/jobs/{job_id}/spec"
        ca = os.path.join(credentials, "ca.pem")
        # no client certificate (plain text, or TLS without one): the handshake fails
        for tls in ({}, {"ca_cert": ca}):
            with etcd3.client("127.0.0.1", port, timeout=3, **tls) as plain:
                with pytest.raises(etcd3.exceptions.ConnectionFailedError):
                    plain.put(key, "max_steps: 1")
        # the certificate without user springback's password: etcd's auth refuses
        with etcd3.client("127.0.0.1", port, timeout=3, ca_cert=ca,
                          cert_cert=os.path.join(credentials, "client.pem"),
                          cert_key=os.path.join(credentials, "client-key.pem")) as no_user:
            for attempt in (lambda: no_user.put(key, "max_steps: 1"), lambda: no_user.get(key)):
                with pytest.raises(grpc.RpcError) as refused:
                    attempt()
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        (tmp_path / "go").touch()
        assert run.wait(timeout=60) == 0, log_path.read_text(errors="replace")
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert not os.path.exists(credentials)  # removed with the run's temporary directory
