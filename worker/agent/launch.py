"""How `springback run` launches ranks: the mode, torchrun's flags, rank output.

Mode (``--mode``, default ``auto``): ``library`` for a script that uses
`springback.worker.Session` (ranks live through generations, warm standbys),
``restart`` for an unmodified torchrun script (ranks restarted with torchrun's
environment on every generation, `restart.py`). ``auto`` reads the script
named by the command (``python train.py``, ``python -m pkg.mod``, ``train.py``)
without running it: a script that imports ``springback.worker`` runs in
library mode, any other in restart mode. A command auto cannot inspect (a
shell wrapper, a binary) is refused with a message asking for ``--mode``.

torchrun's flags, mapped where they make sense here (`check_torchrun_flags`
refuses the others with the reason): ``--nnodes N`` / ``MIN:MAX`` (checked
against the job's min/max workers; with ``--standalone`` it must be 1),
``--nproc-per-node N|cpu|gpu|auto``, ``--standalone``, ``--log-dir``,
``--redirects`` and ``--tee`` (``0`` none, ``1`` stdout, ``2`` stderr, ``3``
both; or per local rank ``0:1,1:3``), ``--max-restarts``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import IO, TextIO

from springback.worker.agent.rankprocess import RankProcess, RankStarter

MODES = ("auto", "library", "restart")

UNSUPPORTED = {
    "node_rank": "springback assigns node ranks per generation (GROUP_RANK); drop --node-rank",
    "rdzv_backend": "the springback coordinator is the rendezvous; pass --coordinator ADDR",
    "rdzv_endpoint": "the springback coordinator is the rendezvous; pass --coordinator ADDR",
    "rdzv_id": "the job id is the run id; pass --job JOB",
    "rdzv_conf": "rendezvous settings live in the coordinator (e.g. --liveness-timeout-s)",
    "master_addr": "MASTER_ADDR/MASTER_PORT are set per generation by the agent of node rank 0",
    "master_port": "MASTER_ADDR/MASTER_PORT are set per generation by the agent of node rank 0",
    "module": "pass the whole command after --, e.g. -- python -m pkg.train",
    "no_python": "pass the whole command after --, e.g. -- ./train.sh",
    "start_method": "ranks are always started as new processes (spawn)",
}
"""torchrun flags that have no meaning under springback, with what to do instead."""


def add_torchrun_arguments(p: argparse.ArgumentParser) -> None:
    """Adds torchrun's flags (with torchrun's ``_`` spellings) to the `run` parser."""
    add = p.add_argument
    add("--mode", choices=MODES, default="auto",
        help="library (Session), restart (unmodified torchrun script) or auto (default)")
    add("--nnodes", default=None, metavar="N|MIN:MAX",
        help="must equal the job's min:max workers (with --standalone: 1)")
    add("--standalone", action="store_true",
        help="start a local etcd + coordinator, submit a job, run one agent")
    add("--log-dir", "--log_dir", dest="log_dir", default=None,
        help="write each rank's stdout/stderr under this directory")
    add("--redirects", "-r", default="0", help="0|1|2|3 or LR:N,...: output to files only")
    add("--tee", "-t", default="0", help="0|1|2|3 or LR:N,...: output to files and console")
    for name in UNSUPPORTED:
        flag = "--" + name.replace("_", "-")
        add(flag, "--" + name, dest=f"unsupported_{name}", default=None, nargs="?", const=True,
            help=argparse.SUPPRESS)


def check_torchrun_flags(args: argparse.Namespace) -> None:
    """Raises ValueError naming the first torchrun flag that makes no sense here."""
    for name, why in UNSUPPORTED.items():
        if getattr(args, f"unsupported_{name}", None) is not None:
            raise ValueError(f"--{name.replace('_', '-')} is not supported: {why}")


def parse_nnodes(value: str | None) -> tuple[int, int] | None:
    """``N`` or ``MIN:MAX`` as (min, max); None for None."""
    if value is None:
        return None
    lo, sep, hi = value.partition(":")
    try:
        low, high = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(f"--nnodes must be N or MIN:MAX, got {value!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"--nnodes {value}: need 1 <= MIN <= MAX")
    return low, high


def parse_nproc(value: str) -> int:
    """torchrun's ``--nproc-per-node``: a count, ``cpu``, ``gpu`` or ``auto``."""
    if value.isdigit():
        return int(value)
    if value in ("gpu", "cuda", "auto"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        if value != "auto":
            raise ValueError(f"--nproc-per-node {value}: no CUDA device is visible")
        return os.cpu_count() or 1
    if value == "cpu":
        return os.cpu_count() or 1
    raise ValueError(f"--nproc-per-node must be a number, cpu, gpu or auto, got {value!r}")


def parse_streams(flag: str, value: str) -> dict[int, int] | int:
    """``--redirects``/``--tee``: one code for every local rank, or ``LR:CODE,...``."""
    def code(raw: str) -> int:
        if raw not in ("0", "1", "2", "3"):
            raise ValueError(f"{flag} {value!r}: a stream code is 0 (none), 1 (stdout), "
                             "2 (stderr) or 3 (both)")
        return int(raw)

    if ":" not in value:
        return code(value)
    out: dict[int, int] = {}
    for part in value.split(","):
        lr, _, raw = part.partition(":")
        if not lr.strip().isdigit():
            raise ValueError(f"{flag} {value!r}: expected LOCAL_RANK:CODE, got {part!r}")
        out[int(lr)] = code(raw.strip())
    return out


def command_for(cmd: list[str]) -> list[str]:
    """torchrun's convenience: ``train.py ARGS`` runs as ``python train.py ARGS``."""
    if cmd and cmd[0].endswith(".py") and not os.access(cmd[0], os.X_OK):
        return [sys.executable, *cmd]
    return cmd


def _script_source(cmd: list[str]) -> str | None:
    """Source of the Python script the command runs, or None when it is not one."""
    if not cmd:
        return None
    exe = os.path.basename(cmd[0])
    args = cmd[1:] if exe.startswith("python") else cmd
    if exe.startswith("python"):
        args = [a for a in args if not (a.startswith("-") and a not in ("-m",))]
    if not args:
        return None
    if args[0] == "-m" and len(args) > 1:
        spec = importlib.util.find_spec(args[1])
        origin = spec.origin if spec is not None else None
    else:
        origin = args[0] if args[0].endswith(".py") else shutil.which(args[0])
    if not origin or not os.path.isfile(origin):
        return None
    try:
        with open(origin, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def uses_session(source: str) -> bool:
    """Whether Python `source` imports ``springback.worker`` (library mode)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        if any(n == "springback.worker" or n.startswith("springback.worker.") for n in names):
            return True
    return False


def choose_mode(mode: str, cmd: list[str]) -> str:
    """Resolves ``auto``; raises ValueError when the command cannot be inspected."""
    if mode != "auto":
        return mode
    source = _script_source(cmd)
    if source is None:
        raise ValueError(f"--mode auto cannot tell how {' '.join(cmd)!r} trains: pass "
                         "--mode library (a Session script) or --mode restart (a torchrun script)")
    try:
        return "library" if uses_session(source) else "restart"
    except SyntaxError as e:
        raise ValueError(f"--mode auto: cannot parse {cmd}: {e}; pass --mode") from None


@dataclass
class RankOutput:
    """Where ranks' stdout/stderr go: the agent's own by default; files under
    `log_dir` (``<log_dir>/<attempt>/<local_rank>/{stdout,stderr}.log``, the
    attempt being ``attempt_<restart count>`` in restart mode and
    ``proc_<n>`` in library mode) for the streams `redirects` names; files
    and the console for those `tee` names."""

    log_dir: str | None = None
    redirects: dict[int, int] | int = 0
    tee: dict[int, int] | int = 0
    _pumps: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        if (self.redirects or self.tee) and not self.log_dir:
            raise ValueError("--redirects/--tee write to files: pass --log-dir DIR too")

    def _code(self, which: dict[int, int] | int, local_rank: int) -> int:
        return which.get(local_rank, 0) if isinstance(which, dict) else which

    def to_files(self, local_rank: int) -> bool:
        """Whether `local_rank`'s output goes to files (then it is not shipped
        as rank logs)."""
        return bool(self.log_dir and (self._code(self.redirects, local_rank)
                                      or self._code(self.tee, local_rank)))

    def launch(self, starter: RankStarter, environ: dict[str, str], *, local_rank: int,
               attempt: str, idle: bool = False,
               pass_fds: tuple[int, ...] = ()) -> RankProcess:
        """Starts a rank by `starter` with its output placed as configured
        (`idle` and `pass_fds` as `RankStarter.start`'s)."""
        redirect, tee = self._code(self.redirects, local_rank), self._code(self.tee, local_rank)
        if not self.log_dir or not (redirect or tee):
            return starter.start(environ, idle=idle, pass_fds=pass_fds)
        directory = os.path.join(self.log_dir, attempt, str(local_rank))
        os.makedirs(directory, exist_ok=True)
        targets: dict[str, IO[bytes] | int | None] = {}
        files: dict[str, IO[bytes]] = {}
        for bit, name in ((1, "stdout"), (2, "stderr")):
            if (redirect | tee) & bit:
                files[name] = open(os.path.join(directory, f"{name}.log"), "ab")  # noqa: SIM115
            targets[name] = subprocess.PIPE if tee & bit else files.get(name)
        proc = starter.start(environ, idle=idle, stdout=targets["stdout"],
                             stderr=targets["stderr"], pass_fds=pass_fds)
        for name, console in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            if targets[name] is subprocess.PIPE:
                pump = threading.Thread(target=_tee, args=(getattr(proc, name), files[name],
                                                           console),
                                        daemon=True, name=f"tee-{local_rank}-{name}")
                pump.start()
                self._pumps.append(pump)
            elif name in files:
                files[name].close()  # the child holds its own descriptor
        return proc


def _tee(pipe: IO[bytes], log_file: IO[bytes], console: TextIO) -> None:
    with pipe, log_file:
        for line in iter(pipe.readline, b""):
            log_file.write(line)
            log_file.flush()
            console.buffer.write(line)
            console.flush()
