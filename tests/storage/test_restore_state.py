"""Restores are all or nothing and restore what was saved: parameters that were
never stepped (no optimizer state) restore fine, a failed restore leaves the
model as it was, and a Session's other ``state=`` entries (an LR scheduler)
are checkpointed and restored with the model (issue 7 bug 16, issue 8)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from springback.storage import (
    Checkpointer,
    CheckpointMismatch,
    committed_checkpoints,
    job_checkpoint_uri,
    model_state_dict,
    restore_model,
)
from springback.storage.store import ObjectStore, join
from springback.v1 import types_pb2 as pb
from springback.worker.train.checkpointing import GenerationCheckpoints, restore_from_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def build(seed: int, *, hidden: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, hidden), "unused": torch.nn.Linear(4, 2)})
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model["used"](torch.randn(5, 4, generator=g)).square().sum().backward()  # "unused" gets no grad
    opt.step()
    opt.zero_grad()


def save(base: str, model, opt, step: int, world: int = 1) -> None:
    ranks = [Checkpointer(base, rank=r, world_size=world) for r in range(world)]
    futures = [c.save(step, model_state_dict(model, opt), generation=1, optimizer=opt) for c in ranks]
    for f in futures:
        f.result(timeout=60)
    for c in ranks:
        c.close()


def trained_checkpoint(tmp_path, world: int = 1) -> tuple[str, torch.nn.Module, torch.optim.Optimizer]:
    """A model trained one step (its "unused" module never stepped), checkpointed at step 1."""
    base = str(tmp_path / "ck")
    model, opt = build(0)
    train_step(model, opt, 1)
    save(base, model, opt, 1, world=world)
    return base, model, opt


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class TestPartialOptimizerState:
    def test_a_parameter_that_was_never_stepped_restores_without_state(self, tmp_path):
        base, model, opt = trained_checkpoint(tmp_path)
        model2, opt2 = build(99)
        assert restore_model(base, model2, opt2).step == 1
        assert all(torch.equal(a, b) for a, b in zip(params(model).values(), params(model2).values()))
        unused = {id(p) for p in model2["unused"].parameters()}
        assert not any(id(p) in unused for p in opt2.state)  # as saved: no state for it
        # training goes on identically from the restored state
        train_step(model, opt, 2)
        train_step(model2, opt2, 2)
        assert all(torch.equal(a, b) for a, b in zip(params(model).values(), params(model2).values()))


class TestOptimizerByParameterName:
    def test_a_checkpoint_with_param_groups_by_index_is_refused_saying_so(self, tmp_path):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        base = str(tmp_path / "ck")
        model, opt = build(0)
        train_step(model, opt, 1)
        msd, osd = get_state_dict(model, opt)  # the nested form: param groups by index
        saver = Checkpointer(base, rank=0, world_size=1)
        saver.save(1, {"model": msd, "optim": osd}, generation=1).result(timeout=60)
        saver.close()
        model2, opt2 = build(99)
        before = params(model2)
        with pytest.raises(CheckpointMismatch, match="by param group index"):
            restore_model(base, model2, opt2)
        assert all(torch.equal(before[k], v) for k, v in params(model2).items())


class TestAllOrNothing:
    def test_a_checkpoint_of_another_model_is_refused_naming_the_entry_and_changes_nothing(self, tmp_path):
        base, model, opt = trained_checkpoint(tmp_path)
        other, other_opt = build(5, hidden=3)
        other["extra"] = torch.nn.Linear(2, 2)
        other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
        before = params(other)
        with pytest.raises(CheckpointMismatch, match=r"model\.extra\.weight"):
            restore_model(base, other, other_opt)
        assert all(torch.equal(before[k], v) for k, v in params(other).items())

    def test_a_restore_that_fails_while_reading_leaves_the_model_as_it_was(self, tmp_path):
        base, model, opt = trained_checkpoint(tmp_path, world=2)  # two shard files
        (ckpt,) = committed_checkpoints(base)
        ObjectStore(base).rm(join(ckpt.uri, "__1_0.distcp"))  # lost after the commit
        model2, opt2 = build(99)
        before = params(model2)
        with pytest.raises(BaseException, match="__1_0.distcp|No such file"):  # DCP wraps the error
            restore_model(base, model2, opt2, verify_checksums=False)
        assert all(torch.equal(before[k], v) for k, v in params(model2).items())
        assert not opt2.state


class TestSessionStateEntries:
    def test_an_lr_scheduler_in_state_is_checkpointed_and_restored(self, tmp_path):
        def session_state(seed: int) -> dict:
            model, opt = build(seed)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"model": model, "optimizer": opt, "sched": sched}

        state = session_state(0)
        for i in range(5):
            train_step(state["model"], state["optimizer"], i)
            state["sched"].step()
        plan = pb.Plan(job_id="job-s", generation=1, world_size=1)
        plan.spec.checkpoint.uri = f"file://{tmp_path}/ck"
        session = SimpleNamespace(state=state, reporter=None, env=SimpleNamespace(job_id="job-s"))
        checkpoints = GenerationCheckpoints(ctx=session, plan=plan, rank=0)
        checkpoints.save(5, (0, 60), wait=True)
        checkpoints.close(wait_for_commit=True)
        (ckpt,) = committed_checkpoints(job_checkpoint_uri(plan.spec.checkpoint.uri, "job-s"))

        fresh = session_state(7)
        assert restore_from_checkpoint(pb.CheckpointRef(step=5, uri=ckpt.uri), fresh) == 5
        assert fresh["sched"].state_dict() == state["sched"].state_dict()
        assert fresh["optimizer"].param_groups[0]["lr"] == state["optimizer"].param_groups[0]["lr"] == 0.025
