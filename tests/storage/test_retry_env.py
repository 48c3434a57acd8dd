"""The storage retry policy's environment knobs: read when a store is made,
and a bad value is refused naming the variable."""

from __future__ import annotations

import pytest

from springback.client.env import STORAGE_DEADLINE_S, STORAGE_MAX_ATTEMPTS
from springback.storage.retry import RetryPolicy
from springback.storage.store import ObjectStore

pytestmark = pytest.mark.timeout(30)


def test_a_store_takes_its_retry_budget_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(STORAGE_MAX_ATTEMPTS, "3")
    monkeypatch.setenv(STORAGE_DEADLINE_S, "2.5")
    store = ObjectStore(f"file://{tmp_path}")
    assert (store.retry.max_attempts, store.retry.deadline_s) == (3, 2.5)
    assert store.retry.max_backoff_s == RetryPolicy().max_backoff_s


@pytest.mark.parametrize("env, value", [(STORAGE_MAX_ATTEMPTS, "three"), (STORAGE_MAX_ATTEMPTS, "0"),
                                        (STORAGE_MAX_ATTEMPTS, "2.5"), (STORAGE_DEADLINE_S, "-1"),
                                        (STORAGE_DEADLINE_S, "soon")])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=env):
        RetryPolicy.from_env()
