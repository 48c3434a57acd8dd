"""Running under Slurm: the Slurm task a node agent is, from the ``SLURM_*``
environment that ``srun`` (or ``sbatch``'s batch step) gives every task.

The agent (`command._config_from_args`) calls `detect` once; when it finds a
task (`SlurmTask`) it

* names its joins after the task (`SlurmTask.join_token`): the member id the
  coordinator derives from the token is the same for the same job, step,
  node, local task and requeue count. A requeued job (``SLURM_RESTART_COUNT``
  one higher) is a new member; a second agent started for the same task while
  the first one's member is registered is refused (INVALID_ARGUMENT naming
  that member) instead of registering a phantom beside it, and once that
  member has expired a new start registers afresh under the same id. A join
  after being fenced takes the next token (``…/j1``, ``…/j2``), a new member;
* takes the address its peers reach it at from the node's name
  (`node_address`) when neither ``--host`` nor ``SPRINGBACK_HOST`` names one;
* logs one line saying it runs under Slurm, as which task.

SIGTERM is a drain in every agent (`command._run_agent`): Slurm's SIGTERM
on ``scancel`` or on a preemption (``PreemptMode=REQUEUE`` / ``CANCEL``,
then SIGKILL after ``GraceTime``) makes the agent drain its node
(DrainMember, a drain checkpoint when no survivor holds the state, LeaveJob),
with a reason naming Slurm, the job step, the node and the signal
(`signal_reason`: the job's events show it), marked *preempted*: the
coordinator records the departure as ``preempted``, not ``drain`` (a SIGINT
stays a drain). Slurm signals every process of
the step, the ranks too: under Slurm they ignore SIGTERM (`ranks.py`), so
they finish their step and leave at the boundary of the plan without this
node instead of dying mid-step; Slurm's SIGKILL still ends them.
A node set DOWN or lost takes its task with SIGKILL: with ``srun --no-kill``
the other tasks run on and the coordinator replans around the lost member,
recorded as ``node_lost``. Keeping the job at size is the keeper's
(``springback slurm keep``, `springback.cli.slurm`; docs/slurm.md).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("springback.agent")

SLURM_JOB_ID = "SLURM_JOB_ID"
"""The Slurm job (an array task has its own); set in every step of it."""
SLURM_STEP_ID = "SLURM_STEP_ID"
"""The step within the job (``srun`` numbers them from 0); absent in the batch step."""
SLURMD_NODENAME = "SLURMD_NODENAME"
"""The Slurm node the task runs on: unique per node even where several
``slurmd -N`` share one host (and one ``hostname``)."""
SLURM_RESTART_COUNT = "SLURM_RESTART_COUNT"
"""How many times the job was requeued (absent or 0 on its first run)."""
SLURM_LOCALID = "SLURM_LOCALID"
"""The task's index among the job step's tasks on this node."""
SLURM_NTASKS_PER_NODE = "SLURM_NTASKS_PER_NODE"
"""``--ntasks-per-node`` when given: one agent per node wants 1."""

MAX_JOIN_TOKEN = 128
"""The coordinator's limit on a join token (service/core/membership.py)."""


@dataclass(frozen=True, kw_only=True)
class SlurmTask:
    """One task of a Slurm job step: who this agent is to Slurm."""

    job_id: str
    """``SLURM_JOB_ID``."""
    step_id: str
    """``SLURM_STEP_ID``; ``batch`` in the batch step (no srun)."""
    node_name: str
    """``SLURMD_NODENAME``."""
    restart_count: int = 0
    """``SLURM_RESTART_COUNT``: requeues of the job so far."""
    local_id: int = 0
    """``SLURM_LOCALID``: 0 for the only agent of a node."""
    ntasks_per_node: str | None = None
    """``SLURM_NTASKS_PER_NODE`` as Slurm wrote it, if set."""

    @property
    def name(self) -> str:
        """``slurm/JOB.STEP/NODE/rRESTARTS/tLOCALID``: the task, stable for its life."""
        return (f"slurm/{self.job_id}.{self.step_id}/{self.node_name}"
                f"/r{self.restart_count}/t{self.local_id}")

    def join_token(self, num_joins: int) -> str:
        """The join token of this task's join number `num_joins` (0 first):
        the same for a retried start, new after a requeue or a fence. At most
        `MAX_JOIN_TOKEN` printable ASCII characters: a longer name (or one
        with other characters) keeps a readable head and a digest of the whole."""
        token = f"{self.name}/j{num_joins}"
        if len(token) <= MAX_JOIN_TOKEN and token.isascii() and token.isprintable():
            return token
        digest = hashlib.sha256(token.encode()).hexdigest()[:16]
        head = token.encode("ascii", "replace").decode().replace("?", "_")
        head = "".join(c if c.isprintable() else "_" for c in head)
        return f"{head[:MAX_JOIN_TOKEN - len(digest) - 1]}~{digest}"

    def describe(self) -> str:
        """A log line's worth: job, step, node, requeues, local task."""
        return (f"Slurm job {self.job_id} step {self.step_id} on node {self.node_name} "
                f"(requeued {self.restart_count} times, local task {self.local_id})")


def detect(environ: Mapping[str, str] | None = None) -> SlurmTask | None:
    """The Slurm task of `environ` (default: this process's environment), or
    None outside a Slurm job step: both ``SLURM_JOB_ID`` and ``SLURMD_NODENAME``
    must be set (an ``salloc`` shell on a login node has only the first).
    Unparsable counters count as 0 (logged). Never blocks."""
    env = os.environ if environ is None else environ
    job_id, node_name = env.get(SLURM_JOB_ID, ""), env.get(SLURMD_NODENAME, "")
    if not job_id or not node_name:
        return None
    return SlurmTask(job_id=job_id, step_id=env.get(SLURM_STEP_ID) or "batch",
                     node_name=node_name,
                     restart_count=_count(env, SLURM_RESTART_COUNT),
                     local_id=_count(env, SLURM_LOCALID),
                     ntasks_per_node=env.get(SLURM_NTASKS_PER_NODE) or None)


def _count(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "").strip()
    if not value:
        return 0
    try:
        return max(int(value), 0)
    except ValueError:
        log.warning("%s=%r is not a count: taken as 0", name, value)
        return 0


def node_address(task: SlurmTask) -> str | None:
    """The address `task.node_name` resolves to, if it resolves to one that is
    not loopback (a cluster's node names usually do; several ``slurmd -N`` on
    one host do not), else None: the caller keeps its default. Blocks for as
    long as the resolver takes (the system's own timeout)."""
    try:
        address = socket.gethostbyname(task.node_name)
    except (OSError, UnicodeError):
        return None
    return None if ipaddress.ip_address(address).is_loopback else address


def signal_reason(task: SlurmTask, signum: int) -> str:
    """The drain reason of signal `signum` reaching the agent of `task`: what
    the operator reads in the job's events (``MEMBER draining: REASON``)."""
    name = signal.Signals(signum).name
    why = " (scancel, preemption or --signal)" if signum == signal.SIGTERM else ""
    return (f"Slurm sent {name} to job {task.job_id} step {task.step_id} on node "
            f"{task.node_name}{why}")


def announce(task: SlurmTask, host: str) -> None:
    """The agent's log line under Slurm, and a warning where the layout is not
    one agent per node (each agent is a member; several per node work, but
    ``--nproc-per-node`` is the way to run several ranks on one)."""
    log.info("running under Slurm: %s; joins as %s, reachable at %s",
             task.describe(), task.join_token(0), host)
    if task.local_id or task.ntasks_per_node not in (None, "1"):
        log.warning("more than one agent on Slurm node %s (SLURM_NTASKS_PER_NODE=%s): each is "
                    "its own member; run one per node (srun --ntasks-per-node=1) with "
                    "--nproc-per-node for its ranks", task.node_name, task.ntasks_per_node)
