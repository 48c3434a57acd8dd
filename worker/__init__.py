"""Springback's worker side, in rooms named for where their code runs:

* `agent` — the node agent process (``springback run``): membership, plans,
  rank supervision. No torch, no training library.
* `train` — inside a rank: the training library a user's script imports
  (`Session`, `Generation`, `Batch`), the step boundary, the state agreement,
  sampling, reporting, checkpoint hooks.
* `state` — the sharded state inside a rank: meshes, the in-memory reshard,
  peer copies.
* `rank` — what every rank process stands on: its context, process groups
  (rendezvous), device and RNG state.
* the modules at this level (`control`, `rankstats`, `eventlog`) are the files
  agent and ranks share: plans, statistics, events.

The library's names are loaded on first use: the node agent imports this
package too, and must not pay torch's import (seconds) before it starts its
ranks (agent/startup.py)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Batch", "Generation", "SampleStream", "Session", "expert_mesh", "stage_layers"]

_HOME = {"Batch": "train.sampler", "SampleStream": "train.sampler",
         "Generation": "train.generation", "Session": "train.session",
         "expert_mesh": "state.mesh", "stage_layers": "state.mesh"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'springback.worker' has no attribute {name!r}")
    return getattr(importlib.import_module(f"springback.worker.{_HOME[name]}"), name)
