"""The rules of a rank's held state (`worker/rank/heldstate.py`): each
transition, what it leaves as it was, and that nothing else writes the fields."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from springback.worker.rank import rngstate
from springback.worker.rank.context import RankContext
from springback.worker.rank.heldstate import HeldState

RNG = {"cpu": torch.tensor([1], dtype=torch.uint8)}
LATER = {"cpu": torch.tensor([2], dtype=torch.uint8)}


def trained(steps: int, *, clean: bool = True) -> HeldState:
    """A rank that trained `steps` steps from a fresh start."""
    held = HeldState()
    held.started_fresh()
    held.started(RNG)
    held.steps_began()
    for step in range(1, steps + 1):
        held.step_applied(step, RNG)
    if clean:
        held.ended_cleanly()
    return held


def test_a_new_rank_holds_nothing():
    held = HeldState()
    assert (held.state_step, held.step, held.clean, held.rng) == (-1, 0, False, None)


def test_the_fields_are_read_only_from_outside():
    held = HeldState()
    ctx = RankContext(env=SimpleNamespace(), state={}, device=torch.device("cpu"))  # type: ignore[arg-type]
    for obj, name in [(held, "state_step"), (held, "step"), (held, "clean"), (held, "rng"),
                      (ctx, "state_step"), (ctx, "step"), (ctx, "clean"), (ctx, "rng")]:
        with pytest.raises(AttributeError):
            setattr(obj, name, 1)


def test_the_context_reads_what_its_held_state_holds():
    ctx = RankContext(env=SimpleNamespace(), state={}, device=torch.device("cpu"),  # type: ignore[arg-type]
                      held=trained(3))
    assert (ctx.state_step, ctx.step, ctx.clean, ctx.rng) == (3, 3, True, RNG)


def test_a_step_applied_is_held_with_its_rng_and_not_clean_until_the_loop_ends():
    held = trained(2)
    held.steps_began()
    assert not held.clean and held.state_step == 2
    held.step_applied(3, LATER)
    assert (held.state_step, held.rng, held.clean) == (3, LATER, False)
    held.ended_cleanly()
    assert held.clean


@pytest.mark.parametrize("step", [2, 1, -1])
def test_a_step_applied_that_is_not_newer_is_refused_and_changes_nothing(step):
    held = trained(2, clean=False)
    with pytest.raises(ValueError):
        held.step_applied(step, LATER)
    assert (held.state_step, held.rng, held.clean) == (2, RNG, False)


def test_a_step_broken_after_its_optimizer_step_is_held_as_applied():
    held = trained(4)
    assert held.broke(5, capture=lambda: LATER)
    assert (held.state_step, held.rng, held.clean) == (5, LATER, False)


@pytest.mark.parametrize("stepped", [None, 4, 3, 6])
def test_a_step_broken_before_its_optimizer_step_holds_the_step_before(stepped):
    held = trained(4)

    def capture() -> rngstate.RngState:
        raise AssertionError("no RNG state is taken for a step not applied")

    assert not held.broke(stepped, capture=capture)
    assert (held.state_step, held.rng, held.clean) == (4, RNG, False)


def test_a_break_takes_the_process_rng_state_by_default():
    held = trained(1)
    torch.manual_seed(7)
    assert held.broke(2)
    assert torch.equal(held.rng["cpu"], torch.get_rng_state())


def test_an_agreed_step_keeps_the_clean_flag_and_leaves_the_rng_to_the_start():
    held = trained(2)  # ended cleanly at step 2
    held.agreed(5)  # received step 5 from a source
    assert (held.state_step, held.clean, held.rng) == (5, True, RNG)
    held.started(LATER)  # the source's RNG state, applied by the agreement
    assert held.rng == LATER
    broken = trained(2, clean=False)
    broken.agreed(2)
    assert not broken.clean


def test_a_fresh_start_holds_step_0():
    held = HeldState()
    held.started_fresh()
    assert (held.state_step, held.step, held.clean, held.rng) == (0, 0, False, None)


@pytest.mark.parametrize("transition", ["restored", "rolled_back"])
@pytest.mark.parametrize("step", [2, 7])  # older or newer than the step held
def test_a_restore_or_roll_back_holds_its_step_and_is_not_clean(transition, step):
    held = trained(4)
    getattr(held, transition)(step)
    assert (held.state_step, held.clean, held.rng) == (step, False, RNG)
    held.steps_began()
    held.step_applied(step + 1, LATER)  # training goes on from it
    assert held.state_step == step + 1


def test_a_failed_start_keeps_the_step_it_offers_but_is_not_clean():
    held = trained(3)
    held.start_failed()
    assert (held.state_step, held.clean, held.rng) == (3, False, RNG)


def test_a_step_broken_in_its_wait_for_the_world_keeps_its_update_pending_until_applied():
    held = trained(4)
    applied: list[int] = []
    assert not held.broke(None, capture=lambda: LATER, pending=lambda: applied.append(5))
    assert (held.state_step, held.pending_step, held.rng, applied) == (4, 5, RNG, [])
    held.apply_pending()
    assert (held.state_step, held.pending_step, held.rng, applied) == (5, None, LATER, [5])


def test_a_pending_update_dropped_or_overtaken_is_never_applied():
    def never() -> None:
        raise AssertionError("a dropped pending update was applied")

    held = trained(4)
    held.broke(None, pending=never)
    held.drop_pending()
    assert (held.state_step, held.pending_step) == (4, None)
    for transition, step in [("agreed", 6), ("restored", 2), ("rolled_back", 3)]:
        held = trained(4)
        held.broke(None, pending=never)
        getattr(held, transition)(step)
        assert (held.state_step, held.pending_step) == (step, None), transition
    held = trained(4)  # applied after its optimizer step: nothing is pending
    assert held.broke(5, pending=never) and held.pending_step is None


def test_a_pending_update_that_raises_leaves_the_rank_holding_nothing():
    def failing() -> None:
        raise RuntimeError("half an update")

    held = trained(4)
    held.broke(None, pending=failing)
    with pytest.raises(RuntimeError, match="half an update"):
        held.apply_pending()
    assert (held.state_step, held.pending_step, held.rng) == (-1, None, None)


def test_a_pending_update_is_the_optimizer_step_of_the_gradients_at_the_break():
    """`Generation` keeps the update of a step whose wait for the world broke:
    the gradients then, applied after the session dropped them for the next
    start, and dropped again afterwards."""
    from springback.worker.train.generation import _pending_update

    def model_and_optimizer() -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    reference, ref_opt = model_and_optimizer()
    reference(torch.ones(4, 3)).square().mean().backward()
    ref_opt.step()
    model, opt = model_and_optimizer()
    model(torch.ones(4, 3)).square().mean().backward()
    update = _pending_update(opt)
    opt.zero_grad(set_to_none=True)  # Session._clear_gradients at the next start
    update()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q) and p.grad is None
