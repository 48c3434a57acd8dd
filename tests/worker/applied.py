"""Test helper: exactly-once proved from what reached the optimizer.

`tiny_train.py` trains a per-sample counter alongside its model: each applied
update adds exactly 1 to the entry of every sample of the step (see its
docstring). `check_applied` compares the counters that finished ranks wrote
with what the job's sample stream says steps 1..last_step contain. A sample
whose gradients were applied twice (a broken step re-run on top of its stale
gradients), or never (a step skipped, a restore from an older state that was
not replayed), shows as an entry off by one or more.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from springback.worker.train.sampler import SampleStream

# Float64 sums of 1/B·B over a few hundred updates stay within this of an integer.
TOLERANCE = 1e-6


@dataclass
class AppliedReport:
    ranks: int
    """Ranks whose counters were compared (finished, or drained and left)."""
    doubled: list[int] = field(default_factory=list)
    """Sample indices applied more often than the stream holds them."""
    skipped: list[int] = field(default_factory=list)
    """Sample indices applied less often."""
    steps: list[int] = field(default_factory=list)
    """The step each rank's state ended at."""

    last_step: int = 0

    @property
    def ok(self) -> bool:
        return (self.last_step in self.steps and not self.doubled and not self.skipped)


def expected_counts(*, num_samples: int, global_batch_size: int, seed: int,
                    last_step: int) -> np.ndarray:
    """How often each sample index is in steps 1..last_step of the stream."""
    stream = SampleStream(num_samples=num_samples, global_batch_size=global_batch_size,
                          seed=seed)
    counts = np.zeros(num_samples, dtype=np.int64)
    for step in range(1, last_step + 1):
        np.add.at(counts, stream.batch(step, 1, 0).indices, 1)
    return counts


def check_applied(audit_dir: str | Path, *, num_samples: int, global_batch_size: int,
                  seed: int, last_step: int) -> AppliedReport:
    """Compares every ``applied-*.json`` counter under `audit_dir` with the
    stream up to the step that rank's state ended at; at least one rank must
    have ended at `last_step`."""
    report = AppliedReport(ranks=0, last_step=last_step)
    doubled: set[int] = set()
    skipped: set[int] = set()
    for path in sorted(Path(audit_dir).glob("applied-*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        counter = np.asarray(record["counter"], dtype=np.float64)
        got, beyond = counter[:num_samples], counter[num_samples:]
        if beyond.any():
            raise AssertionError(f"{path.name}: counts beyond the dataset's {num_samples} samples")
        report.ranks += 1
        report.steps.append(int(record["step"]))
        want = expected_counts(num_samples=num_samples, global_batch_size=global_batch_size,
                               seed=seed, last_step=int(record["step"]))
        off = got - want
        if np.abs(off - np.round(off)).max() > TOLERANCE:
            raise AssertionError(f"{path.name}: counter is not integral: {got}")
        doubled.update(int(i) for i in np.flatnonzero(np.round(off) > 0))
        skipped.update(int(i) for i in np.flatnonzero(np.round(off) < 0))
    report.doubled, report.skipped = sorted(doubled), sorted(skipped)
    return report
