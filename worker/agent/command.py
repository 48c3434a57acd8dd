"""The ``springback run`` command line of the node agent: its flags
(`add_run_arguments`), their `AgentConfig`, and `run_main`, which runs one
agent with signal handling (SIGTERM / SIGINT start a drain). Bad flags exit
with status 2 and the flag named on stderr; ``python -m
springback.worker.agent`` is `main`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable

from springback.client import env as E
from springback.worker.agent import slurm, storagecreds
from springback.worker.agent.config import AgentConfig
from springback.worker.agent.launch import (
    RankOutput,
    add_torchrun_arguments,
    check_torchrun_flags,
    choose_mode,
    command_for,
    parse_nnodes,
    parse_nproc,
    parse_streams,
)
from springback.worker.agent.node import EXIT_OK, Agent
from springback.worker.agent.library import LibraryRanks
from springback.worker.agent.restart import RestartRanks
from springback.worker.agent.runner import RunnerFactory
from springback.worker.agent.preemption import CLOUDS, CloudNotice, FileNotice, PreemptionSource

log = logging.getLogger("springback.agent")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the `run` options to `p` (the CLI's ``run`` sub-command, whose parent
    parser already defines --coordinator and --token); dispatch to `run_main`."""
    p.add_argument("--job", default=None, help="job id to join (not with --standalone)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default="1",
                   help="local ranks: N, cpu, gpu or auto (as torchrun)")
    p.add_argument("--host", default=os.environ.get(E.HOST),
                   help="address peers reach this node at (default 127.0.0.1; under Slurm "
                        "the address the node's name resolves to, if any)")
    p.add_argument("--drain-timeout-s", type=float, default=60.0)
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int,
                   default=10)
    p.add_argument("--connect-timeout-s", type=float, default=60.0,
                   help="start-up: how long to wait for a coordinator to answer (default 60)")
    p.add_argument("--no-standby", dest="standby", action="store_false",
                   help="do not keep a warm standby rank for fast crash recovery")
    p.add_argument("--fork-server", action=argparse.BooleanOptionalAction, default=None,
                   help="fork ranks from a warm interpreter that imported torch once, "
                        "instead of exec'ing each (docs/worker.md: what differs; default "
                        f"${E.FORK_SERVER}, 1 or 0, else off)")
    p.add_argument("--on-fenced", choices=["rejoin", "exit"], default="rejoin")
    p.add_argument("--collective-timeout-s", type=float, default=None,
                   help="process-group timeout (default: the liveness timeout)")
    p.add_argument("--preemption-file", default=None,
                   help="drain when this file appears (a preemption notice)")
    p.add_argument("--preemption-cloud", choices=CLOUDS, default=None,
                   help="drain on this cloud's spot/preemption notice (its metadata service)")
    p.add_argument("--preemption-endpoint", default=None, metavar="URL",
                   help="the metadata service's address (default: the cloud's own)")
    p.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                   help="serve Prometheus metrics of this node and its ranks at /metrics")
    p.add_argument("--drained-exit-code", type=int, default=EXIT_OK, metavar="N",
                   help="exit status after a drain (SIGTERM, preemption notice); e.g. 143 lets "
                        "a Kubernetes Job replace a drained pod (default 0)")
    p.add_argument("--storage-credentials", metavar="FILE",
                   default=os.environ.get(E.STORAGE_CREDENTIALS_FILE) or None,
                   help="this job's storage credentials, AWS_NAME=VALUE lines in a file only "
                        "this user can read: the agent's and its ranks' only AWS_* variables "
                        f"(${E.STORAGE_CREDENTIALS_FILE})")
    add_torchrun_arguments(p)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the rank command")


def _fork_server(flag: bool | None) -> bool:
    """--fork-server/--no-fork-server, else $SPRINGBACK_FORK_SERVER (1 or 0,
    unset: off); ValueError names the variable for any other value."""
    if flag is not None:
        return flag
    value = os.environ.get(E.FORK_SERVER, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{E.FORK_SERVER}={value!r}: 1 (fork ranks from a fork server) or 0")
    return value == "1"


def _config_from_args(args: argparse.Namespace, job_id: str,
                      coordinator: str | None) -> AgentConfig:
    """The AgentConfig of parsed `run` arguments; ValueError names a bad flag."""
    check_torchrun_flags(args)
    cmd = command_for(list(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd))
    task = slurm.detect()
    host = args.host or (slurm.node_address(task) if task else None) or "127.0.0.1"
    if task is not None:
        slurm.announce(task, host)
    return AgentConfig(
        job_id=job_id, command=cmd, coordinator=coordinator,
        token=getattr(args, "token", None), nproc_per_node=parse_nproc(args.nproc_per_node),
        host=host, drain_timeout_s=args.drain_timeout_s,
        max_restarts=args.max_restarts, standby=args.standby,
        fork_server=_fork_server(args.fork_server), on_fenced=args.on_fenced,
        collective_timeout_s=args.collective_timeout_s, metrics_listen=args.metrics_listen,
        preemption=_notices(args),
        mode=choose_mode(args.mode, cmd) if cmd else "library",
        output=RankOutput(log_dir=args.log_dir,
                          redirects=parse_streams("--redirects", args.redirects),
                          tee=parse_streams("--tee", args.tee)),
        connect_timeout_s=args.connect_timeout_s,
        nnodes=None if args.standalone else parse_nnodes(args.nnodes), slurm=task)


def _notices(args: argparse.Namespace) -> list[PreemptionSource]:
    """The preemption sources the flags name; ValueError for an endpoint
    without a cloud."""
    if args.preemption_endpoint and not args.preemption_cloud:
        raise ValueError("--preemption-endpoint needs --preemption-cloud")
    sources: list[PreemptionSource] = []
    if args.preemption_file:
        sources.append(FileNotice(args.preemption_file))
    if args.preemption_cloud:
        sources.append(CloudNotice(args.preemption_cloud, args.preemption_endpoint))
    return sources


def runner_for(mode: str) -> RunnerFactory:
    """The one place an agent's mode picks what runs its ranks (`runner.py`):
    live ranks for a Session script, torchrun's restarts for an unmodified one."""
    return RestartRanks if mode == "restart" else LibraryRanks


def _run_agent(config: AgentConfig, drained_exit_code: int = EXIT_OK) -> int:
    """Runs one agent with signal handling; a drained agent that ended
    cleanly exits with `drained_exit_code`."""
    agent = Agent(config, runner_for(config.mode))
    log.info("mode %s: %s", config.mode, " ".join(config.command))

    def on_signal(signum: int, _frame: object) -> None:
        # Under Slurm a SIGTERM is the scheduler taking the node (a preemption,
        # scancel, the time limit); elsewhere, or a SIGINT, an operator's drain.
        agent.request_drain(slurm.signal_reason(config.slurm, signum) if config.slurm
                            else f"signal {signal.Signals(signum).name}",
                            preempted=config.slurm is not None and signum == signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    status = agent.run()
    return drained_exit_code if status == EXIT_OK and agent.drain_requested else status


Standalone = Callable[[str, "tuple[int, int] | None", Callable[[str, str], int]], int]
"""``(name, nnodes, run_agent) -> status``: brings up a local etcd + coordinator,
submits a one-node job and returns ``run_agent(coordinator, job_id)``. The CLI
passes `springback.cli.standalone.run_standalone`; the agent itself knows no
coordinator code."""


def run_main(args: argparse.Namespace, standalone: Standalone | None = None) -> int:
    """Runs the agent for parsed `run` arguments; returns the exit status
    (2 for bad arguments, with the flag named on stderr). ``--standalone``
    needs `standalone` (given by the `springback` CLI)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    coordinator = getattr(args, "coordinator", None)
    try:
        if args.standalone and (args.job or coordinator):
            raise ValueError("--standalone starts its own coordinator and job: "
                             "drop --job and --coordinator")
        if args.standalone and standalone is None:
            raise ValueError("--standalone is a `springback run` option (the CLI starts "
                             "the local coordinator)")
        if not args.standalone and not args.job:
            raise ValueError("--job is required (or --standalone)")
        config = _config_from_args(args, args.job or "standalone", coordinator)
        if args.storage_credentials:
            names = storagecreds.apply(args.storage_credentials)
            log.info("storage credentials from %s: %s", args.storage_credentials, ", ".join(names))
        if standalone is None or not args.standalone:
            return _run_agent(config, args.drained_exit_code)
        nnodes = parse_nnodes(args.nnodes)
    except ValueError as e:
        print(f"springback run: {e}", file=sys.stderr)
        return 2
    name = os.path.splitext(os.path.basename(config.command[-1]))[0].lower()
    name = "".join(c if c.isalnum() else "-" for c in name).strip("-") or "standalone"
    return standalone(name, nnodes, lambda address, job_id: _run_agent(
        dataclasses.replace(config, coordinator=address, job_id=job_id)))


def main(argv: list[str] | None = None) -> int:
    """``python -m springback.worker.agent …``: the `run` command without the CLI."""
    p = argparse.ArgumentParser(prog="springback run")
    p.add_argument("--coordinator", default=None,
                   help="coordinator ADDR[,ADDR...] (or SPRINGBACK_COORDINATOR)")
    p.add_argument("--token", default=None, help="bearer token (or SPRINGBACK_TOKEN)")
    add_run_arguments(p)
    return run_main(p.parse_args(argv))
