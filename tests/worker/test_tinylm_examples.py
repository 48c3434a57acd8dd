"""The 3-D and mixture-of-experts tinylm examples (examples/tinylm/train_3d.py,
train_moe.py) train under their own job specs on a tiny real cluster: etcd, a
coordinator and two node agents of two gloo ranks each (pp 2 x tp 2, and
dp 4 with the experts over ep 2). The node loss and the join are the demo's
(`deploy/local/demo.sh --3d` / `--moe`); here: the job succeeds, every
sample of its steps is trained exactly once, and the step's loss is the
model's (one report per dp rank: with the TP and PP peers counted too it
was tp x pp times too high)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from cluster import steps
from test_elastic import cluster  # noqa: F401 - the fixture

from springback.worker.train.audit import check_exactly_once

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tinylm"
STEPS = 6


def spec(job_file: str) -> dict:
    """The example's job spec, cut to `STEPS` steps."""
    with open(EXAMPLES / job_file, encoding="utf-8") as f:
        return {**yaml.safe_load(f), "max_steps": STEPS}


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("cluster", "script"), [
    (spec("job_3d.yaml"), "train_3d.py"),
    (spec("job_moe.yaml"), "train_moe.py"),
], indirect=["cluster"], ids=["3d", "moe"])
def test_the_example_trains_on_two_nodes_of_two_ranks_exactly_once(cluster, script):
    agents = [cluster.start(name, nproc=2, script=str(EXAMPLES / script)) for name in "ab"]
    job = cluster.wait_succeeded(timeout_s=75)
    for agent in agents:
        assert agent.wait(30) == 0, agent.log()
    records = steps(cluster.root)
    # both nodes train to the end (one may have trained alone, world 2,
    # before the other's ranks had started on a loaded machine)
    assert max(records, key=lambda r: r["step"])["world_size"] == 4, records
    assert job.status.step == STEPS
    first = min(records, key=lambda r: r["step"])
    # an untrained model over 128 characters: about ln 128 = 4.85 (not 4x that)
    assert 3.5 < first["loss"] < 6.5, first
    assert all(math.isfinite(r["loss"]) for r in records)
    data = cluster.job().spec.data
    report = check_exactly_once(str(cluster.root / "audit"), num_samples=data.num_samples,
                                global_batch_size=data.global_batch_size, last_step=STEPS)
    assert report.ok, report
