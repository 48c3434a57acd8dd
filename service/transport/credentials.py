"""Member credentials: a bearer credential bound to one member of one job.

The coordinator's operator token opens every call. A member (a node agent
that joined, and the ranks it starts) needs only its own member's calls, so
`JoinJob` hands it a credential of its own::

    sbm2.<job id>.<member id>.<lease>.<HMAC-SHA256 of "<job id>/<member id>/<lease>">

where ``<lease>`` is the id (hex) of the etcd lease the member's key was
registered with: the member's *incarnation*. The credential opens calls only
while that lease is still the one its member's key is bound to
(`revocation`): once the member is fenced (its lease expired) or left, or its
id was registered afresh, the credential is refused UNAUTHENTICATED and the
agent must join again, which brings a fresh credential. It carries no expiry
of its own: it lives exactly as long as its member.

keyed by a key derived from the operator token (`derive_key`: HKDF-SHA256,
one key per kind of credential, so a MAC of one kind never verifies as
another's, whatever the ids), so every replica (they share
the token) issues and checks the same credentials; the only state a check
reads is the member's own key, which exists anyway. `BearerAuth` (auth.py)
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
import math
import string
from typing import NamedTuple

PREFIX = "sbm2"
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


class MemberCredential(NamedTuple):
    """What a valid member credential names."""

    job_id: str
    member_id: str
    lease_id: int
    """The etcd lease the member was registered with (its incarnation)."""


def _mac(operator_token: str, job_id: str, member_id: str, lease_id: int) -> str:
    return hmac.new(derive_key(operator_token, "member"),
                    f"{job_id}/{member_id}/{lease_id:x}".encode(), hashlib.sha256).hexdigest()


def issue(operator_token: str, job_id: str, member_id: str, lease_id: int) -> str:
    """The credential of member `member_id` of job `job_id`, registered with
    etcd lease `lease_id`. Raises ValueError for an id with a ``.`` (ids are
    ``[a-z0-9-]``), an empty one, or a lease id that is not positive."""
    for field, value in (("job_id", job_id), ("member_id", member_id)):
        if not value or "." in value:
            raise ValueError(f"{field} {value!r} cannot be bound in a member credential")
    if lease_id <= 0:
        raise ValueError(f"lease_id {lease_id} is not an etcd lease id")
    return (f"{PREFIX}.{job_id}.{member_id}.{lease_id:x}."
            f"{_mac(operator_token, job_id, member_id, lease_id)}")


def member_of(operator_token: str, credential: str) -> MemberCredential | None:
    """What a valid member credential names, None for anything else (not
    one, or forged: compared in constant time). Whether its member is still
    that incarnation is `revocation`'s to check."""
    parts = credential.split(".")
    if len(parts) != 5 or parts[0] != PREFIX or not parts[1] or not parts[2]:
        return None
    _, job_id, member_id, lease, mac = parts
    if not lease or len(lease) > 16 or any(c not in "0123456789abcdef" for c in lease):
        return None
    lease_id = int(lease, 16)
    if not hmac.compare_digest(mac.encode(),
                               _mac(operator_token, job_id, member_id, lease_id).encode()):
        return None
    return MemberCredential(job_id, member_id, lease_id)


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


MIN_TOKEN_BITS = 128
"""The entropy, by `token_bits`' estimate, an operator or viewer token needs."""
MIN_DISTINCT_CHARS = 8

_BASE64 = frozenset(string.ascii_letters + string.digits + "+/-_=")
_CLASSES = (string.ascii_lowercase, string.ascii_uppercase, string.digits, string.punctuation)


def token_bits(token: str) -> float:
    """An estimate of `token`'s entropy: its length times log2 of the alphabet
    of the characters it uses (16 for hex; 64 for mixed-case base64 or
    base64url; else the sum of the classes it touches: lower case 26, upper case 26, digits 10, punctuation 32). It
    cannot see words or reuse: it bounds what a random token of that shape
    holds."""
    if token and all(c in string.hexdigits for c in token) and (
            token == token.lower() or token == token.upper()):
        alphabet = 16
    elif all(c in _BASE64 for c in token) and token.lower() != token != token.upper():
        alphabet = 64  # mixed case from base64's alphabet: base64 (or base64url)
    else:
        alphabet = sum(len(chars) for chars in _CLASSES if any(c in chars for c in token))
    return len(token) * math.log2(alphabet) if alphabet > 1 else 0.0


def token_weakness(token: str) -> str | None:
    """Why `token` is too weak to guard a coordinator, None if it is not. It
    must be printable ASCII without spaces (it travels in a header), reach
    `MIN_TOKEN_BITS` by `token_bits` (22 base64 or 32 hex characters), use at
    least `MIN_DISTINCT_CHARS` distinct characters, and not be an obvious
    sequence (two thirds or more of its neighbouring characters equal or one
    apart: ``aaaa…``, ``abcd…``, ``0123…``, ``abcabc…``). The reason never
    quotes the token."""
    if any(not (33 <= ord(c) <= 126) for c in token):
        return "it has a space, a control or a non-ASCII character"
    bits = token_bits(token)
    if bits < MIN_TOKEN_BITS:
        return (f"{len(token)} characters of that alphabet hold about {bits:.0f} bits, under "
                f"{MIN_TOKEN_BITS}")
    if len(set(token)) < MIN_DISTINCT_CHARS:
        return f"it has fewer than {MIN_DISTINCT_CHARS} distinct characters"
    steps = [abs(ord(b) - ord(a)) <= 1 for a, b in zip(token, token[1:])]
    if 3 * sum(steps) >= 2 * len(steps):
        return "it is an obvious sequence (repeated or consecutive characters)"
    return None


def check_token(token: str | None, flag: str) -> None:
    """Raises ValueError naming `flag` (``--token``) when `token` is given
    and `token_weakness` finds it too weak, saying how to make a good one."""
    if token and (why := token_weakness(token)) is not None:
        raise ValueError(
            f"{flag.lstrip('-').replace('-', '_')}: the {flag} given is too weak to guard the "
            f"coordinator ({why}): use at least {MIN_TOKEN_BITS} random bits, e.g. "
            "`python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`")


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
