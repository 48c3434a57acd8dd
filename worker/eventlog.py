"""The step and generation event log that global rank 0 writes when
`SPRINGBACK_METRICS_FILE` is set: one JSON object per line (an event log, not
metrics: the Prometheus families are `worker/rankstats.py`'s).

Events: ``{"event": "step", "t", "generation", "world_size", "step", "loss"}``
after every step, and ``{"event": "generation", "t", "generation",
"world_size", "step", "source_rank", "formed_s", "reason"}`` when a generation
starts (``source_rank`` -1: state already identical in memory). The demo, the
recovery bench and the tests read it to time recoveries and follow the loss.
Appends are single writes; a reader ignores a torn last line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from springback.client.env import METRICS_FILE


def append(record: dict) -> None:
    """Appends `record` with a wall-clock ``t`` if the metrics file is configured."""
    path = os.environ.get(METRICS_FILE)
    if not path:
        return
    line = json.dumps({"t": time.time(), **record}) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def read(path: str | Path) -> list[dict]:
    """Every complete event in `path` (none if it does not exist yet)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return out
