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

PRODUCT_LIVENESS_S = 5.0
"""The liveness timeout of the `coordinator` fixture in these tests: the
product's default. Their agents run real gloo ranks, two tests at a time on two
cores, and at the suite's 2 s a loaded agent's heartbeats were starved past its
lease several times (each a fence no test asked for: a WAIT generation, a lost
holder). A killed node is found here through its peers' failed collectives and
its closed plan stream (service/core/evidence.py), not through liveness; a test
that waits for a lease to expire (a stopped node) says so with
``@pytest.mark.liveness(2.0)``."""


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if Path(str(item.path)).is_relative_to(_HERE) and not item.get_closest_marker("liveness"):
            item.add_marker(pytest.mark.liveness(PRODUCT_LIVENESS_S))


@pytest.fixture
def fake_job(tmp_path):
    job = FakeJob(tmp_path)
    yield job
    job.close()
