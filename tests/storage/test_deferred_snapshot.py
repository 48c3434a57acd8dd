"""save(..., optimizer=opt) copies parameters and optimizer state in the background while
training goes on; the checkpoint must still be exactly the state at save() time."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from springback.storage import Checkpointer, model_state_dict, restore
from springback.storage.snapshot import ShardSnapshot

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def tensors(sd: object) -> list[torch.Tensor]:
    if isinstance(sd, torch.Tensor):
        return [sd]
    if isinstance(sd, dict):
        return [t for k in sorted(sd, key=str) for t in tensors(sd[k])]
    if isinstance(sd, (list, tuple)):
        return [t for v in sd for t in tensors(v)]
    return []


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()  # BatchNorm updates its buffers in forward: not in opt's state
    opt.step()
    opt.zero_grad()


@pytest.fixture
def slow_deferred_copy(monkeypatch):
    """Start deferred copies late, so that training would overwrite the state if nothing waited."""
    real = ShardSnapshot.copy_pending

    def late(self: ShardSnapshot) -> None:
        time.sleep(0.3)
        real(self)

    monkeypatch.setattr(ShardSnapshot, "copy_pending", late)


@pytest.mark.parametrize("deferred", [True, False], ids=["with-optimizer-hook", "copy-in-save"])
def test_checkpoint_is_bit_identical_to_the_state_at_save_time_while_training_goes_on(
    tmp_path, slow_deferred_copy, deferred
):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    for _ in range(2):
        train_step(model, opt, x)
    sd = model_state_dict(model, opt)
    expected = copy.deepcopy(sd)  # the clone taken at save time
    base = f"file://{tmp_path}/ckpts"
    c = Checkpointer(base, rank=0, world_size=1)
    t0 = time.perf_counter()
    c.save(1, sd, generation=1, optimizer=opt if deferred else None)
    stall = time.perf_counter() - t0
    for _ in range(3):  # training goes on at once: forward changes buffers, step changes params + moments
        train_step(model, opt, x)
    hook_wait = c.stats.last_hook_wait_s
    c.wait(30)
    live = tensors(model_state_dict(model, opt))
    assert any(not torch.equal(a, b) for a, b in zip(live, tensors(expected))), "training must have changed the state"

    out = copy.deepcopy(expected)
    for t in tensors(out):
        t.zero_()
    restore(base, out, step=1)
    got, want = tensors(out), tensors(expected)
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if deferred:
        assert stall < 0.3, "save() must not wait for the deferred copy"
        assert hook_wait > 0.1, "the first step must have waited for the copy"
    else:
        assert hook_wait == 0.0
    c.close()


def test_only_optimizer_tensors_are_deferred_and_close_removes_the_hook(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, opt, torch.randn(3, 4))
    sd = model_state_dict(model, opt)
    c = Checkpointer(f"file://{tmp_path}/c", rank=0, world_size=1)
    snap = c._staging.snapshot(sd, rank=0, world_size=1, defer=frozenset())
    assert snap.pending == [] and snap.copied.is_set()
    from springback.storage.snapshot import storage_keys

    snap = c._staging.snapshot(sd, rank=0, world_size=1, defer=storage_keys([opt]))
    # 2 Linear params + 2 BatchNorm params + their 4 momentum buffers; not the BN running stats
    assert len(snap.pending) == 8 and not snap.copied.is_set()
    snap.copy_pending()
    assert snap.copied.is_set() and snap.pending == []
    c.save(1, sd, generation=1, optimizer=opt).result(30)
    assert len(opt._optimizer_step_pre_hooks) == 1
    c.close()
    assert len(opt._optimizer_step_pre_hooks) == 0
