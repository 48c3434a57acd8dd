"""The one retry policy of Springback's storage: exponential backoff with
jitter for transient errors, within an attempt budget and a deadline
(`RetryPolicy`), run by ``tenacity``.

It is the only layer that retries, and it retries each request on its own:
every `ObjectStore` call (GET, ranged GET, HEAD, PUT, LIST, DELETE) and every
ranged read of a restore's DCP reader (`springback.storage.dcpread`) is one
`call_with_retry`, so a fault costs one request, not the operation around it.
`ObjectStore` turns s3fs's and botocore's own retries off
(`LOWER_RETRIES_OFF`), so one fault costs one retry decision here and a
`RetryPolicy`'s numbers mean what they say. Retrying a whole DCP load on
every rank (`dcpread.collective_retry`) is left for what a request's retry
cannot fix, and counted apart (`RetryStats.collective_retries`).

What counts as transient (retried), by exception type and structured error
code, never by message text: connection resets / refusals / timeouts, HTTP 5xx
and 429, S3's throttling and availability codes (``SlowDown``, ``Throttling``,
``RequestTimeout``, ``InternalError``, ``ServiceUnavailable``, ...), botocore's
and aiohttp's connection errors (``EndpointConnectionError`` -- what aiobotocore
raises for a connection reset or refused --, closed connections, truncated
bodies), and a `TransientReadError` (a read a lower layer already classified).
Everything else -- missing files, files a create-only write found, permissions,
bad arguments, TLS certificate failures -- fails at once. s3fs translates
botocore errors into OSErrors raised from them, so the whole
``__cause__``/``__context__`` chain is inspected; a DCP ``CheckpointException``
(every rank's failures in one dict) is transient only when every failure in it
is.

A retried operation must be idempotent: callers pass a function that redoes the
whole unit of work (e.g. rewrites a whole file from staged memory), never a
partial continuation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import tenacity

from springback.client import env as E
from springback.storage.errors import TransientReadError, TransientStorageError

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
    "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
})


@functools.cache
def _transient_types() -> tuple[type[BaseException], ...]:
    # Imported on first use: every rank imports storage, few ever classify an S3 error.
    import aiohttp
    import botocore.exceptions

    return (
        ConnectionError,
        TimeoutError,
        TransientReadError,
        # EndpointConnectionError (aiobotocore's name for a reset or refused connection),
        # connect timeouts, proxy connection errors
        botocore.exceptions.ConnectionError,
        botocore.exceptions.HTTPClientError,  # read timeouts, closed connections, streaming errors
        botocore.exceptions.IncompleteReadError,
        aiohttp.ClientConnectionError,  # server disconnected, connector and OS errors
        aiohttp.ClientPayloadError,
    )


@functools.cache
def _permanent_types() -> tuple[type[BaseException], ...]:
    import botocore.exceptions

    return (
        FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
        botocore.exceptions.SSLError,  # a certificate that does not verify stays so: fail clearly
    )


@functools.cache
def _checkpoint_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException

LOWER_RETRIES_OFF = {"retries": {"total_max_attempts": 1, "mode": "standard"}}
"""botocore ``config_kwargs`` that make it try once (this module retries).
``total_max_attempts``, not ``max_attempts``: botocore reads the latter as
*retries* (one more than asked), and that retry, after a random wait of up to
a second, hid a fault from this module's policy and its counters."""


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 16:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _transient_client_error(e: BaseException) -> bool:
    import botocore.exceptions

    if not isinstance(e, botocore.exceptions.ClientError):
        return False
    error = e.response.get("Error", {}) or {}
    status = int((e.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode", 0) or 0)
    return str(error.get("Code", "")) in _TRANSIENT_CODES or status >= 500 or status == 429


def is_transient(exc: BaseException, *, _depth: int = 0) -> bool:
    """True if ``exc`` (or anything in its cause chain) is worth retrying; a
    permanent error met first in the chain (e.g. FileNotFoundError) wins.

    A DCP ``CheckpointException`` met in the chain is transient when it lists
    failures and every one of them is (each with its own chain, nested ones
    included): one rank's missing file makes the whole load permanent. Note
    that DCP pickles the failures of other ranks, which drops their cause
    chains: readers classify before that (`TransientReadError`).
    """
    for e in _chain(exc):
        if isinstance(e, _permanent_types()):
            return False
        if isinstance(e, _checkpoint_exception()):
            failures = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
            return bool(failures) and _depth < 4 and all(
                isinstance(f, BaseException) and is_transient(f, _depth=_depth + 1) for f in failures)
        if isinstance(e, _transient_types()) or _transient_client_error(e):
            return True
    return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How hard to retry a transient storage error."""

    max_attempts: int = 8
    """Total tries, the first included."""
    initial_backoff_s: float = 0.05
    """Scale of the sleep before the second try; the bound doubles each try
    (up to `max_backoff_s`) and each sleep is drawn at random below it
    ("full jitter", so ranks retrying together spread out)."""
    max_backoff_s: float = 5.0
    """Upper bound of one sleep."""
    deadline_s: float = 120.0
    """No new try starts after this many seconds since the first one."""

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """The default policy, with what the environment sets
        (`E.STORAGE_MAX_ATTEMPTS`, `E.STORAGE_DEADLINE_S`: e.g. an operator who wants a
        restore to give up on an unavailable store sooner, so the job shows it
        waiting for storage sooner). A value that is not a number, or out of
        range, raises ValueError naming the variable."""
        kwargs: dict[str, float | int] = {}
        for env, field, kind in ((E.STORAGE_MAX_ATTEMPTS, "max_attempts", int),
                                 (E.STORAGE_DEADLINE_S, "deadline_s", float)):
            text = os.environ.get(env, "").strip()
            if not text:
                continue
            try:
                kwargs[field] = kind(text)
            except ValueError:
                raise ValueError(f"{env}={text!r} is not a {kind.__name__}") from None
            if not kwargs[field] > 0:
                raise ValueError(f"{env}={text!r} must be positive")
        return cls(**kwargs)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.deadline_s <= 0:
            raise ValueError("RetryPolicy backoffs must be >= 0 and deadline_s > 0")


class RetryStats:
    """Thread-safe counters of retries, for metrics and tests.

    ``retries``: requests tried again (`call_with_retry`); ``collective_retries``:
    whole units (a DCP load) tried again on every rank (`dcpread.collective_retry`,
    counted on the group's rank 0); ``gave_up``: either kind that ran out of budget.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.retries = 0
        self.collective_retries = 0
        self.gave_up = 0

    def _add(self, *, retries: int = 0, collective_retries: int = 0, gave_up: int = 0) -> None:
        with self._lock:
            self.retries += retries
            self.collective_retries += collective_retries
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
    error) when the retry budget (attempts or deadline) is spent. Blocks the
    calling thread for the backoff sleeps.
    """

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if stats is not None:
            stats._add(retries=1)
        log.warning("transient error on %s %s (attempt %d), retrying in %.2fs: %r", what, uri,
                    state.attempt_number, state.upcoming_sleep,
                    state.outcome.exception() if state.outcome else None)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        stop=(tenacity.stop_after_attempt(policy.max_attempts)
              | tenacity.stop_after_delay(policy.deadline_s)),
        wait=tenacity.wait_random_exponential(multiplier=policy.initial_backoff_s,
                                              max=policy.max_backoff_s),
        before_sleep=before_sleep,
    )
    start = time.monotonic()
    try:
        return retrying(fn)
    except tenacity.RetryError as e:
        exc = e.last_attempt.exception()
        if stats is not None:
            stats._add(gave_up=1)
        raise TransientStorageError(
            f"{what} {uri} failed after {e.last_attempt.attempt_number} attempts in "
            f"{time.monotonic() - start:.1f}s: {exc!r}", uri=uri) from exc
