"""Retry with exponential backoff for transient storage errors.

What counts as transient (retried): connection resets / refused / timeouts, HTTP 5xx
and throttling answers from S3-compatible stores (``SlowDown``, ``Throttling``,
``RequestTimeout``, ``InternalError``, ``ServiceUnavailable``), and aiohttp/botocore
connection errors. Everything else -- missing files, files a create-only write found, permissions, bad arguments --
fails at once. s3fs and botocore wrap and re-raise errors, so the whole
``__cause__``/``__context__`` chain is inspected.

A retried operation must be idempotent: callers pass a function that redoes the
whole unit of work (e.g. rewrites a whole file from staged memory), never a
partial continuation.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from springback.storage.errors import TransientStorageError

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
        "502",
        "504",
    }
)
_TRANSIENT_NAMES = frozenset(
    {
        # botocore
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
        # aiohttp
        "ServerDisconnectedError",
        "ClientOSError",
        "ClientConnectorError",
        "ClientPayloadError",
        "ServerTimeoutError",
    }
)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 16:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def is_transient(exc: BaseException) -> bool:
    """Return True if ``exc`` (or anything in its cause chain) is worth retrying."""
    for e in _chain(exc):
        if isinstance(e, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if type(e).__name__ in _TRANSIENT_NAMES:
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # botocore ClientError
            err = response.get("Error", {}) or {}
            status = (response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode", 0) or 0
            if str(err.get("Code", "")) in _TRANSIENT_CODES or int(status) >= 500 or int(status) == 429:
                return True
        text = str(e)
        if any(code in text for code in ("SlowDown", "ServiceUnavailable", "(503)", "(500)", "InternalError")):
            return True
    return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How hard to retry a transient storage error."""

    max_attempts: int = 8
    """Total tries, the first included."""
    initial_backoff_s: float = 0.05
    """Sleep before the second try; doubles each time, with +-50% jitter."""
    max_backoff_s: float = 5.0
    """Upper bound of one sleep."""
    deadline_s: float = 120.0
    """No new try starts after this many seconds since the first one."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.deadline_s <= 0:
            raise ValueError("RetryPolicy backoffs must be >= 0 and deadline_s > 0")


class RetryStats:
    """Thread-safe counter of retries, for metrics and tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.retries = 0
        self.gave_up = 0

    def _add(self, *, retries: int = 0, gave_up: int = 0) -> None:
        with self._lock:
            self.retries += retries
            self.gave_up += gave_up


def call_with_retry(
    fn: Callable[[], T],
    *,
    what: str,
    uri: str,
    policy: RetryPolicy,
    stats: RetryStats | None = None,
) -> T:
    """Call ``fn`` until it succeeds, a non-transient error occurs, or the policy runs out.

    Raises the original exception for non-transient errors, and
    :class:`TransientStorageError` (naming ``what`` and ``uri``, chained to the last
    error) when the retry budget is spent.
    """
    start = time.monotonic()
    backoff = policy.initial_backoff_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below
            if not is_transient(exc):
                raise
            elapsed = time.monotonic() - start
            if attempt >= policy.max_attempts or elapsed >= policy.deadline_s:
                if stats is not None:
                    stats._add(gave_up=1)
                raise TransientStorageError(
                    f"{what} {uri} failed after {attempt} attempts in {elapsed:.1f}s: {exc!r}", uri=uri
                ) from exc
            if stats is not None:
                stats._add(retries=1)
            sleep_s = min(policy.max_backoff_s, backoff) * random.uniform(0.5, 1.5)
            log.warning("transient error on %s %s (attempt %d), retrying in %.2fs: %r", what, uri, attempt, sleep_s, exc)
            time.sleep(sleep_s)
            backoff *= 2
