"""Client retries spread out: exponential backoff with full jitter."""

from __future__ import annotations

import random

import pytest

from springback.client.channel import Backoff


class TestBackoff:
    def test_delays_grow_to_the_cap_and_start_over_after_a_success(self):
        ceilings: list[float] = []
        backoff = Backoff(base_s=0.1, cap_s=1.0, uniform=lambda lo, hi: ceilings.append(hi) or hi)
        for _ in range(6):
            backoff.next_s()
        assert ceilings == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
        backoff.reset()
        assert backoff.next_s() == pytest.approx(0.1)

    def test_clients_failing_together_retry_spread_over_the_window(self):
        rng = random.Random(7)
        fifth = [Backoff(0.1, 2.0, rng.uniform) for _ in range(1000)]
        samples = []
        for b in fifth:
            for _ in range(4):
                b.next_s()
            samples.append(b.next_s())  # the fifth retry: window [0, 1.6]
        assert all(0 <= s <= 1.6 for s in samples)
        # no herd: no 100 ms slice holds more than a fifth of the clients
        buckets = [sum(1 for s in samples if i / 10 <= s < (i + 1) / 10) for i in range(16)]
        assert max(buckets) < 200, buckets

    def test_a_bad_window_is_refused(self):
        with pytest.raises(ValueError, match="base_s"):
            Backoff(base_s=0, cap_s=1)
