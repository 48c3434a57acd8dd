"""One way to wait for a condition with a deadline: `wait_until`.

Used wherever Springback polls something it cannot be notified of (a process
exiting, a file appearing, an election won, a store answering, done-records
landing on object storage). Polling, not sleeping for a fixed time: the wait
ends as soon as the condition holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], *, timeout_s: float, interval_s: float = 0.05,
               abandon: Callable[[], bool] | None = None) -> T | None:
    """Calls `condition` every `interval_s` until it returns a truthy value,
    which is returned; returns None once `timeout_s` (from now) has passed, or
    at once when `abandon()` turns true (checked before each call).

    `condition` is called at least once (also with `timeout_s` <= 0) and once
    more after the deadline's last sleep, so a condition that holds by the
    deadline is seen. What it raises propagates unchanged: a condition that
    finds waiting hopeless (the awaited process died) raises to end the wait.
    Blocks the calling thread; never longer than `timeout_s` + one
    `condition` call + `interval_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if abandon is not None and abandon():
            return None
        value = condition()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(interval_s, left))
