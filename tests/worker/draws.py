"""Test helper: each rank's RNG state follows its training state, proved from draws.

The training scripts of the tests (`tiny_train.py`, `fsdp_train.py`) seed every
rank alike and draw one number from torch's global RNG at the start of every
step (`record_draw`, into ``draws-p<pid>.jsonl`` in the audit directory). With
the RNG state carried into each generation as `worker/rank/rngstate.py` says, every
draw of one step is the same number, on every rank, in every generation and in
every replay of the step: a joiner takes its source's RNG state, a survivor
running a broken step again goes back to its state's boundary, a restore from a
checkpoint or a peer copy takes the saved one. A rank that started over from
its script's seed, or kept the draws of a broken step, shows as a step with two
different numbers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from springback.client.env import AUDIT_DIR


def record_draw(step: int, generation: int, rank: int) -> None:
    """Draws one number from the global RNG and records it (when the audit is on)."""
    value = torch.rand(1).item()
    audit = os.environ.get(AUDIT_DIR)
    if audit:
        with open(os.path.join(audit, f"draws-p{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "generation": generation, "rank": rank,
                                "draw": value}) + "\n")


@dataclass
class DrawReport:
    draws: int = 0
    steps: int = 0
    differing: dict[int, list[dict]] = field(default_factory=dict)
    """Steps drawn as more than one number, with their draws."""
    repeated: int = 0
    """Steps whose number another step drew too (RNG streams restarted)."""

    @property
    def ok(self) -> bool:
        return self.draws > 0 and not self.differing and not self.repeated


def check_draws(audit_dir: str | Path) -> DrawReport:
    by_step: dict[int, list[dict]] = {}
    for path in Path(audit_dir).glob("draws-p*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                by_step.setdefault(rec["step"], []).append(rec)
    report = DrawReport(draws=sum(len(v) for v in by_step.values()), steps=len(by_step))
    report.differing = {s: v for s, v in sorted(by_step.items())
                        if len({r["draw"] for r in v}) > 1}
    firsts = [v[0]["draw"] for v in by_step.values()]
    report.repeated = len(firsts) - len(set(firsts))
    return report
