"""The bad-step policy (spec ``controls.bad_step``, docs/controls.md): a step
whose loss or gradient is not finite on any rank is not applied.

The script asks before its optimizer step (`Generation.check_step`). Each
rank checks its own loss and the gradients of its registered modules
(`locally_bad`); the verdict travels in that step's vote (`boundary.Vote.bad`,
MAX over the ranks), so every rank gets the same answer and skips the
optimizer step alike: the state after the step is bit for bit the state
before it, the step counts as taken (its batch is consumed, recorded as
skipped in the audit), and a checkpoint of that step holds the state of the
last step that passed.

`BadSteps` keeps the skipped steps of the rank's session: once
``max_in_window`` of them fall within the last ``window_steps`` steps the job
must pause, and the reason names the steps. Rank 0 reports it to the
coordinator (`StepReporter.report_pause`); until the pause reaches the ranks
they go on, skipping what is bad. Without a coordinator (a standalone run,
hand-written plans) `check_step` raises `BadStepLimit` on every rank instead.
A rank that joined later has a shorter memory: the window counts the steps
that rank 0 saw.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from springback.v1 import types_pb2 as pb


class BadStepLimit(Exception):
    """Too many bad steps in the window and no coordinator to pause the job.
    Not a RuntimeError: never taken for a membership change."""


def locally_bad(loss: float | None, modules: Iterable[torch.nn.Module]) -> bool:
    """Whether this rank's `loss` (None: this rank computes none, e.g. an
    earlier pipeline stage) or any gradient its `modules` hold (a sharded
    one: this rank's shard) is NaN or infinite. One pass over the
    gradients, one device sync."""
    if loss is not None and not math.isfinite(loss):
        return True
    grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    # a DTensor's gradient: this rank's shard (its peers check theirs)
    checks = [torch.isfinite(g.to_local() if hasattr(g, "to_local") else g).all()
              for g in grads]
    return bool(checks) and not bool(torch.stack(checks).all())


class BadSteps:
    """The skipped steps of one rank's session and the pause rule over them."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        """Skipped steps, oldest first (the window's only)."""
        self.reported = False
        """Rank 0's pause was taken by the coordinator (not sent again)."""

    def record(self, step: int, policy: pb.BadStepPolicy) -> str | None:
        """Records that the ranks agreed not to apply `step`; returns the
        reason to pause when ``max_in_window`` skipped steps now fall within
        the last ``window_steps`` steps, else None."""
        self.steps = [s for s in self.steps if s > step - policy.window_steps] + [step]
        if len(self.steps) < policy.max_in_window:
            return None
        return (f"controls.bad_step: {len(self.steps)} steps with a non-finite loss or gradient "
                f"within the last {policy.window_steps} steps (steps "
                f"{', '.join(map(str, self.steps))}; none applied, their batches skipped), "
                f"the limit is {policy.max_in_window} (controls.bad_step.max_in_window): paused")
