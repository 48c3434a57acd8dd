"""What runs a node's ranks, and the narrow port through which it talks to the agent.

The agent (`node.Agent`) joins the job, keeps the member alive, publishes the
plans and drains; *how* its ranks run is a `RankRunner`'s:

* `library.LibraryRanks` (library mode): live ranks started once, before the
  join, as warm standbys (`ranks.py`); a crashed rank is replaced by the spare.
* `restart.RestartRanks` (restart mode): an unmodified torchrun script's
  ranks, stopped and started again on every generation.

A runner sees the agent only through `AgentPort` (the plan, the member, the
reports a runner makes, the ranks' environment); the agent sees the runner
only through `RankRunner`. Which runner an agent gets is decided in one place,
`command.runner_for` (a contract in pyproject.toml keeps `node` from importing
either runner).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from springback.client.workers import MemberCalls
from springback.v1 import types_pb2 as pb
from springback.worker.agent.config import AgentConfig
from springback.worker.agent.ranklogs import RankLogs
from springback.worker.agent.rankprocess import RankProcess
from springback.worker.agent.startup import StartupClock

EXIT_OK, EXIT_ERROR, EXIT_FENCED = 0, 1, 3


class AgentPort(Protocol):
    """What a runner may ask of its agent."""

    @property
    def config(self) -> AgentConfig: ...

    @property
    def workdir(self) -> str:
        """The agent's scratch directory (removed when it ends)."""

    @property
    def rank_logs(self) -> RankLogs: ...

    def plan(self) -> pb.Plan | None:
        """The newest plan the agent received (None before the first)."""

    def member_id(self) -> str:
        """The current member's id; only after the join."""

    def control_dir(self) -> str | None:
        """The current member's control directory (`control.py`); None before
        the first join."""

    def calls(self) -> MemberCalls:
        """The current member's WorkerService calls (its credential; `client/workers.py`)."""

    def join(self) -> None:
        """Joins the job as a new member (JoinJob; heartbeats and the plan
        stream start)."""

    def identity(self) -> dict:
        """What an activated standby learns, known only after the join."""

    def rank_env(self, local_rank: int) -> dict[str, str]:
        """The environment of a rank process (the agent's, the job's, the plan's)."""

    def drain_reason(self) -> str | None:
        """Why the node drains; None while it does not."""

    def fenced(self) -> bool:
        """The member was fenced: its ranks are to be killed."""

    def hung_ranks(self, running: list[tuple[int, int]]) -> list[tuple[int, str]]:
        """The watchdog's verdict on (local rank, pid) pairs: (local rank, why) hung."""

    def report_failure(self, local_rank: int, code: int, reason: str | None = None,
                       pid: int = 0, error: str = "") -> None:
        """ReportFailure for a local rank's exit (`error`: the rank's last
        error line, added to the default reason)."""

    def count_failure(self) -> bool:
        """Counts one rank failure; True once there were more than
        ``--max-restarts``."""

    def leave(self, reason: str) -> None:
        """LeaveJob (a failure is logged: the member expires by itself)."""


class RankRunner(Protocol):
    """Runs one node's ranks for the agent. Every method is called from the
    agent's supervising thread."""

    @property
    def ranks(self) -> dict[int, RankProcess]:
        """The running rank processes, by local rank."""

    def rendezvous_port(self) -> int:
        """The node's rendezvous port named in JoinJob."""

    def start(self, phases: StartupClock) -> None:
        """Starts what runs before the join, joins (`AgentPort.join`), and
        whatever runs after it; again after a fence. Raises `DrainedBeforeJoin`
        or RuntimeError (a rank exited during its set-up)."""

    def check(self) -> int | None:
        """Polled by the agent's main loop: reports and replaces failed ranks,
        follows the plan; an exit status once the agent is done."""

    def drain_signal(self) -> None:
        """A drain started (after DrainMember): what the ranks are told."""

    def drained(self) -> None:
        """The drain's wait ended (its ranks exited, or the deadline passed)."""

    def kill_all(self) -> None:
        """SIGKILLs and reaps every rank process. Idempotent."""

    def close(self) -> None:
        """Releases the node's rendezvous address (the agent ends)."""


RunnerFactory = Callable[[AgentPort], RankRunner]
"""How the agent gets its runner: called once, with the agent's port."""
