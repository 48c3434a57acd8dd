"""Preemption notices: where a node agent learns that its machine is going away.

A source is anything with ``poll() -> str | None`` returning a reason once the
notice is given. The agent polls every source a few times per second and turns
the first notice (or SIGTERM) into a drain. A cloud metadata poller (e.g. the
spot interruption endpoint) belongs behind the same interface; it must not
block longer than ~100 ms per poll.
"""

from __future__ import annotations

import os
from typing import Protocol


class PreemptionSource(Protocol):
    def poll(self) -> str | None:
        """A reason once preemption is announced, else None. Must not block."""


class FileNotice:
    """Preempted once `path` exists (e.g. written by a node-termination handler)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def poll(self) -> str | None:
        if os.path.exists(self.path):
            try:
                with open(self.path, encoding="utf-8", errors="replace") as f:
                    text = f.read(200).strip()
            except OSError:
                text = ""
            return f"preemption notice {self.path}" + (f": {text}" if text else "")
        return None
