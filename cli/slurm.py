"""``springback slurm keep``: keeps a job at size on a Slurm cluster.

A small keeper process beside the job (on a login node, or wherever the
operator runs the CLI): it reads the job through the job API every
``--poll-s`` seconds and, while the job's live members (active plus hot
spares) are fewer than its target (``--target``, default the job's
``max_workers``), submits replacement agent jobs with ``sbatch`` to
``--partition``: one single-node job per missing member, each running the
agent command given after ``--`` under ``srun --no-kill``, or the operator's
own sbatch script (``--script``). It never submits while one of its earlier
submissions is still PENDING in ``squeue`` (capacity has not freed: more
submissions would only queue beside it), waits a back-off after every
submission round (doubling up to ``--max-backoff-s`` while the job stays
short, reset once it is back at size), and stops submitting after
``--max-submissions`` in all. Every decision is printed as a line (one JSON
object with ``--json``). When the job ends it cancels its submissions still
PENDING (they would start agents for an ended job) and exits 0.

Failure behaviour: a coordinator that does not answer (UNAVAILABLE,
DEADLINE_EXCEEDED) or an ``squeue`` that fails is a decision to hold
(printed), retried at the next poll; an unknown job (NOT_FOUND) or a refused
token ends the keeper with status 1; an ``sbatch`` that fails is printed
with its error and counts as a submission (against the cap and for the
back-off), so a wrong partition cannot make it submit forever.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from springback.client import env as E
from springback.client.api import ApiError, Client
from springback.v1 import types_pb2 as pb

ENDED = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)
TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
SLURM_TIMEOUT_S = 30.0
"""Deadline of one ``sbatch``, ``squeue`` or ``scancel`` call."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeeperConfig:
    """What `Keeper` submits, where, and how often."""

    job: str
    """The Springback job id to keep at size."""
    partition: str
    """The Slurm partition the replacement agent jobs go to (``sbatch --partition``)."""
    agent_command: tuple[str, ...] = ()
    """The agent command (``springback run --job …  -- python train.py``),
    run as ``srun --no-kill -N1 --ntasks-per-node=1 COMMAND`` in an
    ``sbatch --wrap``. Exactly one of this and `script`."""
    script: str | None = None
    """An sbatch script to submit instead (it runs the agent itself)."""
    target: int | None = None
    """Live members to keep; None: the job's ``max_workers`` (read at every poll)."""
    sbatch_args: tuple[str, ...] = ()
    """More ``sbatch`` options (``--gpus-per-node=8``, ``--time=…``, ``--requeue``)."""
    poll_s: float = 5.0
    """Seconds between reads of the job."""
    backoff_s: float = 30.0
    """Seconds after a submission round before the next one; doubles per round
    while the job stays short, back to this once it is at size."""
    max_backoff_s: float = 600.0
    """The longest back-off."""
    max_submissions: int = 20
    """Submissions in all (failed sbatch calls included); then it only watches."""

    def __post_init__(self) -> None:
        if bool(self.agent_command) == bool(self.script):
            raise ValueError("give the agent command after '--' or --script FILE, not both "
                             "and not neither")
        if not self.partition:
            raise ValueError("--partition is required: the partition replacement agents go to")
        if self.target is not None and self.target < 1:
            raise ValueError(f"--target must be at least 1 (got {self.target})")
        if self.poll_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("--poll-s must be > 0 and 0 <= --backoff-s <= --max-backoff-s")
        if self.max_submissions < 0:
            raise ValueError(f"--max-submissions must be >= 0 (got {self.max_submissions})")


@dataclasses.dataclass(frozen=True)
class Decision:
    """One thing the keeper decided, as it prints it."""

    action: str  # submit, submitted, submit_failed, hold, at_size, capped, ended, cancel
    live: int | None
    target: int | None
    detail: str

    def line(self) -> str:
        size = (f"live {self.live}/{self.target}" if self.live is not None
                and self.target is not None else "live ?")
        return f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} keep {size}: {self.detail}"


class Keeper:
    """Keeps `config.job` at size by submitting agent jobs; `run` until it ends.

    `client` is the job API (an operator's or submitter's token: it reads the
    job and issues the job's join credential, which the submitted agents get
    as ``$SPRINGBACK_TOKEN``); `report` is called with every decision.
    """

    def __init__(self, config: KeeperConfig, client: Client, coordinator: str | None,
                 report: Callable[[Decision], None], *,
                 slurm_env: dict[str, str] | None = None) -> None:
        self.config = config
        self._client = client
        self._coordinator = coordinator
        self._report = report
        self._env = dict(os.environ if slurm_env is None else slurm_env)
        self.submitted: list[str] = []  # Slurm job ids of successful submissions
        self.attempts = 0
        self._backoff_s = config.backoff_s
        self._next_round = 0.0  # monotonic time before which no round starts
        self._last_said: tuple[str, int | None, int | None, str] | None = None
        self._credential: str | None = None
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Makes `run` return after its current poll (from another thread or a signal)."""
        self._stopped.set()

    def run(self) -> pb.Job | None:
        """Polls and submits until the job ends (returns it) or `stop` (None).
        Raises ApiError for NOT_FOUND or a refused token."""
        while not self._stopped.is_set():
            job = self.poll()
            if job is not None and job.status.state in ENDED:
                return job
            self._stopped.wait(self.config.poll_s)
        return None

    def poll(self) -> pb.Job | None:
        """One decision: reads the job, and submits when it is short and no
        earlier submission is pending. Returns the job (None when the
        coordinator did not answer)."""
        try:
            job = self._client.get_job(self.config.job)
        except ApiError as e:
            if e.code not in TRANSIENT:
                raise
            self._say("hold", None, None, f"the coordinator did not answer ({e}); retrying",
                      key="unavailable")
            return None
        live = len(job.status.members) + len(job.status.spares)
        target = self.config.target or job.spec.max_workers
        if job.status.state in ENDED:
            self._cancel_pending(live, target)
            self._say("ended", live, target, f"job {job.id} ended "
                      f"{pb.JobState.Name(job.status.state).removeprefix('JOB_STATE_')}; "
                      f"{len(self.submitted)} agent jobs submitted; stopping")
            return job
        if live >= target:
            if self._backoff_s != self.config.backoff_s:
                self._say("at_size", live, target, f"at size again; the next back-off "
                          f"is {self.config.backoff_s:.0f}s")
            self._backoff_s = self.config.backoff_s
            return job
        try:
            pending = self._pending()
        except (OSError, subprocess.SubprocessError) as e:
            self._say("hold", live, target, f"squeue failed ({e}); retrying", key="squeue")
            return job
        if pending:
            self._say("hold", live, target, f"{len(pending)} submitted agent job(s) still "
                      f"PENDING ({', '.join(pending)}): not submitting more")
            return job
        left = self.config.max_submissions - self.attempts
        if left <= 0:
            self._say("capped", live, target, f"{self.attempts} submissions made, the cap "
                      "(--max-submissions): submitting no more")
            return job
        wait = self._next_round - time.monotonic()
        if wait > 0:
            self._say("hold", live, target, f"backing off {wait:.0f}s more", key="backoff")
            return job
        count = min(target - live, left)
        self._say("submit", live, target, f"{target - live} short: submitting {count} agent "
                  f"job(s) to partition {self.config.partition}")
        for _ in range(count):
            self._submit(live, target)
        self._next_round = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2 or self.config.backoff_s,
                              self.config.max_backoff_s)
        return job

    def _say(self, action: str, live: int | None, target: int | None, detail: str, *,
             key: str | None = None) -> None:
        """Reports a decision, unless it repeats the previous one (same
        action, sizes and `key`, default the detail): a keeper holding for
        minutes prints one line, not one per poll."""
        said = (action, live, target, key or detail)
        if said != self._last_said or action in ("submit", "submitted", "submit_failed"):
            self._report(Decision(action, live, target, detail))
        self._last_said = said

    def _sbatch_argv(self) -> list[str]:
        c = self.config
        argv = ["sbatch", "--parsable", f"--partition={c.partition}", "--nodes=1",
                "--ntasks-per-node=1", f"--job-name=springback-{c.job}"[:120], *c.sbatch_args]
        if c.script:
            return [*argv, c.script]
        wrap = "srun --no-kill -N1 --ntasks-per-node=1 " + shlex.join(c.agent_command)
        return [*argv, f"--wrap={wrap}"]

    def _agent_env(self) -> dict[str, str]:
        """The submitting environment (sbatch exports it to the job): the
        coordinator, the job id and the job's join credential, never the
        keeper's own token or token file."""
        env = dict(self._env)
        env.pop(E.TOKEN_FILE, None)
        env.pop(E.TOKEN, None)
        env[E.JOB] = self.config.job
        if self._coordinator:
            env[E.COORDINATOR] = self._coordinator
        if self._credential is None:
            try:
                self._credential = self._client.issue_join_credential(self.config.job)
            except ApiError as e:
                if e.code != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                self._credential = ""  # the coordinator has no token: agents need none
        if self._credential:
            env[E.TOKEN] = self._credential
        return env

    def _submit(self, live: int, target: int) -> None:
        self.attempts += 1
        argv = self._sbatch_argv()
        try:
            env = self._agent_env()
        except ApiError as e:
            if e.code not in TRANSIENT:
                raise
            self._say("submit_failed", live, target, f"no join credential, the coordinator "
                      f"did not answer ({e})")
            return
        try:
            out = subprocess.run(argv, env=env, capture_output=True, text=True,
                                 timeout=SLURM_TIMEOUT_S, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            self._say("submit_failed", live, target, f"sbatch did not run: {e}")
            return
        if out.returncode != 0:
            self._say("submit_failed", live, target, f"sbatch failed ({out.returncode}): "
                      f"{out.stderr.strip()[-500:]}")
            return
        slurm_job = out.stdout.strip().split(";")[0]
        self.submitted.append(slurm_job)
        self._say("submitted", live, target, f"submitted Slurm job {slurm_job} "
                  f"({self.attempts}/{self.config.max_submissions}); next round no sooner "
                  f"than {self._backoff_s:.0f}s")

    def _squeue(self) -> dict[str, str]:
        """Each of our submissions still in squeue, and its state."""
        if not self.submitted:
            return {}
        out = subprocess.run(["squeue", "-h", "-j", ",".join(self.submitted), "-o", "%i %T"],
                             env=self._env, capture_output=True, text=True,
                             timeout=SLURM_TIMEOUT_S, check=False)
        if out.returncode != 0 and "Invalid job id" not in out.stderr:
            raise subprocess.SubprocessError(f"squeue: {out.stderr.strip()[-500:]}")
        return dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())

    def _pending(self) -> list[str]:
        return [j for j, state in self._squeue().items() if state.strip() == "PENDING"]

    def _cancel_pending(self, live: int, target: int) -> None:
        try:
            pending = self._pending()
            if pending:
                subprocess.run(["scancel", *pending], env=self._env, capture_output=True,
                               timeout=SLURM_TIMEOUT_S, check=True)
                self._say("cancel", live, target, f"cancelled the pending agent job(s) "
                          f"{', '.join(pending)}: the job has ended")
        except (OSError, subprocess.SubprocessError) as e:
            self._say("cancel", live, target, f"could not cancel pending agent jobs: {e}")


def add_slurm_command(commands: Any, common: argparse.ArgumentParser,
                      client: Callable[[argparse.Namespace], Client]) -> None:
    """``springback slurm keep``'s parser; `client` makes the job API client."""
    slurm = commands.add_parser("slurm", parents=[common], help="run jobs on a Slurm cluster")
    actions = slurm.add_subparsers(dest="slurm_action", required=True)
    keep = actions.add_parser(
        "keep", parents=[common], help="submit replacement agent jobs while the job is short",
        description="Keeps --job at size: while its live members are fewer than --target "
                    "(default max_workers), submits single-node agent jobs to --partition "
                    "(docs/slurm.md, 'Keeping the job at size').")
    keep.add_argument("--job", required=True, help="the job to keep at size")
    keep.add_argument("--partition", required=True, help="partition of the replacement jobs")
    keep.add_argument("--target", type=int, help="live members to keep (default max_workers)")
    keep.add_argument("--script", metavar="FILE", help="sbatch script to submit (instead of "
                      "the agent command after --)")
    keep.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                      help="one more sbatch option, e.g. --sbatch-arg=--gpus-per-node=8 "
                           "(repeatable)")
    keep.add_argument("--poll-s", type=float, default=5.0, help="seconds between reads (5)")
    keep.add_argument("--backoff-s", type=float, default=30.0,
                      help="seconds between submission rounds, doubling while short (30)")
    keep.add_argument("--max-backoff-s", type=float, default=600.0, help="(600)")
    keep.add_argument("--max-submissions", type=int, default=20,
                      help="submissions in all, failed ones included (20)")
    keep.add_argument("agent_command", nargs=argparse.REMAINDER,
                      help="-- the agent command srun runs on each new node")
    keep.set_defaults(handler=lambda args: keep_command(args, client))


def keep_command(args: argparse.Namespace, client: Callable[[argparse.Namespace], Client]) -> int:
    """Runs the keeper until the job ends (0) or SIGINT/SIGTERM (0)."""
    import signal

    command: Sequence[str] = args.agent_command
    if command and command[0] == "--":
        command = command[1:]
    config = KeeperConfig(
        job=args.job, partition=args.partition, agent_command=tuple(command),
        script=args.script, target=args.target, sbatch_args=tuple(args.sbatch_arg),
        poll_s=args.poll_s, backoff_s=args.backoff_s, max_backoff_s=args.max_backoff_s,
        max_submissions=args.max_submissions)

    def report(d: Decision) -> None:
        print(json.dumps({"action": d.action, "live": d.live, "target": d.target,
                          "detail": d.detail}) if args.json else d.line(), flush=True)

    coordinator = args.coordinator or os.environ.get(E.COORDINATOR)
    with client(args) as api:
        keeper = Keeper(config, api, coordinator, report)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: keeper.stop())
        keeper.run()
    return 0
