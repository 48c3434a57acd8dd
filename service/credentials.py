"""Member credentials: a bearer credential bound to one member of one job.

The coordinator's operator token opens every call. A member (a node agent
that joined, and the ranks it starts) needs only its own member's calls, so
`JoinJob` hands it a credential of its own::

    sbm1.<job id>.<member id>.<HMAC-SHA256 of "<job id>/<member id>">

keyed by a key derived from the operator token, so every replica (they share
the token) issues and checks the same credentials with nothing stored: no
etcd key to steal, nothing to replicate. `BearerAuth` (interceptors.py)
lets such a credential make only `MEMBER_METHODS`, and only with the
``job_id`` and ``member_id`` it names; anything else is PERMISSION_DENIED,
naming the role that would be needed. Changing the operator token revokes
every member credential at once (members then fail UNAUTHENTICATED and their
agents must join again). Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac

PREFIX = "sbm1"

MEMBER_METHODS = frozenset(f"/springback.v1.WorkerService/{name}" for name in (
    "Heartbeat", "LeaveJob", "DrainMember", "WatchPlans", "ReportStep", "ReportFailure",
    "CommitCheckpoint", "ReportCheckpointError"))
"""The calls a member credential may make: each request names its job and member."""


def _key(operator_token: str) -> bytes:
    return hmac.new(operator_token.encode(), b"springback member credential v1",
                    hashlib.sha256).digest()


def _mac(operator_token: str, job_id: str, member_id: str) -> str:
    return hmac.new(_key(operator_token), f"{job_id}/{member_id}".encode(),
                    hashlib.sha256).hexdigest()


def issue(operator_token: str, job_id: str, member_id: str) -> str:
    """The credential of member `member_id` of job `job_id`. Raises ValueError
    for an id with a ``.`` (ids are ``[a-z0-9-]``) or an empty one."""
    for field, value in (("job_id", job_id), ("member_id", member_id)):
        if not value or "." in value:
            raise ValueError(f"{field} {value!r} cannot be bound in a member credential")
    return f"{PREFIX}.{job_id}.{member_id}.{_mac(operator_token, job_id, member_id)}"


def member_of(operator_token: str, credential: str) -> tuple[str, str] | None:
    """(job id, member id) of a valid member credential, None for anything
    else (not one, or forged: compared in constant time)."""
    parts = credential.split(".")
    if len(parts) != 4 or parts[0] != PREFIX or not parts[1] or not parts[2]:
        return None
    _, job_id, member_id, mac = parts
    if not hmac.compare_digest(mac.encode(), _mac(operator_token, job_id, member_id).encode()):
        return None
    return job_id, member_id
