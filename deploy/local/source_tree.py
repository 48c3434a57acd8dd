"""Builds the import tree of the `springback` package for the static checkers.

pyproject.toml maps the package onto several top-level folders
(``[tool.setuptools] package-dir``: ``service/`` is ``springback.service``,
and so on). An installed or editable package imports fine, but import-linter
(grimp) and mypy walk folders and cannot follow that mapping, so this writes
the tree they expect -- real folders, each file a symbolic link to the
worktree's own -- under a directory of the caller's choosing.

``python deploy/local/source_tree.py DIR`` prints DIR; `check` runs
`lint-imports` or `mypy` there (used by tests/test_static_checks.py).
Idempotent: an existing tree under DIR is replaced.
"""

from __future__ import annotations

import os
import shutil
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def package_dirs(root: str = ROOT) -> dict[str, str]:
    """``{"springback.service": "<root>/service", ...}`` from pyproject.toml."""
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: os.path.join(root, folder) for name, folder in mapping.items()}


def build(out: str, root: str = ROOT) -> str:
    """Writes ``out/springback/...`` (links to the .py and .pyi files of each
    mapped package, not its sub-folders, which are packages of their own or
    none); returns `out`."""
    shutil.rmtree(os.path.join(out, "springback"), ignore_errors=True)
    for name, folder in package_dirs(root).items():
        target = os.path.join(out, *name.split("."))
        os.makedirs(target, exist_ok=True)
        for entry in sorted(os.listdir(folder)):
            if entry.endswith((".py", ".pyi")) or entry == "py.typed":
                os.symlink(os.path.join(folder, entry), os.path.join(target, entry))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: source_tree.py DIR")
    print(build(sys.argv[1]))
