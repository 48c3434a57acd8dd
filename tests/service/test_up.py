"""`springback up`: a local etcd plus a coordinator, for a laptop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

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
            from springback.service.store import Store

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
