"""The batch arithmetic that keeps a restart-mode job's data order.

A trainer's distributed sampler splits the batches of one seeded permutation
over the ranks, so global step k consumes positions ``[k*G, (k+1)*G)`` of the
epoch's permutation, whatever the world size, as long as the global batch
``G`` stays the same. Springback's world size changes between generations; a
script that takes its per-rank batch from `per_rank_batch_size` keeps ``G``.
"""

from __future__ import annotations

import os


def per_rank_batch_size(global_batch_size: int, *, gradient_accumulation_steps: int = 1,
                        world_size: int | None = None) -> int:
    """``global_batch_size / (world_size * gradient_accumulation_steps)``.

    `world_size` defaults to $WORLD_SIZE (1 when unset). Raises ValueError,
    naming the numbers, when the global batch does not split evenly: the
    generation could not keep the global batch, so the sample order (and a
    resumed run's position in it) would change with the world size."""
    if global_batch_size <= 0 or gradient_accumulation_steps <= 0:
        raise ValueError(f"global_batch_size ({global_batch_size}) and "
                         f"gradient_accumulation_steps ({gradient_accumulation_steps}) "
                         "must be positive")
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    per_step = world * gradient_accumulation_steps
    if global_batch_size % per_step:
        raise ValueError(f"global batch {global_batch_size} does not split over {world} ranks x "
                         f"{gradient_accumulation_steps} accumulation steps: choose a global "
                         "batch that every world size of the job divides")
    return global_batch_size // per_step
