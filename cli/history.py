"""The history commands of the `springback` CLI: ``job events JOB``,
``job logs JOB [--member M] [--follow]``, ``job delete JOB [--checkpoints]``,
and the history that ``job watch`` shows for a job that has already finished.

Exit codes as in `cli`: 0 success, 1 the API refused (e.g. deleting a live
job is FAILED_PRECONDITION), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


from springback.service.policy import planner
from springback.client.jobdir import job_directory, outside_job_directory
from springback.client.api import Client
from springback.client.summary import history_summary
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb


FOLLOW_POLL_S = 1.0
FOLLOW_GRACE_S = 5.0


def _human_history(summary: dict[str, Any]) -> str:
    lines = [
        f"job      {summary['id']} ({summary['name']})   {summary['state']}   "
        f"step {summary['step']}   {summary['message']}",
        f"created  {summary['created_at'] or '-'}   started {summary['started_at'] or '-'}"
        f"   finished {summary['finished_at'] or '-'}",
        f"{'gen':>4}  {'time':<24} {'kind':<13} {'world':>5}  {'restore':<10} {'from':>6} "
        f"{'redone':>6} {'recovery':>9}  reason",
    ]
    for g in summary["generations"]:
        recovery = f"{g['recovery_s']:.2f}s" if g["recovery_s"] is not None else "-"
        lines.append(
            f"{g['generation']:>4}  {g['time'] or '-':<24} {g['kind']:<13} {g['world_size']:>5}  "
            f"{g['restore']:<10} {g['start_step']:>6} {g['steps_redone']:>6} {recovery:>9}  "
            f"{g['reason']}" + (f"   STATE LOST ({g['steps_lost']} steps): {g['state_lost']}"
                                if g["steps_lost"] else ""))
        if g.get("step_time_s"):
            q = g["step_time_s"]
            lines.append(f"{'':>6}step time p50 {q['p50'] * 1e3:.1f} ms  p90 "
                         f"{q['p90'] * 1e3:.1f} ms  p99 {q['p99'] * 1e3:.1f} ms")
        if g.get("badput_s"):
            lines.append(f"{'':>6}{g['wall_s']:.2f}s: " + "  ".join(
                f"{k} {v:.2f}s" for k, v in g["badput_s"].items() if v))
    if "badput" in summary:
        lines.append(f"wall     {summary['badput']['wall_s']:.2f}s: " + "  ".join(
            f"{k} {v:.2f}s" for k, v in summary["badput"]["causes_s"].items() if v))
    return "\n".join(lines)


def print_history(client: Client, job_id: str, as_json: bool) -> pb.Job:
    """Prints the job's history (human or one JSON object); returns the job."""
    job, events = client.list_job_events(job_id)
    summary = history_summary(job, events)
    print(json.dumps(summary) if as_json else _human_history(summary), flush=True)
    return job


def history_if_finished(client: Client, args: argparse.Namespace) -> bool:
    """For `job watch`: prints the history of a job that already ended and
    returns True (nothing is left to watch); False for a live job."""
    job = client.get_job(args.job)
    if not planner.is_terminal(job.status.state):
        return False
    print_history(client, args.job, args.json)
    return True


def _events_command(args: argparse.Namespace) -> int:
    with Client(args.coordinator, token=args.token) as client:
        print_history(client, args.job, args.json)
    return 0


def _delete_command(args: argparse.Namespace) -> int:
    from springback.cli.checkpoints import checkpoint_rows

    with Client(args.coordinator, token=args.token) as client:
        job = client.get_job(args.job)
        if not planner.is_terminal(job.status.state):
            print(f"error: job {args.job} is {pb.JobState.Name(job.status.state)}: cancel it "
                  "before deleting it (nothing was deleted)", file=sys.stderr)
            return 1
        deleted: list[str] = []
        if args.checkpoints:
            from springback.storage.catalog import delete_checkpoint

            rows = checkpoint_rows(client, args.job)
            strays = [why for row in rows if (why := outside_job_directory(
                row["uri"], job.spec.checkpoint.uri, args.job))]
            if strays:  # a forged record must not steer a recursive delete
                print(f"error: {strays[0]}: refusing to delete (nothing was deleted)",
                      file=sys.stderr)
                return 1
            # Files first: if this fails, the record is still there to retry with.
            for row in rows:
                delete_checkpoint(row["uri"])
                deleted.append(row["uri"])
            if job.spec.checkpoint.uri:
                from springback.storage.ranklogs import delete_logs
                from springback.storage.store import ObjectStore

                logs_base = job_directory(job.spec.checkpoint.uri, job.id)  # its own, no other's
                delete_logs(ObjectStore(logs_base), logs_base)
        client.delete_job(args.job)
    if args.json:
        print(json.dumps({"id": args.job, "deleted": True, "checkpoints_deleted": deleted}))
    else:
        kept = "" if args.checkpoints or not job.spec.checkpoint.uri else (
            f"; checkpoints kept at {job.spec.checkpoint.uri} (--checkpoints deletes them)")
        print(f"deleted job {args.job}" + (f" and {len(deleted)} checkpoint(s)" if deleted else "")
              + kept)
    return 0


def _logs_command(args: argparse.Namespace) -> int:
    """Prints the shipped rank logs (merged by time), then with --follow the
    chunks that arrive, until the job has ended and nothing new came."""
    from springback.storage.ranklogs import list_chunks, members
    from springback.storage.store import ObjectStore

    with Client(args.coordinator, token=args.token) as client:
        job = client.get_job(args.job)
        if not job.spec.checkpoint.uri:
            print(f"error: job {args.job} has no checkpoint.uri, so its agents ship no rank "
                  "logs (they are only in each agent's own output)", file=sys.stderr)
            return 1
        base = job_directory(job.spec.checkpoint.uri, job.id)  # its own: <uri>/<job id>
        store = ObjectStore(base)
        if args.member and args.member not in members(store, base):
            known = ", ".join(members(store, base)) or "none yet"
            print(f"error: --member {args.member}: no logs of that member (members with logs: "
                  f"{known})", file=sys.stderr)
            return 1
        printed: set[str] = set()
        ended_at: float | None = None
        while True:
            if ended_at is None and planner.is_terminal(client.get_job(args.job).status.state):
                ended_at = time.monotonic()
            new = [c for c in list_chunks(store, base, args.member) if c.uri not in printed]
            for chunk in new:
                printed.add(chunk.uri)
                sys.stdout.write(store.get_bytes(chunk.uri).decode(errors="replace"))
            sys.stdout.flush()
            # After the end, agents ship their last lines as they exit: keep
            # polling until a quiet poll after FOLLOW_GRACE_S.
            if not args.follow or (ended_at is not None and not new
                                   and time.monotonic() - ended_at > FOLLOW_GRACE_S):
                return 0
            time.sleep(FOLLOW_POLL_S)  # polling storage, ended by the job's end


def add_job_commands(actions: Any, common: argparse.ArgumentParser) -> None:
    """Adds ``events``, ``logs`` and ``delete`` to the `job` sub-commands."""
    logs = actions.add_parser("logs", parents=[common],
                              help="rank logs the job's agents shipped beside its checkpoints")
    logs.add_argument("job")
    logs.add_argument("--member", help="only this member's ranks")
    logs.add_argument("--follow", "-f", action="store_true",
                      help="keep printing new lines until the job ends")
    logs.set_defaults(handler=_logs_command)
    events = actions.add_parser("events", parents=[common],
                                help="a job's history: timestamps and every generation")
    events.add_argument("job")
    events.set_defaults(handler=_events_command)
    delete = actions.add_parser("delete", parents=[common], help="forget a finished job")
    delete.add_argument("job")
    delete.add_argument("--checkpoints", action="store_true",
                        help="also delete its checkpoint files (kept by default)")
    delete.set_defaults(handler=_delete_command)
