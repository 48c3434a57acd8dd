"""Where a job's checkpoints may lie: ``<checkpoint.uri>/<job id>/<one name>``.

The one rule the coordinator (at commit), the storage layer (a job's
directory) and the CLI (before a delete) share: a recorded checkpoint URI is
read by every rank of the job (a restore unpickles its done-records) and
deleted with the operator's credentials, so a URI outside the job's own
directory is refused, never recorded, restored or deleted. Pure functions on
strings: no storage is touched.
"""

from __future__ import annotations


def dot_segments(uri: str) -> bool:
    """Whether `uri`'s path has a ``.`` or ``..`` segment (``/x/../etc``)."""
    path = uri.split("://", 1)[-1]
    return any(part in (".", "..") for part in path.split("/"))


def job_directory(checkpoint_uri: str, job_id: str) -> str:
    """``<checkpoint_uri>/<job_id>``, the scheme untouched. Raises
    ``ValueError`` for a job id that is not one path segment, or a
    `checkpoint_uri` with ``.`` or ``..`` segments."""
    if not job_id or "/" in job_id or job_id in (".", ".."):
        raise ValueError(f"job id {job_id!r} cannot name a checkpoint directory under {checkpoint_uri}")
    if dot_segments(checkpoint_uri):
        raise ValueError(f"checkpoint URI {checkpoint_uri!r} has a '.' or '..' segment")
    return f"{checkpoint_uri.rstrip('/')}/{job_id}"


def outside_job_directory(uri: str, checkpoint_uri: str, job_id: str) -> str | None:
    """Why `uri` is not a checkpoint of job `job_id` (one name directly in
    its directory, no ``.``/``..``), or None when it is."""
    try:
        base = job_directory(checkpoint_uri, job_id)
    except ValueError as e:
        return str(e)
    name = uri[len(base) + 1:] if uri.startswith(base + "/") else ""
    if not name or "/" in name.rstrip("/") or name.rstrip("/") in (".", ".."):
        return f"{uri!r} is not a checkpoint directory directly under the job's own {base!r}"
    return None
