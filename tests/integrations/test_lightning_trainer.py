"""Lightning under Springback (restart mode): the recipe of docs/trainers.md
(`springback.integrations.lightning`) on real etcd, a real coordinator and
two node agents, through a SIGKILLed node and a join
(tests/integrations/trainer_cluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning")

from trainer_cluster import check, run_through_kill_and_join  # noqa: E402

SCRIPT = str(Path(__file__).with_name("lightning_train.py"))

pytestmark = [pytest.mark.timeout(400)]


class TestLightningTrainer:
    def test_an_mlp_trains_to_max_steps_through_a_killed_node_and_a_join_without_losing_a_sample(
            self, tmp_path, client, coordinator_address):
        run = run_through_kill_and_join(tmp_path, client, coordinator_address, SCRIPT)
        # the regression's per-batch MSE: steps 20-60 of one run (the drain
        # falls in them) move by < 1 from one batch to the next
        check(run, drain_jump=1.0)
