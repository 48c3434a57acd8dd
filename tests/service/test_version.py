"""`springback --version` names the installed distribution's one version."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import springback


def test_version_is_the_package_metadata_version():
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    (declared,) = re.findall(r'^version = "([^"]+)"', pyproject, re.M)
    assert springback.__version__ == metadata.version("springback") == declared
    out = subprocess.run([sys.executable, "-m", "springback.cli", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"springback {declared}"


def test_checkpoint_manifests_record_that_same_version():
    from springback.storage.manifest import library_versions

    assert library_versions()["springback"] == springback.__version__
