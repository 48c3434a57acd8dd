"""Fixtures of the worker tests. The helper modules beside this file are made
importable (pytest runs with --import-mode=importlib, which adds no paths)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from fakeplans import FakeJob  # noqa: E402


@pytest.fixture
def fake_job(tmp_path):
    job = FakeJob(tmp_path)
    yield job
    job.close()
