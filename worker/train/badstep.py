"""The bad-step policy (spec ``controls.bad_step``, docs/controls.md): a step
whose loss or gradient is not finite on any rank, or (with
``loss_spike_factor``) whose loss on a rank spikes above that factor times
the median of the rank's recent losses, is not applied.

The script asks before its optimizer step (`Generation.check_step`). Each
rank checks its own loss and the gradients of its registered modules
(`locally_bad`); the verdict travels in that step's vote (`boundary.Vote.bad`,
MAX over the ranks), so every rank gets the same answer and skips the
optimizer step alike: the state after the step is bit for bit the state
before it, the step counts as taken (its batch is consumed, recorded as
skipped in the audit), and a checkpoint of that step holds the state of the
last step that passed.

The spike rule judges each rank's own loss against the median of that
rank's losses over its last ``loss_window_steps`` applied steps (a skipped
step's loss never enters it, so a run of spikes is judged against the
healthy past). It judges only once that window is full, and only with a
positive median: a rank's first ``loss_window_steps`` steps of its session
(a joiner's too) and a loss whose median is zero or negative are never
called spikes.

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

import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable

import torch

from springback.v1 import types_pb2 as pb

log = logging.getLogger(__name__)


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
        self.losses: deque[float] = deque()
        """This rank's losses of its last applied steps (the spike rule's
        window), oldest first."""

    def spiked(self, step: int, loss: float | None, policy: pb.BadStepPolicy) -> bool:
        """Whether this rank's finite `loss` is above ``loss_spike_factor``
        times the median of its window (a full window with a positive
        median; the rule off: never). Logs the figures when it is."""
        if not policy.loss_spike_factor or loss is None or not math.isfinite(loss):
            return False
        if len(self.losses) < policy.loss_window_steps:
            return False
        median = statistics.median(self.losses)
        if median <= 0 or loss <= policy.loss_spike_factor * median:
            return False
        log.warning("step %d: this rank's loss %.6g is above %g x the median %.6g of its last "
                    "%d applied steps (controls.bad_step.loss_spike_factor)", step, loss,
                    policy.loss_spike_factor, median, len(self.losses))
        return True

    def applied(self, loss: float | None, policy: pb.BadStepPolicy) -> None:
        """Notes the loss of a step the ranks agreed to apply (a finite one
        only) in the spike rule's window."""
        if policy.loss_spike_factor and loss is not None and math.isfinite(loss):
            self.losses.append(loss)
            while len(self.losses) > policy.loss_window_steps:
                self.losses.popleft()

    def record(self, step: int, policy: pb.BadStepPolicy) -> str | None:
        """Records that the ranks agreed not to apply `step`; returns the
        reason to pause when ``max_in_window`` skipped steps now fall within
        the last ``window_steps`` steps, else None."""
        self.steps = [s for s in self.steps if s > step - policy.window_steps] + [step]
        if len(self.steps) < policy.max_in_window:
            return None
        return (f"controls.bad_step: {len(self.steps)} steps with a non-finite loss or gradient"
                f"{' or a loss spike' if policy.loss_spike_factor else ''} within the last {policy.window_steps} steps (steps "
                f"{', '.join(map(str, self.steps))}; none applied, their batches skipped), "
                f"the limit is {policy.max_in_window} (controls.bad_step.max_in_window): paused")
