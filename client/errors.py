"""The one exception hierarchy of the coordinator, and its mapping to gRPC codes.

Transport-free code raises these; `servicers` maps them to status codes in one
place (`grpc_code`). Anything else that escapes a handler is a bug and becomes
INTERNAL.
"""

from __future__ import annotations

import grpc


class SpringbackError(Exception):
    """Base of every expected coordinator error."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(SpringbackError, ValueError):
    """Bad input: a spec field, an RPC field, a config value. Changes nothing."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class NotFound(SpringbackError):
    """An unknown job, member or checkpoint."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(SpringbackError):
    """The request is valid but not now: an illegal transition."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleGeneration(FailedPrecondition):
    """A report carries a generation other than the job's current one (fenced)."""

    def __init__(self, job_id: str, reported: int, current: int) -> None:
        super().__init__(
            f"job {job_id}: report from generation {reported} rejected, "
            f"current generation is {current}"
        )
        self.reported = reported
        self.current = current


class Conflict(SpringbackError):
    """A compare-and-swap in etcd lost to a concurrent writer; retry."""

    code = grpc.StatusCode.ABORTED


class NotLeader(SpringbackError):
    """This replica lost (or never had) leadership; the caller should retry."""

    code = grpc.StatusCode.UNAVAILABLE


class StoreUnavailable(SpringbackError):
    """etcd could not be reached within the deadline."""

    code = grpc.StatusCode.UNAVAILABLE


def grpc_code(error: BaseException) -> grpc.StatusCode:
    """The status code for an exception; INTERNAL for anything unexpected."""
    if isinstance(error, SpringbackError):
        return error.code
    return grpc.StatusCode.INTERNAL
