"""`springback up`: a local etcd plus a coordinator, for a laptop."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator

import etcd3
import psutil
import grpc
import pytest

from sbtest import scrape
from springback.client.api import Client
from springback.cli.local import free_port

pytestmark = pytest.mark.timeout(60)


def test_up_serves_jobs_and_stops_cleanly_on_sigterm(tmp_path, make_spec):
    up = subprocess.Popen(
        [sys.executable, "-m", "springback.cli", "up", "--state-dir", str(tmp_path),
         "--etcd-port", str(free_port()), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        lines = [up.stdout.readline().strip() for _ in range(3)]
        assert lines[0].startswith("etcd") and lines[1].startswith("coordinator"), lines
        export = lines[2]
        assert export.startswith("export SPRINGBACK_COORDINATOR="), lines
        address = export.split("=", 1)[1]
        with Client(address) as client:
            job = client.create_job(make_spec())
            assert client.get_job(job.id).id == job.id
        assert (tmp_path / "etcd" / "data").is_dir()
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0


def test_up_serves_metrics_when_asked(tmp_path, make_spec):
    up = subprocess.Popen(
        [sys.executable, "-m", "springback.cli", "up", "--state-dir", str(tmp_path),
         "--etcd-port", str(free_port()), "--listen", "127.0.0.1:0",
         "--metrics-listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        lines = [up.stdout.readline().strip() for _ in range(4)]
        assert lines[2].startswith("metrics     http://"), lines
        metrics = lines[2].split("http://", 1)[1].removesuffix("/metrics")
        with Client(lines[3].split("=", 1)[1]) as client:
            job = client.create_job(make_spec())
        samples = scrape(metrics)
        assert samples["springback_coordinator_is_leader"] == 1
        assert samples[f'springback_job_generations_total{{job="{job.id}"}}'] == 1
        assert samples[f'springback_job_recovery_seconds_count{{job="{job.id}"}}'] == 0
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0


def test_up_without_an_etcd_binary_says_how_to_get_one(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path), "SPRINGBACK_ETCD": ""}
    out = subprocess.run(
        [sys.executable, "-m", "springback.cli", "up", "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=30, env=env,
    )
    assert out.returncode == 2
    assert "no etcd binary" in out.stderr and "etcd-server" in out.stderr


def test_etcd_on_picked_ports_starts_again_when_one_was_taken_meanwhile(tmp_path):
    # the race CI met ("bind: address already in use"): a picked port is
    # taken by another process before etcd binds it
    import socket

    from springback.cli.local import EtcdServer

    etcd = EtcdServer(str(tmp_path / "etcd"))
    taken = etcd.client_port
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        etcd.start()
        try:
            assert etcd.client_port != taken
            assert "address already in use" in (tmp_path / "etcd" / "etcd.log").read_text()
            from springback.service.etcd.store import Store

            store = Store(etcd.endpoint)
            store.get("/springback/v1/ping")  # it serves, on the fresh port
            store.close()
        finally:
            etcd.stop()
    # ports the caller chose are not changed: the error names the cause
    chosen = EtcdServer(str(tmp_path / "chosen"), client_port=taken, peer_port=free_port())
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with pytest.raises(RuntimeError, match="address already in use"):
            chosen.start()


@contextlib.contextmanager
def _running_up(state_dir) -> Iterator[tuple[int, str, str]]:
    """`springback up` in `state_dir`: (etcd port, credentials dir, coordinator address)."""
    up = subprocess.Popen(
        [sys.executable, "-m", "springback.cli", "up", "--state-dir", str(state_dir),
         "--etcd-port", str(free_port()), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        lines = [up.stdout.readline().strip() for _ in range(3)]
        etcd = re.fullmatch(r"etcd +https://127\.0\.0\.1:(\d+) \(data in .*, credentials in (.*)\)",
                            lines[0])
        assert etcd, lines
        yield int(etcd.group(1)), etcd.group(2), lines[2].split("=", 1)[1]
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0


class TestUpsEtcdTakesOnlyItsCredentials:
    """The local etcd is on https:// with client certificates and etcd's auth:
    another local process cannot rewrite a job's spec through it (issue 44)."""

    def test_a_client_without_the_certificate_or_the_password_is_refused(self, tmp_path, make_spec):
        with _running_up(tmp_path) as (port, credentials, address):
            with Client(address) as client:
                job = client.create_job(make_spec())
                assert client.get_job(job.id).id == job.id
            key = f"/springback/v1/jobs/{job.id}/spec"
            ca = os.path.join(credentials, "ca.pem")
            cert = {"cert_cert": os.path.join(credentials, "client.pem"),
                    "cert_key": os.path.join(credentials, "client-key.pem")}
            # no client certificate: the TLS handshake fails (plain text too)
            for tls in ({}, {"ca_cert": ca}):
                with etcd3.client("127.0.0.1", port, timeout=3, **tls) as plain:
                    with pytest.raises(etcd3.exceptions.ConnectionFailedError):
                        plain.put(key, "max_steps: 1")
            # the certificate without user springback's password: etcd's auth refuses
            with etcd3.client("127.0.0.1", port, timeout=3, ca_cert=ca, **cert) as no_user:
                for attempt in (lambda: no_user.put(key, "max_steps: 1"), lambda: no_user.get(key)):
                    with pytest.raises(grpc.RpcError) as refused:
                        attempt()
                    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with Client(address) as client:
                assert client.get_job(job.id).spec.max_steps == job.spec.max_steps

    def test_credentials_are_private_and_a_second_start_reuses_them(self, tmp_path, make_spec):
        with _running_up(tmp_path) as (_, credentials, address):
            with Client(address) as client:
                job = client.create_job(make_spec())
        assert stat.S_IMODE(os.stat(credentials).st_mode) == 0o700
        names = sorted(os.listdir(credentials))
        assert names == ["ca.pem", "client-key.pem", "client.pem", "password",
                         "server-key.pem", "server.pem"]
        first = {}
        for name in names:
            path = os.path.join(credentials, name)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, name
            first[name] = open(path, "rb").read()
        with _running_up(tmp_path) as (_, again, address):
            assert again == credentials
            with Client(address) as client:
                assert client.get_job(job.id).id == job.id
        assert {name: open(os.path.join(credentials, name), "rb").read() for name in names} == first

    def test_credentials_others_can_read_are_refused_naming_the_state_dir(self, tmp_path):
        from springback.cli.etcd_credentials import local_credentials

        local_credentials(str(tmp_path / "etcd-credentials"))
        os.chmod(tmp_path / "etcd-credentials" / "password", 0o644)
        done = subprocess.run(
            [sys.executable, "-m", "springback.cli", "up", "--state-dir", str(tmp_path),
             "--etcd-port", str(free_port()), "--listen", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=30)
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert "state-dir: " in done.stderr and "has mode 644" in done.stderr, done.stderr
        assert not (tmp_path / "etcd").exists()  # no etcd was started

    def test_a_plain_etcd_from_before_is_taken_over_and_other_credentials_are_refused(self, tmp_path):
        from springback.cli.local import EtcdServer
        from springback.service.etcd.store import Store

        before = EtcdServer(str(tmp_path / "etcd"))  # the plain http etcd of an older `up`
        before.start()
        store = Store(before.endpoint)
        store.put("/springback/v1/kept", b"yes")
        store.close()
        before.stop()
        with _running_up(tmp_path) as (port, credentials, _):
            with open(os.path.join(credentials, "password")) as f:
                password = f.readline().strip()
            with etcd3.client("127.0.0.1", port, timeout=3, user="springback", password=password,
                              ca_cert=os.path.join(credentials, "ca.pem"),
                              cert_cert=os.path.join(credentials, "client.pem"),
                              cert_key=os.path.join(credentials, "client-key.pem")) as owner:
                assert owner.get("/springback/v1/kept")[0] == b"yes"
        with open(os.path.join(credentials, "password"), "w") as f:
            f.write("not-the-password\n")
        done = subprocess.run(
            [sys.executable, "-m", "springback.cli", "up", "--state-dir", str(tmp_path),
             "--etcd-port", str(free_port()), "--listen", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=30)
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert "made with other credentials" in done.stderr, done.stderr
        data = str(tmp_path / "etcd")  # the refused start left no etcd running on its data
        assert not [p.pid for p in psutil.process_iter(["cmdline"])
                    if any(data in arg for arg in p.info["cmdline"] or [])]
