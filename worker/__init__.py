"""Springback's worker side: the node agent (`springback run`) and the training
library a user's script imports (`Session`, `Generation`, `Batch`)."""

from springback.worker.sampler import Batch, SampleStream
from springback.worker.session import Generation, Session

__all__ = ["Batch", "Generation", "SampleStream", "Session"]
