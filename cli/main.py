"""The `springback` command line.

Global options (accepted before or after the subcommand):
``--coordinator ADDR[,ADDR…]`` ($SPRINGBACK_COORDINATOR), ``--token``
($SPRINGBACK_TOKEN), ``--token-file`` ($SPRINGBACK_TOKEN_FILE: its first
line; it wins over $SPRINGBACK_TOKEN, and a ``--token`` on the command line,
which every local user sees in /proc/*/cmdline, is logged as a warning), ``--json`` (machine-readable output, one object per
line for streams). Exit codes: 0 success, 1 the API refused or failed, 2 bad
usage or input (the message names the field or file).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any


from rich.console import Console
from rich.live import Live
from rich.text import Text

from springback import __version__
from springback.service import logs
from springback.service.policy.pacing import DEFAULT_BUDGET_PER_S
from springback.client import env
from springback.cli.history import add_job_commands, history_if_finished
from springback.cli.slurm import add_slurm_command
from springback.client.summary import job_summary
from springback.client.api import ApiError, Client
from springback.client.errors import InvalidArgument
from springback.v1 import types_pb2 as pb

if TYPE_CHECKING:
    from springback.service.etcd.store import EtcdSecurity


ETCD_CREDENTIALS_DIR = "etcd-credentials"
"""`springback up`'s etcd credentials, under its --state-dir (0700, files 0600)."""

log = logging.getLogger(__name__)


def read_token_file(path: str) -> str:
    """The first line of `path`, stripped. Raises InvalidArgument naming
    ``token-file`` for a file that cannot be read or whose first line is empty."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument("token-file", f"{path!r} cannot be read: "
                              f"{getattr(e, 'strerror', None) or e}") from None
    if not token:
        raise InvalidArgument("token-file", f"{path!r}: its first line is empty")
    return token


def _resolve_token(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """Sets ``args.token`` from ``--token-file`` / $SPRINGBACK_TOKEN_FILE when
    given (refusing it beside a ``--token`` on the command line), and warns
    about a ``--token`` on the command line."""
    on_command_line = any(a == "--token" or a.startswith("--token=") for a in argv)
    if on_command_line:
        log.warning("--token on the command line is visible to every local user "
                    "(/proc/*/cmdline, ps): use --token-file or $%s (or $%s)",
                    env.TOKEN_FILE, env.TOKEN)
    token_file = getattr(args, "token_file", None)
    if token_file:
        if on_command_line:
            raise InvalidArgument("token-file", "give --token or --token-file, not both")
        args.token = read_token_file(token_file)


def _human_job(job: pb.Job, events: list | None = None) -> str:
    s = job_summary(job, events)
    ckpt = s["last_checkpoint"]
    lines = [
        f"job        {s['id']} ({s['name']})",
        f"state      {s['state']}   {s['message']}",
        f"generation {s['generation']}   world size {s['world_size']}",
        f"members    {', '.join(s['members']) or '-'}"
        + (f"   spares {', '.join(s['spares'])}" if s["spares"] else ""),
        f"progress   step {s['step']}/{s['max_steps']}   samples {s['samples_consumed']}"
        f"   loss {s['loss']:.4f}",
        f"checkpoint {'step %d at %s' % (ckpt['step'], ckpt['uri']) if ckpt else '-'}",
        f"recovery   {s['restores']} restores from checkpoints   {s['steps_redone']} steps "
        f"redone   {s['failures']} rank failures",
    ]
    for t in s["member_timing"]:  # per member: the precursor of a straggler (docs/controls.md)
        lines.append(f"timing     {t['member']}: compute p50 {t['compute_p50_s'] * 1e3:.1f} ms"
                     f"   collective p50 {t['collective_p50_s'] * 1e3:.1f} ms"
                     f"   ({t['steps']} steps)")
    if s["state_losses"]:
        lines.append(f"STATE LOST {s['state_losses']} times: {s['steps_lost']} trained steps "
                     f"thrown away (started from scratch)")
    if job.status.num_store_intrusions:  # docs/security.md: an outsider at the store
        lines.append(f"INTRUSION  {job.status.num_store_intrusions} attempts on the rendezvous "
                     f"store; last: {job.status.last_store_intrusion}")
    if s["checkpoint_error"]:
        lines.append(f"ckpt error {s['checkpoint_error']}")
    if "badput" in s:
        b, c = s["badput"], s["cost"]
        lines.append(f"wall time  {b['wall_s']:.1f}s: " + "  ".join(
            f"{k} {v:.1f}s" for k, v in b["causes_s"].items() if v))
        lines.append(f"node-hours {c['node_hours']:.3f} ({c['node_hours_spares']:.3f} spares, "
                     f"{c['node_hours_useful']:.3f} useful)" + (
                         f"   cost {c['cost']:.4g}, {c['cost_per_useful_step'] or 0:.4g} per "
                         f"useful step, {c['cost_per_1000_samples'] or 0:.4g} per 1,000 samples"
                         if c["cost"] is not None else ""))
    return "\n".join(lines)


def _progress_line(job: pb.Job, event: str) -> str:
    s = job_summary(job)
    return (f"[gen {s['generation']:>3}] {s['state']:<9} world {s['world_size']:>3}  "
            f"step {s['step']:>6}/{s['max_steps']}  loss {s['loss']:.4f}  {event}")


class _Printer:
    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def job(self, job: pb.Job) -> None:
        print(json.dumps(job_summary(job)) if self.as_json else _human_job(job))


def _client(args: argparse.Namespace) -> Client:
    return Client(args.coordinator, token=args.token)


def _job_command(args: argparse.Namespace) -> int:
    out = _Printer(args.json)
    with _client(args) as client:
        action = args.job_action
        if action == "submit":
            out.job(client.create_job(args.file))
        elif action == "get":
            job, events = client.list_job_events(args.job)
            print(json.dumps(job_summary(job, events)) if args.json
                  else _human_job(job, events))
        elif action == "list":
            jobs = client.list_jobs()
            if args.json:
                print(json.dumps([job_summary(j) for j in jobs]))
            else:
                for j in jobs:
                    s = job_summary(j)
                    print(f"{s['id']:<28} {s['state']:<10} gen {s['generation']:>4}  "
                          f"world {s['world_size']:>3}  step {s['step']}/{s['max_steps']}")
        elif action == "scale":
            out.job(client.scale_job(args.job, args.min, args.max))
        elif action in ("pause", "resume", "cancel"):
            out.job(getattr(client, f"{action}_job")(args.job))
        elif action == "restore":
            out.job(client.restore_job(args.job, args.step))
        elif action == "watch":
            _watch(client, args)
        elif action == "join-credential":
            credential = client.issue_join_credential(args.job)
            print(json.dumps({"id": args.job, "credential": credential}) if args.json
                  else credential)
    return 0


def _watch(client: Client, args: argparse.Namespace) -> None:
    if history_if_finished(client, args):
        return
    events = client.watch_job(args.job)
    if args.json:
        for job, event in events:
            print(json.dumps({"event": event, **job_summary(job)}), flush=True)
        return
    console = Console(highlight=False)
    if not console.is_terminal:
        for job, event in events:
            print(_progress_line(job, event), flush=True)
        return
    show_live(events, console)


def show_live(events: Iterable[tuple[pb.Job, str]], console: Console) -> None:
    """The terminal view of `job watch`: step events of one generation rewrite
    the current line in place (a `rich` live view); a new generation or any
    other event keeps the current line and starts a new one."""
    current: str | None = None
    generation = None
    with Live(console=console, auto_refresh=False) as live:
        for job, event in events:
            line = _progress_line(job, event)
            if current is not None and (job.status.generation != generation
                                        or not event.startswith("step")):
                live.console.print(Text(current))  # keep it above the live line
            current, generation = line, job.status.generation
            live.update(Text(line), refresh=True)


def _ckpt_command(args: argparse.Namespace) -> int:
    # Imported here: storage pulls in torch, which the job commands do not need.
    from springback.cli import checkpoints

    return checkpoints.command(args, _client, _Printer(args.json))


def _etcd_security(args: argparse.Namespace) -> EtcdSecurity | None:
    """The --etcd-* flags; the password is read from its file (never a flag)."""
    from springback.service.etcd.store import EtcdSecurity  # noqa: F811 (at run time)

    password = None
    if args.etcd_password_file:
        try:
            with open(args.etcd_password_file, encoding="utf-8") as f:
                password = f.readline().rstrip("\r\n")
        except OSError as e:
            raise InvalidArgument("etcd-password-file", f"{args.etcd_password_file!r} cannot be "
                                  f"read: {e.strerror or e}") from None
    files = (args.etcd_ca, args.etcd_cert, args.etcd_key, args.etcd_user, password)
    if all(v is None for v in files):
        return None
    return EtcdSecurity(ca_file=args.etcd_ca, cert_file=args.etcd_cert, key_file=args.etcd_key,
                        user=args.etcd_user, password=password)


def _coordinator_command(args: argparse.Namespace) -> int:
    from springback.service.transport.config import CoordinatorConfig
    from springback.service.transport.server import CoordinatorServer

    config = CoordinatorConfig(
        etcd=args.etcd, etcd_security=_etcd_security(args), listen=args.listen, advertise=args.advertise, token=args.token,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
        liveness_timeout_s=args.liveness_timeout_s, leader_ttl_s=args.leader_ttl_s,
        heartbeat_budget_per_s=args.heartbeat_budget_per_s,
        metrics_listen=args.metrics_listen, drain_s=args.drain_s, insecure=args.insecure,
        client_keepalive_s=args.client_keepalive_s, viewer_token=args.viewer_token, tls_roles=args.tls_roles,
        metrics_tls_cert=args.metrics_tls_cert, metrics_tls_key=args.metrics_tls_key,
    )
    server = CoordinatorServer(config)
    server.start()
    print(json.dumps({"address": server.address}) if args.json
          else f"coordinator serving on {server.address}", flush=True)
    _serve_until_signal(server.stop)
    return 0


def _serve_until_signal(stop: Callable[[], None]) -> None:
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    stop()


def _up_command(args: argparse.Namespace) -> int:
    """etcd on loopback behind TLS, client certificates and etcd's auth (user
    ``springback``, keys under ``/springback/`` only; credentials made at the
    first start in ``STATE_DIR/etcd-credentials``, reused after: see
    `springback.cli.etcd_credentials`), and a coordinator on it."""
    from springback.cli.etcd_credentials import local_credentials
    from springback.cli.local import EtcdServer
    from springback.service.transport.config import CoordinatorConfig
    from springback.service.transport.server import CoordinatorServer

    def config(endpoint: str, security: EtcdSecurity | None = None) -> CoordinatorConfig:
        return CoordinatorConfig(
            etcd=endpoint, etcd_security=security, listen=args.listen, token=args.token,
            insecure=args.insecure, viewer_token=args.viewer_token,
            liveness_timeout_s=args.liveness_timeout_s, metrics_listen=args.metrics_listen)

    config("http://127.0.0.1:0")  # bad settings are refused before etcd starts
    credentials = os.path.join(args.state_dir, ETCD_CREDENTIALS_DIR)
    etcd = EtcdServer(os.path.join(args.state_dir, "etcd"), client_port=args.etcd_port,
                      tls=local_credentials(credentials))
    etcd.start()
    server = CoordinatorServer(config(etcd.endpoint, etcd.client_security))
    server.start()
    if not server.wait_for_leadership(timeout_s=15):
        server.stop()
        etcd.stop()
        raise RuntimeError("the local coordinator did not become leader within 15 s")
    print(f"etcd        {etcd.endpoint} (data in {etcd.data_dir}, credentials in {credentials})")
    print(f"coordinator {server.address}")
    if server.metrics_address:
        print(f"metrics     http://{server.metrics_address}/metrics")
    print(f"export {env.COORDINATOR}={server.address}", flush=True)

    def stop() -> None:
        server.stop()
        etcd.stop()

    _serve_until_signal(stop)
    return 0


def _add_global(parser: argparse.ArgumentParser, suppress: bool) -> None:
    default: Callable[[Any], Any] = (lambda _: argparse.SUPPRESS) if suppress else (lambda v: v)
    parser.add_argument("--coordinator", default=default(os.environ.get(env.COORDINATOR)),
                        help=f"coordinator address(es), comma-separated (${env.COORDINATOR})")
    parser.add_argument("--token", default=default(os.environ.get(env.TOKEN)),
                        help=f"bearer token (${env.TOKEN}); on the command line every local "
                             "user can read it: prefer --token-file")
    parser.add_argument("--token-file", metavar="FILE",
                        default=default(os.environ.get(env.TOKEN_FILE) or None),
                        help=f"file whose first line is the bearer token (${env.TOKEN_FILE}); "
                             f"wins over ${env.TOKEN}")
    parser.add_argument("--json", action="store_true", default=default(False),
                        help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="springback", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"springback {__version__}")
    _add_global(parser, suppress=False)
    common = argparse.ArgumentParser(add_help=False)
    _add_global(common, suppress=True)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", parents=[common], help="local etcd + coordinator")
    up.add_argument("--state-dir", default=os.path.expanduser("~/.springback"))
    up.add_argument("--listen", default="127.0.0.1:7070")
    up.add_argument("--etcd-port", type=int, default=2379)
    up.add_argument("--liveness-timeout-s", type=float, default=5.0)
    up.add_argument("--metrics-listen", help="HOST:PORT for Prometheus /metrics")
    up.add_argument("--viewer-token", default=os.environ.get(env.VIEWER_TOKEN) or None,
                    help=f"a read-only token: job reads and the dashboard (or {env.VIEWER_TOKEN})")
    up.add_argument("--insecure", action="store_true",
                    help="allow a --listen other hosts can reach without --token")
    up.set_defaults(handler=_up_command)

    coord = commands.add_parser("coordinator", parents=[common], help="run a coordinator replica")
    coord.add_argument("--etcd", required=True,
                       help="etcd endpoint(s), http://HOST:PORT[,…] or https://… (needs --etcd-ca)")
    coord.add_argument("--etcd-ca", metavar="FILE", help="CA that signed etcd's certificate")
    coord.add_argument("--etcd-cert", metavar="FILE", help="client certificate for etcd")
    coord.add_argument("--etcd-key", metavar="FILE", help="key of --etcd-cert")
    coord.add_argument("--etcd-user", metavar="NAME", help="etcd user (needs --etcd-password-file)")
    coord.add_argument("--etcd-password-file", metavar="FILE",
                       help="file holding --etcd-user's password (first line)")
    coord.add_argument("--listen", default="127.0.0.1:7070")
    coord.add_argument("--advertise", help="address other replicas reach this one at")
    coord.add_argument("--viewer-token", default=os.environ.get(env.VIEWER_TOKEN) or None,
                       help=f"a read-only token: job reads and the dashboard (or {env.VIEWER_TOKEN})")
    coord.add_argument("--insecure", action="store_true",
                       help="allow a --listen other hosts can reach without --token")
    coord.add_argument("--tls-cert")
    coord.add_argument("--tls-key")
    coord.add_argument("--tls-client-ca", help="require client certificates signed by this CA")
    coord.add_argument("--tls-roles", metavar="FILE",
                       help="map client certificates to roles: CN=<name>:<role> or "
                            "SAN=<name>:<role> lines (operator, viewer, replica)")
    coord.add_argument("--liveness-timeout-s", type=float, default=5.0)
    coord.add_argument("--heartbeat-budget-per-s", type=float, default=DEFAULT_BUDGET_PER_S,
                       help="heartbeats per second this replica aims to serve: members are told "
                            "a longer interval as they grow, up to half the liveness timeout "
                            f"(default {DEFAULT_BUDGET_PER_S:g})")
    coord.add_argument("--leader-ttl-s", type=int, default=3)
    coord.add_argument("--metrics-listen", help="HOST:PORT for Prometheus /metrics")
    coord.add_argument("--metrics-tls-cert", metavar="FILE",
                       help="serve /metrics and the dashboard over HTTPS (with --metrics-tls-key)")
    coord.add_argument("--metrics-tls-key", metavar="FILE")
    coord.add_argument("--drain-s", type=float, default=5.0,
                       help="on SIGTERM: seconds of health NOT_SERVING, leadership handed over, "
                            "calls forwarded, before the server stops (default 5)")
    coord.add_argument("--client-keepalive-s", type=float, default=30.0,
                       help="ping each client connection every this many seconds; close it "
                            "when a ping is not answered within as long again (default 30)")
    coord.set_defaults(handler=_coordinator_command)

    job = commands.add_parser("job", parents=[common], help="submit and control jobs")
    actions = job.add_subparsers(dest="job_action", required=True)
    actions.add_parser("submit", parents=[common], help="submit a YAML/JSON spec").add_argument("file")
    actions.add_parser("list", parents=[common], help="list jobs")
    for name in ("get", "pause", "resume", "cancel", "watch"):
        actions.add_parser(name, parents=[common], help=f"{name} a job").add_argument("job")
    scale = actions.add_parser("scale", parents=[common], help="change min/max workers")
    scale.add_argument("job")
    scale.add_argument("--min", type=int, required=True)
    scale.add_argument("--max", type=int, required=True)
    restore = actions.add_parser("restore", parents=[common], help="restore a committed step")
    restore.add_argument("job")
    restore.add_argument("--step", type=int, default=0, help="committed step (default newest)")
    actions.add_parser("join-credential", parents=[common],
                       help="print the job's join credential, for its agents' --token "
                            "(joins and reads that job only)").add_argument("job")
    job.set_defaults(handler=_job_command)
    add_job_commands(actions, common)

    ckpt = commands.add_parser("ckpt", parents=[common], help="checkpoints")
    ckpt_actions = ckpt.add_subparsers(dest="ckpt_action", required=True)
    ckpt_actions.add_parser("list", parents=[common], help="committed checkpoints").add_argument("job")
    ckpt_actions.add_parser("verify", parents=[common], help="verify checksums").add_argument("uri")
    ckpt_restore = ckpt_actions.add_parser("restore", parents=[common], help="restore a step")
    ckpt_restore.add_argument("job")
    ckpt_restore.add_argument("--step", type=int, default=0)
    ckpt.set_defaults(handler=_ckpt_command)

    add_slurm_command(commands, common, _client)
    _add_run_command(commands, common)
    return parser


def _add_run_command(commands: Any, common: argparse.ArgumentParser) -> None:
    # Imported here: the agent pulls in torch, which the other commands do not need.
    from springback.cli.standalone import run_standalone
    from springback.worker.agent.command import add_run_arguments, run_main

    run = commands.add_parser("run", parents=[common], help="node agent: join a job, run CMD")
    add_run_arguments(run)
    run.set_defaults(handler=lambda args: run_main(args, standalone=run_standalone))


def main(argv: Sequence[str] | None = None) -> int:
    logs.configure()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        _resolve_token(args, argv)
        return int(args.handler(args) or 0)
    except ApiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1  # refused before sending: bad input
    except (InvalidArgument, ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
