"""When the ranks of a restart-mode generation must stop, agreed by all of them.

The agent stops a generation's ranks with SIGTERM (a new plan came: a join, a
lost node, a drain of another node; ``STOP_GRACE_S`` later SIGKILL), and a
draining node's agent also writes the ``drain`` marker into the control
directory before it asks the coordinator to plan the node out. `DrainWatch`
turns either into a flag, and `agreed` all-reduces it at a step boundary so
every rank checkpoints the same step and stops there.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

from springback.client import env as E
from springback.worker.control import DRAIN_FILE

log = logging.getLogger(__name__)

DRAINED_EXIT_CODE = 128 + signal.SIGTERM
"""What a rank exits with after its drain checkpoint: as if SIGTERM had
killed it. In restart mode exiting 0 would read as "the job is done"."""


class DrainWatch:
    """SIGTERM (and the agent's drain marker) as a flag the ranks agree on.

    `install` replaces the handlers of `signals` (main thread only; elsewhere
    it does nothing and only the marker is seen); `uninstall` puts the
    previous ones back. Not re-entrant; one per process."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self._received: str | None = None
        self._previous: dict[int, Any] = {}
        control_dir = os.environ.get(E.CONTROL_DIR, "")
        self._marker = os.path.join(control_dir, DRAIN_FILE) if control_dir else ""

    def install(self) -> None:
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._received = signal.Signals(signum).name

    def local_reason(self) -> str | None:
        """Why this rank should stop (a signal, the drain marker), else None. A stat."""
        if self._received:
            return f"signal {self._received}"
        if self._marker and os.path.exists(self._marker):
            return "node draining"
        return None

    def agreed(self) -> str | None:
        """Collective when torch.distributed is initialized with more than one
        rank (every rank calls it at the same step): a reason when any rank
        has one, else None. A peer that died makes the all-reduce raise, as
        the next gradient all-reduce would."""
        import torch
        import torch.distributed as dist

        reason = self.local_reason()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return reason
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
        flag = torch.tensor([1 if reason else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not reason:
            return "a peer rank was told to stop"
        return reason
