"""The checkpoint manifest: the file whose presence makes a checkpoint committed.

Layout of one checkpoint directory (``<base>/step-00000100-g3/``)::

    __0_0.distcp, __1_0.distcp, ...   DCP shard files, one per rank that owns data
    _springback/rank-00000.pkl, ...   per-rank done-records (see springback.storage.commit)
    .metadata                         DCP metadata (written by the committing rank)
    manifest.json                     this manifest, written LAST

A directory without ``manifest.json`` is *partial*: never restored, eventually
deleted. The manifest lists every other file with its size and CRC-32, so a
committed checkpoint can be verified without trusting the store.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import platform
import re
import zlib
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT = "springback.checkpoint/v1"
CHECKSUM_ALGORITHM = "crc32"

_DIR_RE = re.compile(r"^step-(\d+)(?:-g(\d+))?$")


def checkpoint_dir_name(step: int, generation: int) -> str:
    """Directory name of a checkpoint. The generation is part of it so that a fenced,
    still-running writer of an older generation can never write into the directory
    of a newer generation's checkpoint of the same step."""
    return f"step-{step:08d}-g{generation}"


def parse_checkpoint_dir_name(name: str) -> tuple[int, int] | None:
    """Return ``(step, generation)`` for a checkpoint directory name, else None."""
    m = _DIR_RE.match(name)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2) or 0)


def crc32_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def crc32_of(data: bytes) -> str:
    return crc32_hex(zlib.crc32(data))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a checkpoint, relative to its directory."""

    path: str
    size_bytes: int
    crc32: str
    rank: int | None = None
    """Rank that wrote it; None for files written by the committer (``.metadata``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManifestCursor:
    """Where the data stream stands: the next sample is ``offset`` in ``epoch``."""

    epoch: int = 0
    offset: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    step: int
    generation: int
    world_size: int
    layout: dict[str, int]
    cursor: ManifestCursor
    files: tuple[FileEntry, ...]
    versions: dict[str, str]
    created_at: str
    """ISO 8601, UTC."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """JSON-able user data passed to ``Checkpointer.save(extra=...)``."""
    format: str = FORMAT
    checksum_algorithm: str = CHECKSUM_ALGORITHM

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["size_bytes"] = self.size_bytes
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, *, uri: str = "") -> Manifest:
        """Parse a manifest; raises ``ValueError`` naming ``uri`` and the field if malformed."""
        try:
            d = json.loads(text)
            if d.get("format") != FORMAT:
                raise ValueError(f"format is {d.get('format')!r}, expected {FORMAT!r}")
            return cls(
                step=int(d["step"]),
                generation=int(d["generation"]),
                world_size=int(d["world_size"]),
                layout={str(k): int(v) for k, v in d.get("layout", {}).items()},
                cursor=ManifestCursor(**d["cursor"]),
                files=tuple(FileEntry(**f) for f in d["files"]),
                versions=dict(d.get("versions", {})),
                created_at=str(d["created_at"]),
                extra=dict(d.get("extra", {})),
                checksum_algorithm=str(d.get("checksum_algorithm", CHECKSUM_ALGORITHM)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed manifest {uri}: {exc!r}") from exc


def library_versions() -> dict[str, str]:
    import torch

    from springback import __version__

    return {"torch": torch.__version__, "springback": __version__, "python": platform.python_version()}


def utc_now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")
