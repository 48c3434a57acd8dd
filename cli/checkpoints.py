"""``springback ckpt list JOB | verify URI | restore JOB [--step N]``.

- ``verify URI [--json]`` reads storage only (no coordinator): exit code 0 when
  intact, 1 when any file is bad (each problem names the file), 2 when there is
  nothing committed to verify. ``URI`` may be one checkpoint directory, a job's
  directory holding several (then every committed checkpoint under it is
  verified), or a spec's ``checkpoint.uri`` holding one directory per job
  (``<uri>/<job_id>/step-…``; every job's checkpoints are verified).
- ``list JOB [--json]``: the coordinator's record (committed), newest first,
  plus what storage holds beyond it (``partial``, ``unrecorded``).
- ``restore JOB [--step N]``: asks the coordinator to restart the job from a
  committed step (the newest when N is 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, Protocol, TextIO

from springback.client.api import Client
from springback.storage import catalog, job_checkpoint_uri
from springback.storage.manifest import parse_checkpoint_dir_name
from springback.storage.store import ObjectStore, join
from springback.v1 import types_pb2 as pb


class _JobPrinter(Protocol):
    def job(self, job: pb.Job) -> None: ...


def _is_checkpoint_dir(uri: str) -> bool:
    return parse_checkpoint_dir_name(uri.rstrip("/").rsplit("/", 1)[-1]) is not None


def _verify_targets(uri: str, storage_options: dict[str, Any] | None) -> list[str]:
    """One checkpoint directory; else the committed ones under ``uri`` (a job's
    directory); else those under each directory below it (a spec's
    ``checkpoint.uri`` holding one directory per job)."""
    if _is_checkpoint_dir(uri):
        return [uri.rstrip("/")]
    targets = [c.uri for c in catalog.committed_checkpoints(uri, storage_options=storage_options)]
    if targets:
        return targets
    store = ObjectStore(uri, storage_options=storage_options)
    for name, is_dir in store.list(uri):
        if is_dir:
            targets += [c.uri for c in catalog.committed_checkpoints(join(uri, name), store=store)]
    return targets


def ckpt_verify(uri: str, json_out: bool = False, *, storage_options: dict[str, Any] | None = None, out: TextIO | None = None) -> int:
    """Verify the checkpoint(s) at ``uri``; print a report; return the exit code (0/1/2)."""
    out = out or sys.stdout
    targets = _verify_targets(uri, storage_options)
    results: list[dict[str, Any]] = [{"uri": t, "problems": catalog.verify(t, storage_options=storage_options)} for t in targets]
    for r in results:
        r["ok"] = not r["problems"]
    code = 2 if not results else (0 if all(r["ok"] for r in results) else 1)
    if json_out:
        json.dump({"ok": code == 0, "checkpoints": results}, out, indent=1)
        out.write("\n")
    elif not results:
        out.write(f"no committed checkpoint at {uri}\n")
    else:
        for r in results:
            if r["ok"]:
                out.write(f"OK   {r['uri']}\n")
            else:
                for p in r["problems"]:
                    out.write(f"BAD  {p}\n")
    return code


def ckpt_list_uri(uri: str, *, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One dict per checkpoint under base ``uri``, oldest first.

    Keys: ``step``, ``generation``, ``time`` (ISO 8601 or ""), ``size_bytes``,
    ``world_size`` (0 if partial), ``state`` ("committed" / "partial"), ``uri``.
    """
    rows = []
    for c in catalog.list_checkpoints(uri, storage_options=storage_options):
        m = c.manifest
        rows.append(
            {
                "step": c.step,
                "generation": c.generation,
                "time": m.created_at if m else "",
                "size_bytes": m.size_bytes if m else 0,
                "world_size": m.world_size if m else 0,
                "state": c.state,
                "uri": c.uri,
            }
        )
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The human table of `ckpt list` (rows of `ckpt_list_uri` / `checkpoint_rows`)."""
    return "\n".join(
        f"step {r['step']:>8}  {r['time'] or '-':<27} {r['size_bytes'] / 1e6:>9.1f} MB  "
        f"world {r['world_size']:>3}  {r['state']:<10} {r['uri']}" for r in rows)


def checkpoint_rows(client: Client, job_id: str) -> list[dict[str, Any]]:
    """Committed checkpoints (the coordinator's record), newest first, plus what
    storage holds beyond them: ``partial`` (no manifest: an interrupted write,
    cleaned up later) and ``unrecorded`` (complete on storage but never
    committed in etcd, e.g. finished after a generation change; never restored).
    """
    refs = client.list_checkpoints(job_id)
    rows = [{
        "step": r.step, "generation": r.generation, "world_size": r.world_size,
        "size_bytes": r.size_bytes, "state": "committed", "uri": r.uri,
        "time": r.committed_at.ToJsonString() if r.committed_at.seconds else "",
    } for r in refs]
    base = client.get_job(job_id).spec.checkpoint.uri
    if base:
        try:
            stored = ckpt_list_uri(job_checkpoint_uri(base, job_id))
        except Exception as e:  # noqa: BLE001 (storage is advisory here; the record stands)
            print(f"warning: cannot list {base}: {e}", file=sys.stderr)
            stored = []
        recorded = {r.uri.rstrip("/") for r in refs}
        for row in stored:
            if row["uri"].rstrip("/") not in recorded:
                rows.append({**row, "state": "partial" if row["state"] == "partial" else "unrecorded"})
    return sorted(rows, key=lambda r: (r["step"], r["generation"]), reverse=True)


def command(args: argparse.Namespace, connect: Callable[[argparse.Namespace], Client],
            printer: _JobPrinter) -> int:
    """The `ckpt` handler: returns the exit code; API errors propagate (the CLI
    maps them to 1)."""
    if args.ckpt_action == "verify":
        return ckpt_verify(args.uri, args.json)
    with connect(args) as client:
        if args.ckpt_action == "list":
            rows = checkpoint_rows(client, args.job)
            if args.json:
                print(json.dumps(rows))
            elif rows:
                print(format_rows(rows))
        elif args.ckpt_action == "restore":
            printer.job(client.restore_job(args.job, args.step))
    return 0
