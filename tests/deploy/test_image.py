"""The container image, built and run as a user would with Debian's podman.

No registry is reachable here, so the Dockerfile's Python base is made from
Debian's own packages (``debootstrap`` of bookworm, whose python3 is 3.11,
imported with ``podman import``) and torch comes from PyPI (its 2.13.0 wheel
is the CPU build). The image's coordinator (``springback up``, etcd from the
same Debian packages installed into the base) must answer a job submission
from the CLI outside the container.

First the test asks podman to start any container at all (``podman run
--rootfs / /bin/true``); where the machine cannot (the development VM:
crun's setrlimit is not permitted and its cgroups are in hybrid mode, see
docs/trainers.md), it is skipped with podman's own error. A soak: the build
downloads torch and takes minutes (``bash deploy/local/test.sh -m soak -k image``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sbtest import OPERATOR_TOKEN, wait_for

pytestmark = [pytest.mark.soak, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
BASE = "localhost/springback-base:bookworm"
IMAGE = "localhost/springback:test"
TOKEN = OPERATOR_TOKEN


def _run(*argv: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def _can_start_containers() -> str | None:
    """Why podman cannot start a container here, or None when it can."""
    if shutil.which("podman") is None:
        return "podman is not installed (apt install podman)"
    probe = _run("podman", "run", "--rm", "--rootfs", "/", "/bin/true", timeout=120)
    if probe.returncode != 0:
        return f"podman cannot start a container here: {probe.stderr.strip()[-400:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checked(result: subprocess.CompletedProcess, what: str) -> None:
    assert result.returncode == 0, f"{what} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def test_the_coordinator_starts_from_the_image_and_takes_a_job(tmp_path):
    why = _can_start_containers()
    if why is not None:
        pytest.skip(why)
    if shutil.which("debootstrap") is None:
        pytest.fail("debootstrap is missing (apt install debootstrap)")
    rootfs = tmp_path / "rootfs"
    _checked(_run("debootstrap", "--variant=minbase",
                  "--include=python3,python3-venv,etcd-server,passwd", "bookworm", str(rootfs)),
             "debootstrap")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(["podman", "import", "-", BASE], stdin=tar.stdout,
                              capture_output=True, text=True, timeout=600, check=False)
    tar.wait(timeout=600)
    _checked(imported, "podman import")
    _checked(_run("podman", "build", "--build-arg", f"PYTHON_IMAGE={BASE}",
                  "--build-arg", "TORCH_CPU_INDEX=https://pypi.org/simple",
                  "-t", IMAGE, str(ROOT)), "podman build")
    port = _free_port()
    name = f"springback-image-test-{port}"
    started = _run("podman", "run", "-d", "--rm", "--name", name, "-p", f"127.0.0.1:{port}:7070",
                   IMAGE, "up", "--listen", "0.0.0.0:7070", "--token", TOKEN,
                   "--state-dir", "/var/lib/springback",
                   timeout=120)
    _checked(started, "podman run")
    try:
        address = f"127.0.0.1:{port}"
        spec = tmp_path / "job.yaml"
        spec.write_text("name: from-image\ndata: {num_samples: 64, global_batch_size: 8}\n"
                        "max_steps: 4\n")
        cli = [sys.executable, "-m", "springback.cli", "job"]

        def submitted() -> bool:
            return _run(*cli, "submit", "--coordinator", address, "--token", TOKEN, str(spec),
                        timeout=30).returncode == 0

        wait_for(submitted, 120, "the image's coordinator to take a job")
        listed = _run(*cli, "list", "--coordinator", address, "--token", TOKEN, timeout=30)
        _checked(listed, "job list")
        assert "from-image" in listed.stdout
    finally:
        _run("podman", "logs", name, timeout=30)
        _run("podman", "stop", "-t", "5", name, timeout=60)
