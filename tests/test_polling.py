"""`springback.client.polling.wait_until`: the one poll-until-deadline helper."""

from __future__ import annotations

import time

import pytest

from springback.client.polling import wait_until


def test_it_returns_the_first_truthy_value_as_soon_as_the_condition_holds():
    calls = []
    assert wait_until(lambda: calls.append(1) or (len(calls) >= 3 and "ready"),
                      timeout_s=5, interval_s=0.001) == "ready"
    assert len(calls) == 3


def test_it_returns_none_at_the_deadline_having_checked_up_to_it():
    started = time.monotonic()
    checked_at: list[float] = []
    assert wait_until(lambda: checked_at.append(time.monotonic()), timeout_s=0.2,
                      interval_s=0.05) is None
    assert 0.2 <= checked_at[-1] - started < 2 and len(checked_at) >= 3


def test_it_checks_once_even_without_time_left():
    assert wait_until(lambda: 7, timeout_s=0) == 7
    assert wait_until(lambda: 0, timeout_s=-1) is None


def test_abandon_ends_the_wait_at_once_and_a_raising_condition_propagates():
    started = time.monotonic()
    assert wait_until(lambda: False, timeout_s=30, abandon=lambda: True) is None
    assert time.monotonic() - started < 1
    with pytest.raises(RuntimeError, match="process died"):
        wait_until(lambda: (_ for _ in ()).throw(RuntimeError("process died")), timeout_s=30)
