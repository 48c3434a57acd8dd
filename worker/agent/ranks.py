"""A node's local rank processes: starting them, the warm standby, stopping them.

Every rank starts as a *standby*: the user's command runs its set-up (imports,
data, model) and blocks in `Session()` until activated with its identity
(`control.activate_standby`). The agent activates the first ranks once all
are ready, and keeps one extra standby to put in the place of a rank that
crashes, so a crash costs no cold start. That spare does its set-up at the
idle scheduling class (SCHED_IDLE), so its imports take only CPU no rank
wants: on a node whose cores are busy, a spare starting after a crash or at
the job's start would otherwise slow every step of the job (all ranks wait
for the slowest). On activation the agent moves all its threads back to
normal scheduling before handing it its identity. This needs the right to
raise a process's priority again (CAP_SYS_NICE, or an RLIMIT_NICE allowing
nice 0); without it spares start at normal priority. A spare still in its
set-up when it is needed (a saturated node: idle CPU never came) finishes
it at normal priority, no later than a cold start would.

Processes are started by `rankprocess.RankStarter`: forked warm by the
node's fork server where the command allows it, else exec'd through a small
launcher; either way with the parent-death signal set: when the agent dies
(even by SIGKILL) its ranks die with it, and their peers see the failure at
once. Under Slurm the launcher also
makes the ranks ignore SIGTERM (`LocalRanks` with ``ignore_sigterm``): Slurm
signals every process of a job step on ``scancel`` or a preemption, and a
rank must not die of it mid-step while its agent drains the node (the agent
owns the reaction: the ranks leave at the step boundary of the plan without
them). SIGKILL (Slurm's, after ``KillWait`` / ``GraceTime``; the agent's at
``--drain-timeout-s``) and the parent-death signal still end them. A script
that installs its own SIGTERM handler replaces the ignore. Failure semantics
of each call are in its docstring; nothing here talks to the coordinator.
"""

from __future__ import annotations

import logging
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from springback.client import env as E
from springback.worker.control import activate_standby, ready_path
from springback.worker.agent.launch import RankOutput
from springback.worker.agent.rankprocess import RankProcess, RankStarter

log = logging.getLogger("springback.agent")

NOTE_EVERY_S = 30.0
"""While ranks are still in their set-up, a log line this often."""

_CAP_SYS_NICE = 23


def can_restore_priority() -> bool:
    """Whether this process may move its children back from SCHED_IDLE to
    normal scheduling: it has CAP_SYS_NICE, or its RLIMIT_NICE (inherited by
    the children) allows their nice value (Linux's rule)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            caps = next((int(line.split()[1], 16) for line in f
                         if line.startswith("CapEff:")), 0)
    except OSError:
        caps = 0
    if caps & (1 << _CAP_SYS_NICE):
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    allowed = 20 - os.getpriority(os.PRIO_PROCESS, 0)
    return soft == resource.RLIM_INFINITY or soft >= allowed


def to_normal_priority(pid: int) -> None:
    """Moves every thread of process `pid` to normal scheduling (SCHED_OTHER).
    Passes again until none is left at SCHED_IDLE: a thread still idle may
    start another meanwhile. Logged, never raises (the process may be gone)."""
    for _ in range(5):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            return
        moved = 0
        for tid in tids:
            try:
                if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                    moved += 1
            except ProcessLookupError:
                continue  # the thread ended
            except OSError as e:
                log.warning("rank %d: cannot restore normal scheduling: %s", pid, e)
                return
        if not moved:
            return


@dataclass
class Standby:
    """A started rank waiting for its identity in `path`."""

    proc: RankProcess
    path: str
    idle: bool = False  # set up at the idle scheduling class

    def ready(self) -> bool:
        """Its script reached `Session()` (set-up done)."""
        return os.path.exists(ready_path(self.path))

    def activate(self, local_rank: int, identity: dict) -> None:
        if self.idle:  # a rank must never run at the idle class
            to_normal_priority(self.proc.pid)
        activate_standby(self.path, local_rank=local_rank, **identity)


class LocalRanks:
    """The rank processes of one agent. `ranks` maps local rank -> process."""

    def __init__(self, command: list[str], workdir: str, *, keep_spare: bool,
                 output: RankOutput | None = None,
                 rank_logs: Callable[[RankProcess], None] | None = None,
                 pass_fds: tuple[int, ...] = (), ignore_sigterm: bool = False,
                 fork: bool = False) -> None:
        """`output` places ranks' output in files (--log-dir/--redirects/--tee);
        `rank_logs`, when given, receives every other started process with its
        stdout and stderr merged into a pipe it must drain
        (`ranklogs.RankLogs.attach`: rank-prefixed echo and shipping);
        `pass_fds` are inherited by every process (the node's store socket);
        `ignore_sigterm` starts every process with SIGTERM ignored (under
        Slurm, whose SIGTERM reaches every process of the step: module
        docstring); `fork`: processes are forked by the node's fork server
        where the command allows it (`forkserver.py`), else exec'd."""
        self.starter = RankStarter(command, ignore_sigterm=ignore_sigterm, fork=fork)
        self.rank_logs = rank_logs
        self.workdir = workdir
        self.keep_spare = keep_spare
        self.output = output or RankOutput()
        self.pass_fds = pass_fds
        self.ranks: dict[int, RankProcess] = {}
        self.spare: Standby | None = None
        self._idle_spare = keep_spare and can_restore_priority()
        self._num_started = 0

    def _launch(self, environ: dict[str, str], local_rank: int = 0, *,
                idle: bool = False) -> RankProcess:
        self._num_started += 1
        if self.rank_logs is not None and not self.output.to_files(local_rank):
            proc = self.starter.start(environ, idle=idle, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, pass_fds=self.pass_fds)
            self.rank_logs(proc)
            return proc
        # a standby's local rank is not known yet: its log folder is its process number
        return self.output.launch(self.starter, environ, local_rank=local_rank,
                                  attempt=f"proc_{self._num_started}", idle=idle,
                                  pass_fds=self.pass_fds)

    def start_standby(self, environ: dict[str, str], *, idle: bool = False) -> Standby:
        path = os.path.join(self.workdir, f"standby-{self._num_started + 1}.json")
        return Standby(self._launch({**environ, E.STANDBY_FILE: path}, idle=idle), path, idle)

    def start_all(self, num: int, environ: dict[str, str], *, timeout_s: float,
                  abort: Callable[[], bool]) -> list[Standby]:
        """Starts `num` standbys as local ranks 0..num-1 and waits until all are
        ready, up to `timeout_s` (then returns anyway) or until `abort()`.
        Raises RuntimeError when one exits during its set-up."""
        standbys = [self.start_standby(environ) for _ in range(num)]
        self.ranks = {lr: s.proc for lr, s in enumerate(standbys)}
        deadline = time.monotonic() + timeout_s
        next_note = time.monotonic() + NOTE_EVERY_S
        while not all(s.ready() for s in standbys):
            if time.monotonic() > next_note:  # say why the node has not joined yet
                next_note += NOTE_EVERY_S
                log.warning("%d of %d ranks have not reached Session() yet; a script "
                            "without Session (torchrun style) needs --mode restart",
                            sum(not s.ready() for s in standbys), len(standbys))
            for s in standbys:
                if s.proc.poll() is not None:
                    raise RuntimeError(f"a rank exited with status {s.proc.returncode} before "
                                       "reaching Session() (see its output above)")
            if time.monotonic() > deadline or abort():
                break
            time.sleep(0.05)
        return standbys

    def ensure_spare(self, environ: dict[str, str]) -> None:
        """Starts the warm spare if configured and not running (at the idle
        scheduling class where it can be moved back; module docstring)."""
        if self.keep_spare and self.spare is None:
            self.spare = self.start_standby(environ, idle=self._idle_spare)

    def replace(self, local_rank: int, identity: dict, environ: dict[str, str]) -> bool:
        """Puts the spare (or, without one, a cold new process) in the place of a
        failed local rank, then starts the next spare. Returns True when warm."""
        spare, self.spare = self.spare, None
        warm = spare is not None and spare.proc.poll() is None
        if spare is not None and warm:
            spare.activate(local_rank, identity)
            self.ranks[local_rank] = spare.proc
        else:
            self.ranks[local_rank] = self._launch({**environ, E.LOCAL_RANK: str(local_rank)},
                                                  local_rank)
        self.ensure_spare(environ)
        return warm

    def kill_all(self) -> None:
        """SIGKILLs every rank and the spare and reaps them. Idempotent."""
        procs = list(self.ranks.values()) + ([self.spare.proc] if self.spare else [])
        self.spare = None
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        self.ranks.clear()

    def close(self) -> None:
        """Kills every rank (`kill_all`) and stops the fork server. Idempotent."""
        self.kill_all()
        self.starter.close()
