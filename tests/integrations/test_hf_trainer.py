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

# Not yet passing, so out of the default run: in its one run (3.5 min) the
# kill and the world-1 resume from step 10 worked (generations 2-4), the join
# made generation 5, and the job did not reach SUCCEEDED within the wait;
# not yet diagnosed. Run it with `bash deploy/local/test.sh -m soak tests/integrations`.
pytestmark = [pytest.mark.timeout(400), pytest.mark.soak]


class TestHuggingFaceTrainer:
    def test_a_gpt2_trains_to_max_steps_through_a_killed_node_and_a_join_without_losing_a_sample(
            self, tmp_path, client, coordinator_address):
        run = run_through_kill_and_join(tmp_path, client, coordinator_address, SCRIPT)
        check(run)
