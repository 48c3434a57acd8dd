"""The torch RNG state a rank's training state carries into a new generation.

A rank's global torch RNG state (the CPU generator, and CUDA's once CUDA is
initialised) is part of its training state, like its parameters: it is taken
at every step boundary (`Generation.batches`, as each step ends, and when a
generation has agreed on its state), and each rank of a new generation starts
from the RNG state that belongs to the state it starts from:

* a rank that holds the agreed step in memory goes back to its own RNG state
  at that step's boundary: the draws of a step that broke are undone, so the
  step runs again with the same numbers;
* a rank that receives the state (a joiner, a replacement, a rank holding an
  older step) takes the RNG state of the rank it received it from;
* a restore from a checkpoint gives rank r the RNG state saved by rank r mod N
  (N the saved world size; `storage/restoring.py`);
* a roll back to a peer copy (`worker/state/peercopy.py`) gives each rank its own RNG
  state at the copy step where it holds its own snapshot, else the source's.

A rank that took another rank's RNG state draws the same numbers as that rank
from then on. Generators the script makes itself are its own state: register
them with ``state=`` to have them handed over (anything with ``state_dict`` /
``load_state_dict``).
"""

from __future__ import annotations

import torch

RngState = dict[str, torch.Tensor]


def capture() -> RngState:
    """This process's global torch RNG states."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def apply(state: RngState | None) -> None:
    """Sets this process's RNG states to `state` (None: leaves them as they are)."""
    if state is None:
        return
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
