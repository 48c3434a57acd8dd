"""The fork server: rank processes forked from a warm interpreter.

A rank's first seconds are imports: torch, torch.distributed, DCP, numpy and
the training library take about 3 s of CPU. Every process an agent starts
paid them: the first ranks, the warm spare, a crashed rank's replacement, and
in restart mode every rank of every generation. On a node whose cores train,
those seconds are taken from the job.

So an agent run with ``--fork-server`` starts one *fork server*
(`ForkServer`): a Python process, behind
the same parent-death launcher as a rank, that imports `PRELOAD` once and then
forks a rank per request. A forked rank starts as ``python script.py ARGS``
would, on what the server already imported: the request's argv, environment,
working directory, stdout/stderr and inherited descriptors (at their numbers);
``sys.path[0]`` the script's folder (the working directory for ``-m``);
``__name__`` ``"__main__"``; at its end its non-daemon threads are joined and
its atexit functions run, as at interpreter exit; its exit status reaches the
agent as Popen's would (a signal as ``-N``). `sitecustomize` and
`usercustomize` run again in the rank. It differs from an exec'd rank in what
is fixed when a process is exec'd: the hash seed is the server's (the node's
ranks share it); code in ``.pth`` files ran once, in the server; Python's
start-up settings come from the server's environment (`server_environment`:
the ranks' start-up variables and a few of the agent's, never a credential);
and what the kernel shows of the process, ``/proc/<pid>/cmdline`` and
``/proc/<pid>/environ``, is the server's (``os.environ`` in the rank is its
own). numpy's global random state, seeded at import, is reseeded. Because
tools that read ``/proc`` see those, the fork server is not the default.

A start is *cold* (exec, as before) when the command is not ``python [-u]
script.py ...`` or ``python [-u] -m module ...`` run by the agent's own
interpreter, or when its environment differs from the server's in a variable
read at start-up (`STARTUP_PREFIXES`): `plan_fork` names the reason, logged
once.

Failure semantics: the server dies with the agent (parent-death signal) and
its ranks die with it (theirs points at the server); a dead server is seen by
the agent as every rank it forked exiting with ``-SIGKILL``, and the next
start brings up a new one. A server that cannot start (an import raised, no
answer within `START_TIMEOUT_S`) is logged and the starts fall back to cold.
A fork that fails in the server raises OSError to the caller. The server
process is not the agent: it may import torch (the agent never does).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

log = logging.getLogger("springback.agent")

PRELOAD = ("numpy", "torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.tensor", "torch.distributed.fsdp",
           "springback.worker.train.session", "springback.worker.train.checkpointing",
           "springback.storage.restoring")
"""What the server imports before its first fork: what every rank imports."""

STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "LD_",
                    "MALLOC_", "GLIBC_", "TORCH_", "PYTORCH_", "LANG", "LC_")
"""Environment variables read when an interpreter or a library loads: a rank
whose values differ from the server's is started cold."""

START_TIMEOUT_S = 60.0
"""How long the server may take to import `PRELOAD` (a loaded node is slow)."""

_MAX_MESSAGE = 1 << 20
_MAX_FDS = 16


@dataclass(frozen=True)
class ForkPlan:
    """How a command runs in a forked rank: a script or a module, and ``-u``."""

    script: str | None
    module: str | None
    args: list[str]
    unbuffered: bool


def plan_fork(command: Sequence[str], environ: dict[str, str]) -> ForkPlan | str:
    """How `command` would run forked, or why it cannot (a sentence)."""
    if not command:
        return "no command"
    exe = command[0]
    if os.sep not in exe:
        found = _which(exe, environ.get("PATH", os.defpath))
        if found is None:
            return f"{exe} is not on PATH"
        exe = found
    exe = os.path.abspath(exe)
    here = sys.executable
    if not (os.path.basename(exe).startswith("python")
            and os.path.dirname(exe) == os.path.dirname(here)
            and os.path.realpath(exe) == os.path.realpath(here)):
        return f"{command[0]} is not the agent's interpreter ({here})"
    rest, unbuffered = list(command[1:]), False
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        if rest[0] != "-u":
            return f"python option {rest[0]} (only -u is kept by a fork)"
        unbuffered = True
        rest.pop(0)
    if not rest:
        return "no script"
    if rest[0] == "-m":
        if len(rest) < 2:
            return "-m without a module"
        return ForkPlan(None, rest[1], rest[2:], unbuffered)
    return ForkPlan(rest[0], None, rest[1:], unbuffered)


def _which(name: str, path: str) -> str | None:
    for folder in path.split(os.pathsep):
        candidate = os.path.join(folder or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def startup_environment(environ: dict[str, str]) -> dict[str, str]:
    """The part of `environ` an interpreter reads when it starts."""
    return {k: v for k, v in environ.items() if k.startswith(STARTUP_PREFIXES)}


SERVER_VARIABLES = ("PATH", "HOME", "USER", "LOGNAME", "TMPDIR", "TZ")
"""Besides the start-up variables, what the server keeps of a rank's
environment: no rank's identity, no credential (those reach each rank in its
own request)."""


def server_environment(environ: dict[str, str]) -> dict[str, str]:
    """The environment the server is started with, from a rank's."""
    return {**startup_environment(environ),
            **{k: environ[k] for k in SERVER_VARIABLES if k in environ}}


class ForkedProcess:
    """A rank forked by the server, with the part of `subprocess.Popen` the
    agent uses: `pid`, `args`, `stdout`/`stderr` (pipes asked for),
    `returncode`, `poll`, `wait`, `send_signal`, `kill`, `terminate`. Signals
    go through a pidfd: never to another process that reused the pid."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self.args: list[str] = []
        self.stdout: IO[bytes] | None = None
        self.stderr: IO[bytes] | None = None
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._exited = threading.Event()
        self._lock = threading.Lock()

    def _set_exit(self, code: int) -> None:
        with self._lock:
            if self.returncode is None:
                self.returncode = code
                os.close(self._pidfd)
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def _wait_gone(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for the process to end (its pidfd readable)."""
        with self._lock:
            if self.returncode is None:
                poller = select.poll()
                poller.register(self._pidfd, select.POLLIN)
                poller.poll(timeout_s * 1000)

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is None:
                try:
                    signal.pidfd_send_signal(self._pidfd, sig)
                except ProcessLookupError:
                    pass  # exited; its status is on its way

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkServer:
    """The agent's side of one fork server (module docstring). `start_rank`
    forks a rank; `close` stops the server. Thread-safe."""

    def __init__(self, launcher: Callable[[list[str]], list[str]], *,
                 ignore_sigterm: bool = False) -> None:
        """`launcher` wraps the server's command as a rank's would be (the
        parent-death launcher); `ignore_sigterm`: the forked ranks ignore
        SIGTERM (under Slurm, `ranks.py`)."""
        self._launcher = launcher
        self._ignore_sigterm = ignore_sigterm
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._environ: dict[str, str] = {}
        self._replies: queue.Queue[ForkedProcess | dict] = queue.Queue()
        self._broken = ""     # why the server could not start: starts are cold
        self._said: set[str] = set()

    def why_cold(self, command: Sequence[str], environ: dict[str, str]) -> str | None:
        """None when `command` with `environ` can be forked, else why not."""
        if self._broken:
            return self._broken
        how = plan_fork(command, environ)
        if isinstance(how, str):
            return how
        if self._proc is not None and self._proc.poll() is None:
            theirs = startup_environment(environ)
            ours = startup_environment(self._environ)
            if theirs != ours:
                differing = sorted(k for k in theirs.keys() | ours.keys()
                                   if theirs.get(k) != ours.get(k))
                return f"start-up variables differ from the fork server's: {differing}"
        return None

    def say_cold(self, why: str) -> None:
        """Logs why a start is cold, once per reason."""
        if why not in self._said:
            self._said.add(why)
            log.info("ranks start cold (exec, their own imports): %s", why)

    def start_rank(self, command: Sequence[str], environ: dict[str, str], *,
                   stdout: int, stderr: int, pass_fds: Sequence[int] = (),
                   idle: bool = False, pipes: tuple[IO[bytes] | None, IO[bytes] | None]
                   = (None, None)) -> ForkedProcess | None:
        """Forks `command` (`why_cold` must have said None) with `stdout` and
        `stderr` as its descriptors 1 and 2 and `pass_fds` at their numbers;
        `pipes` are the agent's ends returned as the process's stdout/stderr.
        Returns None when the server could not start (cold from now on).
        Raises OSError when the fork failed in the server."""
        how = plan_fork(command, environ)
        assert isinstance(how, ForkPlan)
        with self._lock:
            if not self._running(environ):
                return None
            assert self._sock is not None
            argv = [how.script] if how.script else [how.module or ""]
            request = {"script": how.script, "module": how.module, "argv": argv + how.args,
                       "unbuffered": how.unbuffered, "env": environ, "cwd": os.getcwd(),
                       "idle": idle, "noterm": self._ignore_sigterm,
                       "targets": [1, 2, *pass_fds]}
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()],
                                [stdout, stderr, *pass_fds])
                reply = self._replies.get(timeout=START_TIMEOUT_S)
            except (OSError, queue.Empty) as e:
                # stopped: a late reply must never be taken for the next start's
                self._stop_locked()
                raise OSError(f"the fork server did not fork: {e!r}") from None
            if not isinstance(reply, ForkedProcess):
                raise OSError(f"the fork server could not fork: {reply['failed']}")
            reply.args, (reply.stdout, reply.stderr) = list(command), pipes
            return reply

    def _running(self, environ: dict[str, str]) -> bool:
        if self._proc is not None and self._proc.poll() is None:
            return True
        self._stop_locked()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = self._launcher([sys.executable, "-m", "springback.worker.agent.forkserver",
                               str(theirs.fileno())])
        environ = server_environment(environ)
        self._proc = subprocess.Popen(argv, env=environ, start_new_session=True,
                                      pass_fds=(theirs.fileno(),))
        theirs.close()
        self._sock, self._environ = ours, environ
        self._replies = queue.Queue()
        threading.Thread(target=self._read, args=(ours, self._replies), daemon=True,
                         name="fork-server").start()
        try:
            hello = self._replies.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            hello = {"failed": f"no answer within {START_TIMEOUT_S:.0f}s"}
        if not isinstance(hello, dict) or "ready" not in hello:
            said = hello.get("failed", hello) if isinstance(hello, dict) else hello
            self._broken = f"the fork server did not start ({said})"
            log.warning("%s: ranks start cold", self._broken)
            self._stop_locked()
            return False
        log.info("fork server %d ready (imports done in %.1fs)", self._proc.pid,
                 hello["ready"])
        return True

    def _read(self, sock: socket.socket, replies: queue.Queue) -> None:
        """The server's messages, in order: a start's reply goes to `replies`
        (a started rank is registered here, before its exit can be read), an
        exit to its process. At the server's end every rank it forked is dead
        (parent-death signal): each is marked -SIGKILL once it is gone."""
        forked: dict[int, ForkedProcess] = {}
        try:
            while True:
                try:
                    data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 1)
                except OSError:
                    data, fds = b"", []
                if not data:
                    break
                message = json.loads(data)
                if "exited" in message:
                    forked.pop(message["exited"])._set_exit(message["code"])
                elif "started" in message and fds:
                    proc = forked[message["started"]] = ForkedProcess(message["started"], fds[0])
                    replies.put(proc)
                elif "started" in message:  # its pidfd dropped (no descriptor left)
                    replies.put({"failed": f"no pidfd for process {message['started']}"})
                else:  # ready, or a failure
                    replies.put(message)
        finally:  # however the loop ended: no start waits, no rank stays unfinished
            replies.put({"failed": "the fork server exited"})
            for proc in forked.values():
                proc._wait_gone(5.0)  # killed by its parent-death signal: on its way
                proc._set_exit(-signal.SIGKILL)

    def close(self) -> None:
        """Stops the server (its ranks die with it). Idempotent."""
        with self._lock:
            self._stop_locked()

    def _stop_locked(self) -> None:
        if self._sock is not None:
            try:  # wakes the reader thread, and the server sees the end
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5.0)  # it exits when its socket closes
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


# -- the server process ------------------------------------------------------------


def serve(sock: socket.socket) -> None:
    """The server's loop: imports `PRELOAD`, says ready, then forks a rank
    per request and reports each one's exit, until the agent closes `sock`.
    Single-threaded, so that a fork copies no other thread's half-done work."""
    import importlib
    import time

    # a job-wide SIGTERM (Slurm's, systemd's) must not kill the server and, by
    # their parent-death signal, every rank in the middle of its own handling
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    began = time.monotonic()
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 - reported to the agent, then exit
        _send(sock, {"failed": f"import: {type(e).__name__}: {e}"})
        return
    _send(sock, {"ready": round(time.monotonic() - began, 2)})
    pidfds: dict[int, int] = {}  # pidfd -> pid
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd != sock.fileno():
                pid = pidfds.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
            except OSError:
                data, fds = b"", []
            if not data:
                return  # the agent closed: the ranks die with this process
            request = json.loads(data)
            server = os.getpid()
            try:
                pid = os.fork()
            except OSError as e:
                _send(sock, {"failed": str(e)})
            else:
                if pid == 0:
                    _become_rank(request, fds, server=server)
                pidfd = os.pidfd_open(pid)
                pidfds[pidfd] = pid
                poller.register(pidfd, select.POLLIN)
                _send(sock, {"started": pid}, [pidfd])
            finally:
                for f in fds:
                    os.close(f)


def _send(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


def _become_rank(request: dict, fds: list[int], *, server: int) -> None:
    """In the forked child: sets up the process as an exec'd rank would be,
    runs the script, exits with its status. Never returns."""
    code = 1
    try:
        import ctypes
        import fcntl

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != server:
            os._exit(1)
        os.setsid()
        targets: list[int] = request["targets"]
        floor = max([*targets, *fds]) + 1
        high = [fcntl.fcntl(f, fcntl.F_DUPFD_CLOEXEC, floor) for f in fds]
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd > 0 and fd not in high:
                try:
                    os.close(fd)
                except OSError:
                    pass  # the listing's own descriptor
        for h, target in zip(high, targets):
            os.dup2(h, target)
            os.close(h)
        if request["idle"]:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        signal.signal(signal.SIGTERM, signal.SIG_IGN if request["noterm"] else signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _reopen_std_streams(unbuffered=request["unbuffered"]
                            or bool(request["env"].get("PYTHONUNBUFFERED")))
        _rerun_site_hooks()
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()  # seeded once at the server's import
        sys.argv = list(request["argv"])
        sys.path[0] = (os.path.dirname(os.path.abspath(request["script"]))
                       if request["script"] else os.getcwd())
        code = _run(request)
    finally:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").fflush(None)  # C stdio: what native code printed
        finally:
            if code < 0:  # as CPython does: the status says the signal
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code & 0xFF)


def _rerun_site_hooks() -> None:
    """Runs `sitecustomize` and `usercustomize` again, as a fresh interpreter
    would run them in the rank (the server ran them with its own environment);
    an error is printed as the interpreter's `site` prints it."""
    import importlib

    for name in ("sitecustomize", "usercustomize"):
        module = sys.modules.get(name)
        if module is None:
            continue
        try:
            importlib.reload(module)
        except Exception as e:  # noqa: BLE001 - site goes on too
            print(f"Error in {name}; set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}",
                  file=sys.stderr)


def _reopen_std_streams(*, unbuffered: bool) -> None:
    """sys.stdout/sys.stderr on the new descriptors 1 and 2, buffered as a
    fresh interpreter would buffer them (``-u``/PYTHONUNBUFFERED: not at all;
    stdout by lines on a terminal; stderr by lines)."""
    import io

    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        tty = raw.isatty()
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw),
                                  encoding=old.encoding, errors=old.errors,
                                  line_buffering=(name == "stderr" or tty) and not unbuffered,
                                  write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _run(request: dict) -> int:
    """Runs the script or module as ``__main__``; its exit status (minus
    SIGINT: an uncaught KeyboardInterrupt, which the caller ends by)."""
    import atexit
    import runpy
    import traceback

    code = 0
    try:
        if request["module"]:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as e:
        code = _exit_status(e.code)
    except BaseException as e:  # noqa: BLE001 - printed as the interpreter would
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__,
                                                                    "<frozen runpy>"):
            tb = tb.tb_next  # from the script's own frame, as an exec'd rank prints it
        traceback.print_exception(type(e), e, tb)
        # an interrupted interpreter ends by SIGINT once it has cleaned up
        code = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
        del e, tb  # the script's frames, and what they hold, may go
    # as at interpreter exit: threading's exit hooks (they stop idle executor
    # workers), then the non-daemon threads are joined, then atexit
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _exit_status(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
