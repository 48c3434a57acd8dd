"""The built wheel works without the checkout: `python -m build --wheel` of
the tracked tree, installed (no deps, no index) into a fresh venv whose
dependencies come from the test venv's site-packages (a .pth: its own .pth
files, the editable install's finder among them, are not processed), then
the installed CLI starts a coordinator on real etcd, submits and gets a job,
and every springback module imported lies in the fresh venv."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("build")

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.timeout(180)]

IMPORTS = """
import json, sys
import springback, springback.cli.main, springback.service.core.coordinator, springback.worker
import springback.integrations, springback.storage.resume
from springback.worker import Session
print(json.dumps({"file": springback.__file__, "modules": sorted(
    getattr(m, "__file__", None) or "" for n, m in sys.modules.items()
    if n == "springback" or n.startswith("springback."))}))
"""


def _tracked_copy(dest: Path) -> None:
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in files:
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def test_the_wheel_installed_in_a_fresh_venv_runs_the_cli_and_a_coordinator(tmp_path, etcd):
    src, out, venv, work = (tmp_path / d for d in ("src", "dist", "venv", "work"))
    for d in (src, work):
        d.mkdir()
    _tracked_copy(src)
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                    "--outdir", str(out), str(src)], check=True, capture_output=True,
                   timeout=120)
    wheel, = out.glob("springback-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=120)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # the API's sources ship beside the generated code (package-data)
    protos = sorted(p.name for p in Path(purelib, "springback", "v1").glob("*.proto"))
    assert protos == sorted(p.name for p in (REPO / "proto/springback/v1").glob("*.proto")), protos
    Path(purelib, "zz_springback_test_deps.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"

    def sb(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "springback"), *args], cwd=work, env=env,
                              capture_output=True, text=True, timeout=60, check=True)

    imported = json.loads(subprocess.run([str(python), "-c", IMPORTS], cwd=work, env=env,
                                         capture_output=True, text=True, check=True,
                                         timeout=60).stdout)
    assert imported["file"].startswith(str(venv)), imported["file"]
    outside = [f for f in imported["modules"] if not f.startswith(str(venv))]
    assert not outside, outside
    assert "coordinator" in sb("--help").stdout

    coordinator = subprocess.Popen(
        [str(venv / "bin" / "springback"), "--json", "coordinator", "--etcd", etcd.endpoint,
         "--listen", "127.0.0.1:0", "--drain-s", "0"], cwd=work, env=env,
        stdout=subprocess.PIPE, stderr=open(tmp_path / "coordinator.log", "wb"))
    try:
        line = coordinator.stdout.readline()  # the coordinator prints its address when serving
        assert line, (tmp_path / "coordinator.log").read_text()
        address = json.loads(line)["address"]
        spec = work / "job.json"
        spec.write_text(json.dumps({"name": "wheel", "min_workers": 1, "max_workers": 1,
                                    "data": {"num_samples": 64, "global_batch_size": 8},
                                    "max_steps": 10}))
        created = json.loads(sb("--json", "--coordinator", address, "job", "submit",
                                str(spec)).stdout)
        job_id = created.get("id") or created["job"]["id"]
        got = json.loads(sb("--json", "--coordinator", address, "job", "get", job_id).stdout)
        assert job_id in json.dumps(got) and "wheel" in json.dumps(got), got
    finally:
        coordinator.terminate()
        coordinator.wait(30)
