"""Library mode's `RankRunner`: live ranks (a script that creates a `Session`).

The ranks start before the join, as warm standbys (`ranks.py`), and only once
every one has done its set-up (up to ``--ready-timeout-s``) does the agent
join: the generation that admits this node does not wait for a cold start.
They then stay up across generations (the training library follows the plans
itself). A rank exiting non-zero is reported at once (ReportFailure) and the
spare takes its place; a rank the watchdog finds hung is killed first
(`watchdog.py`). Local rank 0 serves the node's TCPStore on the agent's
listening socket (`startup.StoreSocket`, inherited as ``SPRINGBACK_STORE_FD``).
"""

from __future__ import annotations

import logging
import time

from springback.client import env as E
from springback.v1 import types_pb2 as pb
from springback.worker.agent.rankprocess import RankProcess
from springback.worker.agent.ranks import LocalRanks
from springback.worker.agent.runner import EXIT_ERROR, EXIT_OK, AgentPort
from springback.worker.agent.startup import DrainedBeforeJoin, StartupClock, StoreSocket

log = logging.getLogger("springback.agent")


class LibraryRanks:
    """The library-mode runner (`runner.RankRunner`)."""

    def __init__(self, port: AgentPort) -> None:
        self._port = port
        config = port.config
        # no torch in the agent: local rank 0 serves the store on this socket
        self._socket = StoreSocket(config.host)
        self._local = LocalRanks(config.command, port.workdir, keep_spare=config.standby,
                                 output=config.output, rank_logs=port.rank_logs.attach,
                                 pass_fds=(self._socket.fd,),
                                 ignore_sigterm=config.slurm is not None,
                                 fork=config.fork_server)
        self._stop_deadline: float | None = None
        self._hung: dict[int, str] = {}  # local rank -> why the watchdog killed it

    @property
    def ranks(self) -> dict[int, RankProcess]:
        return self._local.ranks

    def rendezvous_port(self) -> int:
        return self._socket.port

    def _env(self, local_rank: int) -> dict[str, str]:
        return {**self._port.rank_env(local_rank), E.STORE_FD: str(self._socket.fd)}

    def start(self, phases: StartupClock) -> None:
        port, config = self._port, self._port.config
        standbys = self._local.start_all(
            config.nproc_per_node, self._env(0), timeout_s=config.ready_timeout_s,
            abort=lambda: port.drain_reason() is not None)
        phases.done("ranks' set-up (their imports and script up to Session())")
        reason = port.drain_reason()
        if reason is not None:
            raise DrainedBeforeJoin(reason)
        if not all(s.ready() for s in standbys):
            log.warning("ranks not ready after %.0fs: joining anyway", config.ready_timeout_s)
        port.join()
        self._hung = {}  # a kill the fence cut short must not hide the next rank from it
        phases.done("join")
        for lr, standby in enumerate(standbys):
            standby.activate(lr, port.identity())
        self._local.ensure_spare(self._env(0))

    def check(self) -> int | None:
        """Restarts failed ranks; returns an exit status once all ranks are done.

        After a STOP plan (job finished or cancelled) nothing is restarted, and
        ranks still running after ``drain_timeout_s`` are killed."""
        port, config = self._port, self._port.config
        plan = port.plan()
        stopping = plan is not None and plan.action == pb.PLAN_ACTION_STOP
        if not stopping:
            self._kill_hung_ranks()
        for lr, p in list(self._local.ranks.items()):
            code = p.poll()
            if code is None or code == 0 or stopping:
                continue
            if port.fenced():
                return None
            reason = self._hung.pop(lr, None)
            port.report_failure(lr, code, reason, pid=p.pid,
                                error="" if reason else port.rank_logs.last_error(p))
            if port.count_failure():
                log.error("more than %d rank failures: giving up", config.max_restarts)
                port.leave("too many rank failures")
                return EXIT_ERROR
            if self._local.replace(lr, port.identity(), self._env(lr)):
                log.info("warm standby took the place of local rank %d", lr)
        codes = [p.poll() for p in self._local.ranks.values()]
        if codes and all(c == 0 for c in codes) or stopping and all(c is not None for c in codes):
            log.info("all local ranks finished")
            port.leave("ranks finished")
            return EXIT_OK
        if stopping:
            if self._stop_deadline is None:
                self._stop_deadline = time.monotonic() + config.drain_timeout_s
            elif time.monotonic() > self._stop_deadline:
                log.warning("job stopped but ranks still running after %.0fs: killing them",
                            config.drain_timeout_s)
                self.kill_all()
                port.leave("job stopped")
                return EXIT_OK
        return None

    def _kill_hung_ranks(self) -> None:
        """SIGKILLs the local ranks the watchdog finds hung (`worker/agent/watchdog.py`);
        the next poll reports each as a crashed rank, with why it was killed."""
        running = [(lr, p.pid) for lr, p in self._local.ranks.items()
                   if p.poll() is None and lr not in self._hung]
        for lr, why in self._port.hung_ranks(running):
            log.error("%s: killing it", why)
            self._hung[lr] = why
            self._local.ranks[lr].kill()

    def drain_signal(self) -> None:
        """Nothing: the ranks see the drain marker and leave at a step boundary."""

    def drained(self) -> None:
        """A rank's own exit is its step boundary: says which did not leave cleanly."""
        codes = {lr: p.poll() for lr, p in self._local.ranks.items()}
        if all(c == 0 for c in codes.values()):
            log.info("drain: every local rank left at a step boundary (exit status 0)")
        else:  # a signal (Slurm's SIGKILL, a script's own SIGTERM handler) or a crash
            log.warning("drain: local ranks that did not leave cleanly "
                        "(exit status; None: still running, killed now): %s",
                        {lr: c for lr, c in codes.items() if c != 0})

    def kill_all(self) -> None:
        self._local.kill_all()

    def close(self) -> None:
        self._local.close()
        self._socket.close()
