"""The static checks of the test command: the import layering (import-linter,
contracts in pyproject.toml ``[tool.importlinter]``) and the type check (mypy,
``[tool.mypy]``), both over the source tree that deploy/local/source_tree.py
lays out (the checkers cannot follow pyproject's package-dir mapping)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "deploy", "local"))
import source_tree  # noqa: E402 (a dev tool, not a package)

BIN = os.path.dirname(sys.executable)


def _run(tree: str, *cmd: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": tree}
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=380)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> str:
    return source_tree.build(str(tmp_path_factory.mktemp("tree")))


@pytest.mark.timeout(180)
def test_imports_run_one_way_as_the_layer_contracts_say(tree: str) -> None:
    out = _run(tree, os.path.join(BIN, "lint-imports"), os.path.join(ROOT, "pyproject.toml"))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(400)
def test_the_source_type_checks(tree: str) -> None:
    # The cache lives in the worktree, so only the first run pays for torch's stubs.
    out = _run(tree, sys.executable, "-m", "mypy", "--config-file",
               os.path.join(ROOT, "pyproject.toml"), "--cache-dir",
               os.path.join(ROOT, ".mypy_cache"), "springback")
    assert out.returncode == 0, out.stdout + out.stderr
