"""Reshard-aware sampling: which sample indices each rank trains on, per step.

The sample stream is a pure function of the job's data spec, so it survives any
sequence of generations without shared state:

* Epoch ``e`` visits the indices ``0..num_samples-1`` in the order of a
  permutation seeded by ``(seed, e)``.
* Concatenating the epochs gives one global stream of *positions*; step ``s``
  (1-based) consumes positions ``[(s-1)*B, s*B)`` with ``B`` the global batch
  size, which never changes. A step may straddle two epochs.
* Within a step the ``B`` positions are split into ``world_size`` contiguous
  shards whose sizes differ by at most one, so the per-rank batch adapts as the
  world size changes and the global batch stays constant. A generation calls
  this with its data-parallel size and coordinate (`worker/state/mesh.py`): ranks
  that differ only in their TP or PP coordinate get the same batch.

Because survivors resume at a step boundary (the step their state holds) and a
step's positions do not depend on the world size, every index of an epoch is
consumed exactly once however often the world is resharded. Losses should be
scaled by `Batch.loss_scale` so that DDP's gradient average equals the mean over
the global batch even when shards are unequal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Batch:
    """One rank's share of one step."""

    step: int
    """1-based step this batch belongs to."""
    indices: np.ndarray
    """Sample indices (into the dataset) this rank trains on; may be empty."""
    epochs: np.ndarray
    """Epoch of each index (a step may straddle an epoch boundary)."""
    global_batch_size: int
    """Samples in the whole step, over all ranks."""
    world_size: int
    """Ranks in the generation that runs this step."""

    @property
    def loss_scale(self) -> float:
        """Multiply a *sum* of per-sample losses by this before backward.

        DDP divides the all-reduced gradient by the world size, so scaling the
        local sum by ``world_size / global_batch_size`` makes the result the
        exact mean over the global batch, whatever the shard sizes.
        """
        return self.world_size / self.global_batch_size

    def micro_batches(self, max_size: int) -> list[np.ndarray]:
        """Splits `indices` into chunks of at most `max_size`, for gradient
        accumulation when a small world gives each rank a large shard."""
        if max_size <= 0:
            raise ValueError(f"max_size must be positive, got {max_size}")
        return [self.indices[i:i + max_size] for i in range(0, len(self.indices), max_size)] or [
            self.indices
        ]


@dataclass
class SampleStream:
    """The job's global sample stream (see the module docstring)."""

    num_samples: int
    global_batch_size: int
    seed: int = 0
    _cache: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_samples <= 0:
            raise ValueError(f"data.num_samples must be positive, got {self.num_samples}")
        if self.global_batch_size <= 0:
            raise ValueError(
                f"data.global_batch_size must be positive, got {self.global_batch_size}")

    def permutation(self, epoch: int) -> np.ndarray:
        """The visiting order of epoch `epoch` (deterministic in seed and epoch)."""
        perm = self._cache.get(epoch)
        if perm is None:
            rng = np.random.default_rng([int(self.seed), int(epoch)])
            perm = rng.permutation(self.num_samples)
            if len(self._cache) > 4:
                self._cache.clear()
            self._cache[epoch] = perm
        return perm

    def cursor_after(self, step: int) -> tuple[int, int]:
        """(epoch, offset) of the first position not consumed after `step` steps."""
        pos = step * self.global_batch_size
        return pos // self.num_samples, pos % self.num_samples

    def shard_bounds(self, world_size: int, rank: int) -> tuple[int, int]:
        """[start, end) of `rank`'s shard within a step's B positions."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        base, extra = divmod(self.global_batch_size, world_size)
        start = rank * base + min(rank, extra)
        return start, start + base + (1 if rank < extra else 0)

    def batch(self, step: int, world_size: int, rank: int) -> Batch:
        """`rank`'s share of step `step` (1-based) in a world of `world_size`."""
        if step < 1:
            raise ValueError(f"steps are 1-based, got {step}")
        lo, hi = self.shard_bounds(world_size, rank)
        first = (step - 1) * self.global_batch_size
        epoch, offset = divmod(first + lo, self.num_samples)
        if offset + (hi - lo) <= self.num_samples:  # within one epoch: one slice (most steps)
            return Batch(step=step, indices=self.permutation(epoch)[offset:offset + hi - lo].copy(),
                         epochs=np.full(hi - lo, epoch, dtype=np.int64),
                         global_batch_size=self.global_batch_size, world_size=world_size)
        positions = np.arange(first + lo, first + hi, dtype=np.int64)
        epochs = positions // self.num_samples
        offsets = positions % self.num_samples
        indices = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            indices[mask] = self.permutation(int(epoch))[offsets[mask]]
        return Batch(step=step, indices=indices, epochs=epochs,
                     global_batch_size=self.global_batch_size, world_size=world_size)
