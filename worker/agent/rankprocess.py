"""How a rank process starts: forked by the node's fork server, or exec'd.

`RankStarter` starts the processes of an agent's rank command. With
``springback run --fork-server``, where the command allows it
(`forkserver.plan_fork`), a process is forked by the node's fork server, warm
(`forkserver.py`); otherwise it is exec'd, cold, behind the parent-death
launcher (`with_parent_death`). Either
way the process dies with the agent, runs in a session of its own, can start
at the idle scheduling class and, under Slurm, ignores SIGTERM (`ranks.py`).

Ranks are exec'd through a launcher snippet rather than with subprocess's
preexec_fn: preexec_fn runs Python in a fork() of a process with live gRPC
threads, and gRPC's fork handlers abort the child now and then (SIGABRT). The
snippet sets the parent-death signal, checks the agent did not die in
between, applies the options of argv[2] (comma-separated: idle scheduling,
SIGTERM ignored; an ignored signal stays ignored across exec) and execs the
rank command. The fork server is started behind the same snippet, and forks
from a single-threaded process that never ran gRPC.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import IO, Any, Union

from springback.worker.agent.forkserver import ForkedProcess, ForkServer

log = logging.getLogger("springback.agent")

RankProcess = Union["subprocess.Popen[bytes]", ForkedProcess]
"""A started rank: what `RankStarter.start` returns."""

_PDEATH_LAUNCHER = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "opts = sys.argv[2].split(',')\n"
    "if 'idle' in opts: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "if 'noterm' in opts: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def with_parent_death(command: list[str], *, idle: bool = False,
                      ignore_sigterm: bool = False) -> list[str]:
    """`command` behind the launcher that ties its life to this process's;
    with `idle`, it also runs at the idle scheduling class (threads it starts
    inherit it) until `ranks.to_normal_priority`; with `ignore_sigterm`, it
    starts with SIGTERM ignored (SIGKILL and the parent-death signal still
    end it)."""
    opts = ["idle" if idle else "normal"] + (["noterm"] if ignore_sigterm else [])
    return [sys.executable, "-S", "-c", _PDEATH_LAUNCHER, str(os.getpid()),
            ",".join(opts), *command]


class RankStarter:
    """Starts processes of `command` (module docstring): with `fork`, forked
    by a fork server where the command allows it; else every start is cold.
    `close` stops the fork server, and with it every process it forked."""

    def __init__(self, command: list[str], *, ignore_sigterm: bool = False,
                 fork: bool = False) -> None:
        self.command = command
        self.ignore_sigterm = ignore_sigterm
        self._server = ForkServer(lambda argv: with_parent_death(
            argv, ignore_sigterm=ignore_sigterm), ignore_sigterm=ignore_sigterm) if fork else None

    def start(self, environ: dict[str, str], *, idle: bool = False, stdout: Any = None,
              stderr: Any = None, pass_fds: Sequence[int] = (),
              command: list[str] | None = None) -> RankProcess:
        """Starts one process of `command` (the starter's when None) with
        `environ`; `stdout`/`stderr` as Popen's
        (None: the agent's; `subprocess.PIPE`; `subprocess.DEVNULL`;
        `subprocess.STDOUT` for stderr; a file or a descriptor); `pass_fds` inherited at their numbers. Raises
        OSError when it cannot be started (a failed fork falls back to exec,
        logged)."""
        command = self.command if command is None else command
        if self._server is not None:
            why = self._server.why_cold(command, environ)
            if why is None:
                try:
                    proc = self._fork(command, environ, idle, stdout, stderr, pass_fds)
                except OSError as e:  # the server died under the request: this start is cold
                    log.warning("%s: starting the rank cold", e)
                    proc = None
                if proc is not None:
                    return proc
            else:
                self._server.say_cold(why)
        argv = with_parent_death(command, idle=idle, ignore_sigterm=self.ignore_sigterm)
        return subprocess.Popen(argv, env=environ, start_new_session=True, stdout=stdout,
                                stderr=stderr, pass_fds=tuple(pass_fds))

    def _fork(self, command: list[str], environ: dict[str, str], idle: bool, stdout: Any,
              stderr: Any, pass_fds: Sequence[int]) -> ForkedProcess | None:
        assert self._server is not None
        ours: list[IO[bytes]] = []   # the agent's ends of the pipes asked for
        theirs: list[int] = []       # the child's ends, closed here once sent

        def descriptor(spec: Any, default: int, stdout_fd: int = 1) -> tuple[int, IO[bytes] | None]:
            if spec is None:
                return default, None
            if spec == subprocess.PIPE:
                read, write = os.pipe()
                theirs.append(write)
                ours.append(os.fdopen(read, "rb"))
                return write, ours[-1]
            if spec == subprocess.STDOUT:
                return stdout_fd, None
            if spec == subprocess.DEVNULL:
                theirs.append(os.open(os.devnull, os.O_WRONLY))
                return theirs[-1], None
            return (spec if isinstance(spec, int) else spec.fileno()), None

        try:
            out_fd, out_pipe = descriptor(stdout, 1)
            err_fd, err_pipe = descriptor(stderr, 2, out_fd)
            proc = self._server.start_rank(command, environ, stdout=out_fd, stderr=err_fd,
                                           pass_fds=pass_fds, idle=idle,
                                           pipes=(out_pipe, err_pipe))
        except BaseException:
            for pipe in ours:
                pipe.close()
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        if proc is None:  # the server did not start: cold from now on
            for pipe in ours:
                pipe.close()
        return proc

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
