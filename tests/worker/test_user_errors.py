"""A script's own exception inside ``with gen:`` is never taken for a
membership change, even when its message reads like a collective's."""

from __future__ import annotations

import time

import pytest
import torch

from springback.worker import Session

pytestmark = pytest.mark.timeout(60)


def test_a_users_runtime_error_that_reads_like_a_reset_connection_propagates_at_once():
    model = torch.nn.Linear(2, 1)
    session = Session(model=model, num_samples=8, global_batch_size=2, max_steps=4,
                      plan_wait_s=30)  # a membership change would wait this long for a plan
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="my check: Connection reset by peer"):
        for gen in session.generations():
            with gen:
                for _ in gen.batches():
                    raise RuntimeError("my check: Connection reset by peer")
    assert time.monotonic() - started < 10
