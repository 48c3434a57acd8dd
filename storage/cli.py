"""Functions behind ``springback ckpt ...`` (dispatched from service/cli.py).

- :func:`ckpt_verify` (alias :func:`verify_main`) -- ``springback ckpt verify URI [--json]``: exit code 0 when
  intact, 1 when any file is bad (each problem names the file), 2 when there is
  nothing committed to verify.
- :func:`ckpt_list_uri` -- rows for ``springback ckpt list``: what storage holds
  under a base URI, committed and partial.
- :func:`add_ckpt_commands` -- optional argparse wiring of both; also runnable
  standalone: ``python -m springback.storage.cli verify URI``.

``URI`` may be one checkpoint directory, a job's directory holding several (then
every committed checkpoint under it is verified), or a spec's ``checkpoint.uri``
holding one directory per job (``<uri>/<job_id>/step-…``; every job's checkpoints
are verified).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from springback.storage import catalog
from springback.storage.manifest import parse_checkpoint_dir_name
from springback.storage.store import Store, join


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
    store = Store(uri, storage_options=storage_options)
    for name, is_dir in store.list(uri):
        if is_dir:
            targets += [c.uri for c in catalog.committed_checkpoints(join(uri, name), store=store)]
    return targets


def ckpt_verify(uri: str, json_out: bool = False, *, storage_options: dict[str, Any] | None = None, out: TextIO | None = None) -> int:
    """Verify the checkpoint(s) at ``uri``; print a report; return the exit code (0/1/2)."""
    out = out or sys.stdout
    targets = _verify_targets(uri, storage_options)
    results = [{"uri": t, "problems": catalog.verify(t, storage_options=storage_options)} for t in targets]
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


def verify_main(uri: str, *, as_json: bool = False) -> int:
    """Entry point used by ``service/cli.py``: :func:`ckpt_verify` printing to stdout."""
    return ckpt_verify(uri, as_json)


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
    """Human table for :func:`ckpt_list_uri` rows."""
    lines = [f"{'STEP':>10} {'GEN':>4} {'STATE':<9} {'WORLD':>5} {'SIZE':>12}  {'TIME':<29} URI"]
    for r in rows:
        lines.append(
            f"{r['step']:>10} {r['generation']:>4} {r['state']:<9} {r['world_size']:>5} {r['size_bytes']:>12}  {r['time']:<29} {r['uri']}"
        )
    return "\n".join(lines)


def add_ckpt_commands(subparsers: Any) -> None:
    """Add ``verify URI [--json]`` and ``ls URI [--json]`` to an argparse subparsers object.

    Each parser sets ``func(args) -> int`` (the exit code).
    """
    v = subparsers.add_parser("verify", help="check a checkpoint's files against its manifest")
    v.add_argument("uri")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=lambda a: ckpt_verify(a.uri, a.json))
    ls = subparsers.add_parser("ls", help="list checkpoints stored under a base URI")
    ls.add_argument("uri")
    ls.add_argument("--json", action="store_true")

    def _ls(a: argparse.Namespace) -> int:
        rows = ckpt_list_uri(a.uri)
        print(json.dumps(rows, indent=1) if a.json else format_rows(rows))
        return 0

    ls.set_defaults(func=_ls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="springback-ckpt")
    add_ckpt_commands(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
