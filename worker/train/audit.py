"""Audit of consumed samples: proof that every index is trained on exactly once.

With `SPRINGBACK_AUDIT_DIR` set, every rank appends one JSON line per batch it
takes to ``g<generation>-r<rank>-p<pid>.jsonl``, *before* the batch is used, so a
rank killed mid-step still leaves its record. The record names the rank's
data-parallel coordinate: its TP and PP peers take the same batch, which
the check counts once. A step may be started by one
generation and, if that generation broke before any rank finished it, run again
by the next; the step's outcome is the one of the *latest* generation that ran
it. A step the ranks agreed not to apply (the bad-step policy,
`Generation.check_step`) gets a second record, ``"skipped": true``: its
samples were consumed but not trained on. `check_exactly_once` applies that
rule and verifies that the kept records cover each epoch's indices exactly
once, naming the skipped steps (their samples are skipped, not lost).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from springback.worker.train.sampler import Batch


class AuditLog:
    """Append-only per-rank, per-generation record of consumed samples.

    Each record is written with one ``write`` and flushed, so it survives the
    process being killed right after (the page cache keeps it). Never raises on
    a closed log; a full disk raises OSError to the training loop.
    """

    def __init__(self, directory: str, generation: int, rank: int,
                 dp_rank: int | None = None) -> None:
        """`dp_rank`: the rank's data-parallel coordinate (default `rank`:
        no TP or PP peers)."""
        os.makedirs(directory, exist_ok=True)
        name = f"g{generation:06d}-r{rank:05d}-p{os.getpid()}.jsonl"
        self._file = open(os.path.join(directory, name), "a", encoding="utf-8")
        self._generation = generation
        self._rank = rank
        self._dp_rank = rank if dp_rank is None else dp_rank

    def record(self, batch: Batch) -> None:
        line = json.dumps({
            "generation": self._generation,
            "rank": self._rank,
            "dp_rank": self._dp_rank,
            "step": batch.step,
            "samples": [[int(e), int(i)] for e, i in zip(batch.epochs, batch.indices)],
        })
        self._file.write(line + "\n")
        self._file.flush()

    def skipped(self, step: int) -> None:
        """Records that the ranks agreed not to apply `step` (its batch,
        recorded before, was consumed but not trained on)."""
        self._file.write(json.dumps({"generation": self._generation, "rank": self._rank,
                                     "dp_rank": self._dp_rank, "step": step,
                                     "skipped": True}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class AuditReport:
    """Outcome of `check_exactly_once`."""

    steps: int
    generations: list[int]
    samples: int
    duplicates: list[tuple[int, int]] = field(default_factory=list)
    missing: list[tuple[int, int]] = field(default_factory=list)
    missing_steps: list[int] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    """Steps whose batch was consumed but not applied (a bad step): their
    samples count as taken once, and are named here instead of trained."""

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.missing or self.missing_steps)


def read_records(directory: str) -> list[dict]:
    """Every audit record under `directory` (a torn last line is ignored)."""
    records = []
    for path in sorted(Path(directory).glob("g*-r*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the process died mid-write; that batch was never used
    return records


def check_exactly_once(directory: str, *, num_samples: int, global_batch_size: int,
                       last_step: int) -> AuditReport:
    """Checks steps 1..`last_step`: each kept step has `global_batch_size` samples
    and every (epoch, index) appears once; complete epochs cover all indices.
    The TP/PP peers of a data-parallel rank count once when their batch is
    the same as its (a record without ``dp_rank`` is its rank's own); a
    peer with another batch counts again, so it shows as duplicates."""
    by_step: dict[int, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for rec in read_records(directory):
        if rec["step"] <= last_step:
            by_step[rec["step"]][rec["generation"]].append(rec)
    seen: dict[tuple[int, int], int] = defaultdict(int)
    missing_steps: list[int] = []
    generations: set[int] = set()
    skipped_steps: list[int] = []
    total = 0
    for step in range(1, last_step + 1):
        runs = by_step.get(step)
        if not runs:
            missing_steps.append(step)
            continue
        owner = max(runs)
        generations.add(owner)
        samples: list[tuple[int, int]] = []
        by_dp_rank: dict[int, list[tuple[int, int]]] = {}
        if any(rec.get("skipped") for rec in runs[owner]):
            skipped_steps.append(step)
        for rec in runs[owner]:
            if rec.get("skipped"):
                continue
            taken = [tuple(s) for s in rec["samples"]]
            first = by_dp_rank.setdefault(rec.get("dp_rank", rec["rank"]), taken)
            if first is taken or first != taken:  # the dp rank's first record, or a peer's other batch
                samples.extend(taken)
        if len(samples) != global_batch_size:
            missing_steps.append(step)
        for s in samples:
            seen[s] += 1
        total += len(samples)
    duplicates = sorted(s for s, n in seen.items() if n > 1)
    full_epochs = (last_step * global_batch_size) // num_samples
    missing = [(e, i) for e in range(full_epochs) for i in range(num_samples)
               if (e, i) not in seen]
    return AuditReport(steps=last_step, generations=sorted(generations), samples=total,
                       duplicates=duplicates, missing=missing, missing_steps=missing_steps,
                       skipped_steps=skipped_steps)


def state_digest(state: dict[str, Any]) -> str:
    """SHA-256 over the tensors of every registered module (replica comparison)."""
    h = hashlib.sha256()
    for name in sorted(state):
        obj = state[name]
        if isinstance(obj, torch.nn.Module):
            for key, t in sorted(obj.state_dict().items()):
                h.update(key.encode())
                local = t.to_local() if hasattr(t, "to_local") else t  # DTensor: this shard
                h.update(local.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
