"""Springback: fault-tolerant, elastic training for PyTorch.

The package root re-exports the Python client (`Client`, and `ApiError`, which
every failed call raises; `InvalidSpec` is the ApiError of a spec refused
before sending); the generated API lives in
``springback.v1``, the client and what every side shares in
``springback.client``, the coordinator in ``springback.service``, the node
agent and training library in ``springback.worker``, checkpoints in
``springback.storage`` and the command line in ``springback.cli``.
"""

from __future__ import annotations

from importlib import metadata as _metadata

try:  # one version, the installed distribution's (pyproject.toml)
    __version__ = _metadata.version("springback")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

__all__ = ["ApiError", "Client", "InvalidSpec", "__version__"]


def __getattr__(name: str):
    # Imported lazily so `import springback.worker` in a training script does not
    # pull the whole client in.
    if name in ("ApiError", "Client", "InvalidSpec"):
        from springback.client import api

        return getattr(api, name)
    raise AttributeError(f"module 'springback' has no attribute {name!r}")
