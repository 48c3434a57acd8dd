"""What one node agent runs (`AgentConfig`), checked as it is built: a bad
value raises ValueError naming the ``springback run`` flag at fault."""

from __future__ import annotations

from dataclasses import dataclass, field

from springback.worker.agent.launch import RankOutput
from springback.worker.agent.preemption import PreemptionSource
from springback.worker.agent.slurm import SlurmTask


@dataclass(kw_only=True)
class AgentConfig:
    """What one agent runs; built from the `run` command line."""

    job_id: str
    """Job to join."""
    command: list[str]
    """The rank command (e.g. ``python train.py``), run once per local rank."""
    coordinator: str | None = None
    """Coordinator addresses; None reads SPRINGBACK_COORDINATOR."""
    token: str | None = None
    """Bearer token; None reads SPRINGBACK_TOKEN."""
    nproc_per_node: int = 1
    """Local ranks on this node."""
    host: str = "127.0.0.1"
    """Address other nodes reach this node's rendezvous store and ranks at."""
    drain_timeout_s: float = 60.0
    """How long a drain may take before the ranks are killed."""
    max_restarts: int = 10
    """Local rank failures tolerated over the agent's life."""
    ready_timeout_s: float = 600.0
    """How long the ranks' set-up (up to `Session()`) may take before joining."""
    standby: bool = True
    """Keep one warm standby rank (script started, blocked in `Session()`) to
    replace a crashed rank in well under a second instead of a cold start."""
    fork_server: bool = False
    """Start ranks forked by the node's fork server, warm, where the command
    allows it (`forkserver.py`); False (the default): every rank is exec'd."""
    on_fenced: str = "rejoin"
    """``rejoin`` as a new member, or ``exit`` (status 3), once fenced."""
    collective_timeout_s: float | None = None
    """Process-group timeout for the ranks; None uses the liveness timeout."""
    preemption: list[PreemptionSource] = field(default_factory=list)
    """Preemption notice sources, polled several times a second."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Added to every rank's environment."""
    metrics_listen: str | None = None
    """``HOST:PORT`` for a Prometheus endpoint (``/metrics``) of this node's
    plan and its ranks' statistics (`rankstats.py`); None serves none."""
    mode: str = "library"
    """``library`` (a Session script) or ``restart`` (an unmodified torchrun
    script); `launch.choose_mode` resolves ``--mode auto``."""
    output: RankOutput = field(default_factory=RankOutput)
    """Where the ranks' stdout/stderr go (--log-dir, --redirects, --tee)."""
    connect_timeout_s: float = 60.0
    """How long the start-up check may wait for a coordinator to answer."""
    nnodes: tuple[int, int] | None = None
    """torchrun's --nnodes: must equal the job's (min_workers, max_workers)."""
    slurm: SlurmTask | None = None
    """The Slurm task this agent is (`slurm.detect`): its joins take the
    task's join tokens; None (outside Slurm) joins with a random token each."""

    def __post_init__(self) -> None:
        if not self.job_id:
            raise ValueError("--job is required")
        if not self.command:
            raise ValueError("no rank command: pass it after --, e.g. -- python train.py")
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.on_fenced not in ("rejoin", "exit"):
            raise ValueError(f"--on-fenced must be rejoin or exit, got {self.on_fenced!r}")
        if self.mode not in ("library", "restart"):
            raise ValueError(f"--mode must be library or restart, got {self.mode!r}")
        if self.connect_timeout_s <= 0:
            raise ValueError(f"--connect-timeout-s must be positive, got {self.connect_timeout_s}")
        if self.drain_timeout_s <= 0:
            raise ValueError(f"--drain-timeout-s must be positive, got {self.drain_timeout_s}")
        if self.metrics_listen is not None:
            host, sep, port = self.metrics_listen.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"--metrics-listen must be HOST:PORT, got {self.metrics_listen!r}")
