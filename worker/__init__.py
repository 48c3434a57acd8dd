"""Springback's worker side: the node agent (`springback run`) and the training
library a user's script imports (`Session`, `Generation`, `Batch`).

The library's names are loaded on first use: the node agent imports this
package too, and must not pay torch's import (seconds) before it starts its
ranks (worker/startup.py)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Batch", "Generation", "SampleStream", "Session"]

_HOME = {"Batch": "sampler", "SampleStream": "sampler", "Generation": "session",
         "Session": "session"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'springback.worker' has no attribute {name!r}")
    return getattr(importlib.import_module(f"springback.worker.{_HOME[name]}"), name)
