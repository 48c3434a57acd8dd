"""A rank's device and process-group backend (both forms, every layout)."""

from __future__ import annotations

import torch


def group_backend(backend: str) -> str:
    """The process-group backend for `backend`: with NCCL the library's own
    small collectives (CPU tensors) run on a gloo side of the same group."""
    if backend == "nccl":
        return "cpu:gloo,cuda:nccl"
    return backend


def rank_device(backend: str, local_rank: int) -> torch.device:
    """This rank's device: ``cuda:<local_rank>`` (made current) with NCCL."""
    if "nccl" not in backend:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"Session(backend={backend!r}) needs CUDA; no device is visible")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
