"""`springback.storage.resume`: restart mode's checkpoint helper, on one
process (no process group) and real files."""

from __future__ import annotations

import pytest
import torch

from springback.storage import RestartCheckpoints
from springback.client.env import RESTORE_MAX_STEP
from springback.storage.resume import read_progress


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(ckpt: RestartCheckpoints, model, opt, steps) -> None:
    for step in steps:
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step_done(step, model, opt, loss=float(step))


class TestRestartCheckpoints:
    def test_a_restart_resumes_from_the_newest_commit_and_rank_0_reports_progress(
            self, tmp_path, monkeypatch):
        control = tmp_path / "control"
        control.mkdir()
        monkeypatch.setenv("SPRINGBACK_CONTROL_DIR", str(control))
        monkeypatch.setenv("SPRINGBACK_GENERATION", "4")
        uri = f"file://{tmp_path}/ckpt"
        model, opt = _model(0)
        ckpt = RestartCheckpoints(uri, every_steps=5)
        assert ckpt.restore(model, opt) == 0
        _train(ckpt, model, opt, range(1, 13))
        ckpt.close()
        progress = read_progress(str(control))
        assert (progress.generation, progress.step, progress.loss) == (4, 12, 12.0)
        assert progress.checkpoint["step"] == 10 and progress.checkpoint["uri"].endswith("-g4")

        monkeypatch.setenv("SPRINGBACK_GENERATION", "5")  # the restarted ranks
        fresh, fresh_opt = _model(1)
        again = RestartCheckpoints(uri)
        assert again.restore(fresh, fresh_opt) == 10
        resumed = read_progress(str(control))
        assert (resumed.generation, resumed.step, resumed.restored_step) == (5, 10, 10)
        again.close()

    def test_the_plans_checkpoint_bounds_the_restore(self, tmp_path, monkeypatch):
        uri = f"file://{tmp_path}/ckpt"
        model, opt = _model(0)
        ckpt = RestartCheckpoints(uri, every_steps=5)
        _train(ckpt, model, opt, range(1, 11))
        ckpt.close()
        monkeypatch.setenv(RESTORE_MAX_STEP, "7")  # e.g. `job restore --step 5`
        assert RestartCheckpoints(uri).restore(*_model(1)) == 5

    def test_no_uri_anywhere_is_refused_naming_the_variable(self, monkeypatch):
        monkeypatch.delenv("SPRINGBACK_CHECKPOINT_URI", raising=False)
        with pytest.raises(ValueError, match="SPRINGBACK_CHECKPOINT_URI"):
            RestartCheckpoints()
