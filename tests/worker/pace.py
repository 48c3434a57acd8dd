"""How the test training scripts pace their steps.

``TINY_STEP_SLEEP_S`` slows each step so that a test's faults and joins land
mid-training. Once a test has seen its last fault, the slow steps left until
``max_steps`` are only waiting: the test creates the file named by
``TINY_FAST_FORWARD_FILE`` (the cluster fixture's ``fast_forward()``) and from
the next step on the scripts stop sleeping. Nothing else changes: the same
steps, samples and checkpoints, only sooner.

``TINY_HOLD_AT_STEP`` holds every rank after that step while the file named
by ``TINY_HOLD_FILE`` exists (the test removes it): a test that needs the job
still running when a slow event lands (a spare whose ranks start for half a
minute on a loaded machine) holds it at a step every rank reaches, so no rank
waits in a collective for a held one."""

from __future__ import annotations

import os
import time


class StepPace:
    """Reads the knobs once; `wait()` once a step."""

    def __init__(self) -> None:
        self.sleep_s = float(os.environ.get("TINY_STEP_SLEEP_S", "0"))
        self.fast_forward_file = os.environ.get("TINY_FAST_FORWARD_FILE", "")
        self.fast = False
        self.hold_at = int(os.environ.get("TINY_HOLD_AT_STEP", "0"))
        self.hold_file = os.environ.get("TINY_HOLD_FILE", "")

    def wait(self, step: int) -> None:
        """After `step` (every script passes it, so a hold is never ignored): holds while the hold file exists if it is the hold
        step, then sleeps the step's pause, unless the test has asked to
        fast-forward (then never again: the file is not read after it appears)."""
        if self.hold_at and step == self.hold_at:
            while os.path.exists(self.hold_file):
                time.sleep(0.05)  # the test's release is a file: polled
        if not self.sleep_s or self.fast:
            return
        if self.fast_forward_file and os.path.exists(self.fast_forward_file):
            self.fast = True
            return
        time.sleep(self.sleep_s)
