"""Hugging Face ``Trainer`` under Springback (restart mode): the recipe of
docs/trainers.md (`springback.integrations.hf.SpringbackCallback`) on real
etcd, a real coordinator and two node agents, through a SIGKILLed node and a
join (tests/integrations/trainer_cluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from trainer_cluster import check, run_through_kill_and_join  # noqa: E402

SCRIPT = str(Path(__file__).with_name("hf_train.py"))

# In the default run: 80-90 s on the 2-core machine, most of it three
# generations' start-up (each rank imports torch and transformers, ~9 s
# alone); the timeout is the sum of the scenario's waits.
pytestmark = [pytest.mark.timeout(400)]


class TestHuggingFaceTrainer:
    def test_a_gpt2_trains_to_max_steps_through_a_killed_node_and_a_join_without_losing_a_sample(
            self, tmp_path, client, coordinator_address):
        run = run_through_kill_and_join(tmp_path, client, coordinator_address, SCRIPT)
        check(run)
