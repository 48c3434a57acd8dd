"""Every environment variable Springback reads or sets, by name (no other
module spells a ``SPRINGBACK_*`` name).

The first part is the contract between the node agent and the training
library. The agent (`springback run`) sets these for every local rank it spawns; the
library (`springback.worker.Session`) reads them. They are the only contract
between the two processes besides the control directory (see `control.py`).
In restart mode (`restart.py`) a rank lives for one generation and gets
torchrun's full set. In library mode a rank lives through generations: only
LOCAL_RANK, LOCAL_WORLD_SIZE (stable on a node) and the SPRINGBACK_* ones are
set (a warm standby learns its LOCAL_RANK when activated, inside `Session()`);
the current rank and world size are `gen.rank` / `gen.world_size`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# torchrun-compatible (values of the generation the rank was spawned in)
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
# set in restart mode only, as torchrun does (one role, "default")
GROUP_RANK = "GROUP_RANK"
"""The node's rank in the generation (the plan's node rank)."""
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
"""Nodes in the generation."""
ROLE_NAME = "ROLE_NAME"
ROLE_RANK = "ROLE_RANK"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
"""The job id."""
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
"""How many times this agent restarted its ranks (0 on the first start)."""
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
""""True": MASTER_ADDR:MASTER_PORT is a store the agent hosts (connect as a client)."""
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
TORCHELASTIC_SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"

JOB_ID = "SPRINGBACK_JOB_ID"
"""Job the rank trains for."""
MEMBER_ID = "SPRINGBACK_MEMBER_ID"
"""Member id of the node agent that spawned the rank."""
GENERATION = "SPRINGBACK_GENERATION"
"""Generation current when the rank was spawned."""
COORDINATOR = "SPRINGBACK_COORDINATOR"
"""Coordinator addresses (comma-separated), for step reports from global rank 0."""
TOKEN = "SPRINGBACK_TOKEN"
"""Bearer token for the coordinator, if one is configured."""
TOKEN_FILE = "SPRINGBACK_TOKEN_FILE"
"""File whose first line is the bearer token (the CLI's ``--token-file``);
never passed on to ranks."""
STORAGE_CREDENTIALS_FILE = "SPRINGBACK_STORAGE_CREDENTIALS_FILE"
"""`springback run --storage-credentials`: a file (0600) of the job's ``AWS_*``
storage credentials, which become the agent's and its ranks' only ``AWS_*``
variables (`worker/agent/storagecreds.py`); never passed on to ranks."""
CONTROL_DIR = "SPRINGBACK_CONTROL_DIR"
"""Directory where the agent publishes the current plan to its ranks."""
COLLECTIVE_TIMEOUT_S = "SPRINGBACK_COLLECTIVE_TIMEOUT_S"
"""Process-group timeout: a collective hung on a dead or stopped peer fails after
this long. The agent sets it to the member liveness timeout."""
RENDEZVOUS_TIMEOUT_S = "SPRINGBACK_RENDEZVOUS_TIMEOUT_S"
"""How long a rank waits for all ranks of a generation to arrive (default 120)."""
AUDIT_DIR = "SPRINGBACK_AUDIT_DIR"
"""When set, every rank writes the sample indices it consumes, per generation, here."""
STANDBY_FILE = "SPRINGBACK_STANDBY_FILE"
"""Set on a warm standby rank: `Session()` blocks until the agent writes this
file (JSON: local_rank, member_id, control_dir) to put the standby in the place
of a crashed rank. The script's set-up before `Session()` (imports, data, model)
is then already done, which is most of a rank's start-up time."""
STORE_FD = "SPRINGBACK_STORE_FD"
"""Library mode: the file descriptor (inherited) of a listening socket the
agent holds for the node's rendezvous store. The process of local rank 0
serves a TCPStore on it; when that process is replaced, its successor serves
on the same socket, so the store's address never changes for the agent's life."""
METRICS_FILE = "SPRINGBACK_METRICS_FILE"
"""When set, global rank 0 appends one JSON line per step and per generation here."""
CHECKPOINT_URI = "SPRINGBACK_CHECKPOINT_URI"
"""Restart mode: the job spec's ``checkpoint.uri``, read by `springback.storage.resume`."""
RESTORE_MAX_STEP = "SPRINGBACK_RESTORE_MAX_STEP"
"""Set by the agent when the generation's plan names a checkpoint (an
operator's ``job restore --step N``, or the newest commit): `storage.resume`
restores the newest intact commit at or below that step."""

# read by the CLI, the Python client and the coordinator
TLS_CA = "SPRINGBACK_TLS_CA"
"""PEM file of the CA that signed the coordinator's certificate (enables TLS)."""
TLS_CERT = "SPRINGBACK_TLS_CERT"
"""PEM client certificate, for mTLS."""
TLS_KEY = "SPRINGBACK_TLS_KEY"
"""PEM client key, for mTLS."""
VIEWER_TOKEN = "SPRINGBACK_VIEWER_TOKEN"
"""The coordinator's read-only token (`--viewer-token`)."""
JOB = "SPRINGBACK_JOB"
"""Set by the Slurm keeper in the environment it submits with (sbatch exports it to
the job): the job id, for a ``--script`` that runs ``springback run --job "$SPRINGBACK_JOB"``."""
ETCD = "SPRINGBACK_ETCD"
"""Path of the etcd binary `springback up` and the local cluster run (default: `etcd` on PATH)."""
FORK_SERVER = "SPRINGBACK_FORK_SERVER"
"""`springback run --fork-server` (1) or `--no-fork-server` (0) when neither
flag is given: ranks forked from a warm interpreter (docs/worker.md)."""
HOST = "SPRINGBACK_HOST"
"""`springback run --host`: the address this node's agent advertises to its peers."""
LOG_LEVEL = "SPRINGBACK_LOG_LEVEL"
"""Log level of the coordinator and the agent (as ``logging``'s names)."""
LOG_FORMAT = "SPRINGBACK_LOG_FORMAT"
"""``json`` for one JSON object per log line."""
S3_ENDPOINT_URL = "SPRINGBACK_S3_ENDPOINT_URL"
"""Endpoint URL of an S3-compatible store (e.g. MinIO, moto) for ``s3://`` URIs."""
STORAGE_MAX_ATTEMPTS = "SPRINGBACK_STORAGE_MAX_ATTEMPTS"
"""`storage.retry.RetryPolicy.max_attempts` of every store a process makes by default."""
STORAGE_DEADLINE_S = "SPRINGBACK_STORAGE_DEADLINE_S"
"""`storage.retry.RetryPolicy.deadline_s` of every store a process makes by default."""


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from e


def _fd(name: str) -> int | None:
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        fd = int(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r} is not a file descriptor number") from e
    if fd < 0:
        raise ValueError(f"{name}={raw!r} is not a file descriptor number")
    return fd


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    """What a rank learns from its environment at start-up."""

    job_id: str
    """Job id; empty outside an agent (standalone mode)."""
    member_id: str
    """Member id of the spawning agent; empty outside an agent."""
    local_rank: int
    """Index of this rank on its node; stable across generations."""
    control_dir: str
    """Plan channel from the agent; empty outside an agent."""
    coordinator: str
    """Coordinator addresses; empty disables step reports."""
    token: str | None
    """Bearer token, if any."""
    collective_timeout_s: float
    """Process-group timeout in seconds."""
    rendezvous_timeout_s: float
    """Deadline for all ranks of a generation to arrive."""
    audit_dir: str
    """Audit output directory; empty disables the audit."""
    metrics_file: str
    """Per-step JSON lines file written by global rank 0; empty disables it."""
    store_fd: int | None = None
    """The node's store socket (`STORE_FD`), served by local rank 0; None
    outside library mode."""

    @classmethod
    def from_environ(cls) -> RankEnv:
        """Parses the environment; raises ValueError naming a malformed variable."""
        raw_local = os.environ.get(LOCAL_RANK, "0")
        try:
            local_rank = int(raw_local)
        except ValueError as e:
            raise ValueError(f"{LOCAL_RANK}={raw_local!r} is not an integer") from e
        return cls(
            job_id=os.environ.get(JOB_ID, ""),
            member_id=os.environ.get(MEMBER_ID, ""),
            local_rank=local_rank,
            control_dir=os.environ.get(CONTROL_DIR, ""),
            coordinator=os.environ.get(COORDINATOR, ""),
            token=os.environ.get(TOKEN) or None,
            collective_timeout_s=_float(COLLECTIVE_TIMEOUT_S, 30.0),
            rendezvous_timeout_s=_float(RENDEZVOUS_TIMEOUT_S, 120.0),
            audit_dir=os.environ.get(AUDIT_DIR, ""),
            metrics_file=os.environ.get(METRICS_FILE, ""),
            store_fd=_fd(STORE_FD),
        )
