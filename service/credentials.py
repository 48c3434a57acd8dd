"""Member credentials: a bearer credential bound to one member of one job.

The coordinator's operator token opens every call. A member (a node agent
that joined, and the ranks it starts) needs only its own member's calls, so
`JoinJob` hands it a credential of its own::

    sbm1.<job id>.<member id>.<HMAC-SHA256 of "<job id>/<member id>">

keyed by a key derived from the operator token (`derive_key`: HKDF-SHA256,
one key per kind of credential, so a MAC of one kind never verifies as
another's, whatever the ids), so every replica (they share
the token) issues and checks the same credentials with nothing stored: no
etcd key to steal, nothing to replicate. `BearerAuth` (interceptors.py)
lets such a credential make only `MEMBER_METHODS`, and only with the
``job_id`` and ``member_id`` it names; anything else is PERMISSION_DENIED,
naming the role that would be needed. Changing the operator token revokes
every member credential at once (members then fail UNAUTHENTICATED and their
agents must join again).

An agent needs to join before it is a member. The operator hands each job's
agents that job's join credential (``IssueJoinCredential``, `springback job
join-credential`)::

    sbj1.<job id>.<HMAC-SHA256 of "<job id>", under the join key>

It makes only `JOIN_METHODS`, and only for the job it names: a node running
agents of job A, whatever its ranks read from the agent, can join A (as any
agent could) and read A, nothing of job B and no job control. After joining
the agent calls with its member credential.

Replicas call each other too (`streamnotes` relays plan-stream notes to the
leader with ``ReportPlanStreams``). They do so with the replica credential::

    sbr1.<HMAC-SHA256 of "replica", under the replica key>

which every replica derives from the operator token, so every replica
computes (and checks) the same one. It opens only `REPLICA_METHODS`; those
are open to nothing else, the operator token included (least privilege: an
operator has no reason to forge what replicas tell each other). Pure
functions, no I/O.
"""

from __future__ import annotations

import functools
import hashlib
import hmac

PREFIX = "sbm1"
JOIN_PREFIX = "sbj1"
REPLICA_PREFIX = "sbr1"

MEMBER_METHODS = frozenset(f"/springback.v1.WorkerService/{name}" for name in (
    "Heartbeat", "LeaveJob", "DrainMember", "WatchPlans", "ReportStep", "ReportFailure",
    "CommitCheckpoint", "ReportCheckpointError"))
"""The calls a member credential may make: each request names its job and member."""

JOIN_METHODS = frozenset({"/springback.v1.WorkerService/JoinJob",
                          "/springback.v1.JobService/GetJob"})
"""The calls a join credential may make: each request names its job."""

REPLICA_METHODS = frozenset({"/springback.v1.WorkerService/ReportPlanStreams"})
"""The calls only replicas make (to the leader), with the replica credential
or a client certificate mapped to the replica role."""


KINDS = ("member", "join", "replica")
"""The kinds of credential derived from the operator token, one key each."""
HKDF_SALT = b"springback credentials v2"


def hkdf_sha256(secret: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF (RFC 5869) with SHA-256: extract a pseudorandom key from `secret`
    under `salt`, expand it to `length` bytes bound to `info`."""
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    okm, block = b"", b""
    for counter in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        okm += block
    return okm[:length]


@functools.lru_cache(maxsize=16)
def derive_key(operator_token: str, kind: str) -> bytes:
    """The HMAC key of credentials of `kind` (one of `KINDS`): HKDF-SHA256
    of the operator token, ``info`` naming the kind, so each kind has a key
    of its own. Cached: every member call checks a credential. Raises
    ValueError for an unknown kind."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    return hkdf_sha256(operator_token.encode(), HKDF_SALT, f"springback/{kind}".encode())


def _mac(operator_token: str, job_id: str, member_id: str) -> str:
    return hmac.new(derive_key(operator_token, "member"), f"{job_id}/{member_id}".encode(),
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


def _join_mac(operator_token: str, job_id: str) -> str:
    return hmac.new(derive_key(operator_token, "join"), job_id.encode(),
                    hashlib.sha256).hexdigest()


def issue_join(operator_token: str, job_id: str) -> str:
    """The join credential of job `job_id`. Raises ValueError for an empty id
    or one with a ``.``."""
    if not job_id or "." in job_id:
        raise ValueError(f"job_id {job_id!r} cannot be bound in a join credential")
    return f"{JOIN_PREFIX}.{job_id}.{_join_mac(operator_token, job_id)}"


def job_joined_by(operator_token: str, credential: str) -> str | None:
    """The job id of a valid join credential, None for anything else (not
    one, or forged: compared in constant time)."""
    parts = credential.split(".")
    if len(parts) != 3 or parts[0] != JOIN_PREFIX or not parts[1]:
        return None
    _, job_id, mac = parts
    if not hmac.compare_digest(mac.encode(), _join_mac(operator_token, job_id).encode()):
        return None
    return job_id


def replica_credential(operator_token: str) -> str:
    """The credential replicas sharing `operator_token` call each other with."""
    mac = hmac.new(derive_key(operator_token, "replica"), b"replica", hashlib.sha256).hexdigest()
    return f"{REPLICA_PREFIX}.{mac}"


def is_replica(operator_token: str, credential: str) -> bool:
    """Whether `credential` is the replica credential (compared in constant time)."""
    return hmac.compare_digest(credential.encode(), replica_credential(operator_token).encode())


TLS_ROLES = ("operator", "viewer", "replica")
"""The roles a client certificate may be mapped to (``--tls-roles``)."""


def parse_tls_roles(text: str, source: str = "--tls-roles") -> dict[tuple[str, str], str]:
    """The certificate-subject -> role map of a ``--tls-roles`` file: one
    ``CN=<common name>:<role>`` or ``SAN=<subject alternative name>:<role>``
    a line (the role is after the *last* colon, so a SAN may be a URI),
    blank lines and ``#`` comments ignored. Keys are ``("CN", name)`` /
    ``("SAN", name)``. Raises ValueError naming the line at fault (an
    unknown kind or role, a name mapped twice to different roles)."""
    roles: dict[tuple[str, str], str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        subject, _, role = line.rpartition(":")
        kind, _, name = subject.partition("=")
        kind, name, role = kind.strip().upper(), name.strip(), role.strip()
        if kind not in ("CN", "SAN") or not name:
            raise ValueError(f"{source} line {number}: {line!r} is not CN=<name>:<role> "
                             "or SAN=<name>:<role>")
        if role not in TLS_ROLES:
            raise ValueError(f"{source} line {number}: role {role!r} is not one of "
                             f"{', '.join(TLS_ROLES)}")
        if roles.get((kind, name), role) != role:
            raise ValueError(f"{source} line {number}: {kind}={name} is already mapped to "
                             f"{roles[kind, name]}")
        roles[kind, name] = role
    return roles
