"""Each rank's own pieces of a sharded state, recorded with no collective, and
the whole state put back together from them in the test.

A digest of the *gathered* state (fsdp_train.py's ``record``) is a collective:
when a node is killed after step S was applied everywhere but before the
next gather finished, no rank of that generation ever records step S, and the
survivors' next generation starts at S with nothing to compare it with. So
after every step each rank writes what it holds itself —
``pieces-g<generation>-r<rank>-s<step>.pt``: every DTensor's local tensor with
its offset in the whole, every plain tensor and every other value whole —
and `assembled_digests` rebuilds each (generation, step)'s whole state from
the files of that generation's ranks, checking that replicas of a piece agree
bit for bit, and hashes it exactly as ``fsdp_train.digest`` hashes a gathered
state."""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from springback.client.env import AUDIT_DIR


def flat(d: dict, prefix: str = "") -> dict[str, Any]:
    """A nested state dict's leaves by dotted key (lists by index)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, list):
            out.update(flat(dict(enumerate(v)), f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def state_digest(state: dict[str, Any]) -> str:
    """SHA-256 of a whole flat state: key, then a tensor's bytes or a
    value's repr, in key order."""
    h = hashlib.sha256()
    for key, value in sorted(state.items()):
        h.update(key.encode())
        h.update(value.contiguous().numpy().tobytes() if isinstance(value, torch.Tensor)
                 else repr(value).encode())
    return h.hexdigest()


def without_ballast(state: dict[str, Any]) -> dict[str, Any]:
    """A flat state less the frozen ``ballast.`` entries (fsdp_train.py's
    FSDP_BALLAST_MB: seeded, never trained, only there to be moved)."""
    return {k: v for k, v in state.items() if not k.startswith("ballast.")}


def record_pieces(gen, step: int) -> None:  # noqa: ANN001
    """No collective: writes this rank's pieces of the state it holds after
    `step` (atomically: a rank killed mid-write leaves no file)."""
    audit = os.environ.get(AUDIT_DIR)
    if not audit:
        return
    pieces, whole = {}, {}
    for part in (get_model_state_dict(gen.model),
                 get_optimizer_state_dict(gen.model, gen.optimizer)):
        for key, value in without_ballast(flat(part)).items():
            if isinstance(value, DTensor):
                (chunk,) = value.__create_chunk_list__()
                pieces[key] = (tuple(value.shape), tuple(chunk.offsets),
                               value.to_local().detach().clone())
            else:
                whole[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    path = os.path.join(audit, f"pieces-g{gen.generation:04d}-r{gen.rank}-s{step:04d}.pt")
    torch.save({"pieces": pieces, "whole": whole}, path + ".tmp")
    os.replace(path + ".tmp", path)


def assembled_digests(root: Path) -> dict[tuple[int, int], str]:
    """{(generation, step): digest of the whole state} for every recorded
    step whose ranks' pieces cover the whole; raises if two ranks' copies of
    an element or a value differ."""
    files: dict[tuple[int, int], list[Path]] = defaultdict(list)
    for path in (root / "audit").glob("pieces-g*-r*-s*.pt"):
        g, _, s = path.stem.split("-")[1:]
        files[(int(g.removeprefix("g")), int(s.removeprefix("s")))].append(path)
    out = {}
    for key, paths in sorted(files.items()):
        state = _assemble([torch.load(p, weights_only=True) for p in sorted(paths)], key)
        if state is not None:
            out[key] = state_digest(state)
    return out


def _assemble(records: list[dict], where: tuple[int, int]) -> dict[str, Any] | None:
    """The whole flat state from ranks' records, or None if some element of
    some tensor is held by none of them."""
    state: dict[str, Any] = {}
    for record in records:
        for key, value in record["whole"].items():
            if key in state:
                same = (torch.equal(state[key], value) if isinstance(value, torch.Tensor)
                        else state[key] == value)
                assert same, f"ranks hold different {key} at (generation, step) {where}"
            state[key] = value
    covered: dict[str, torch.Tensor] = {}
    for record in records:
        for key, (shape, offsets, local) in record["pieces"].items():
            if key not in state:
                state[key] = torch.zeros(shape, dtype=local.dtype)
                covered[key] = torch.zeros(shape, dtype=torch.bool)
            region = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))
            held = covered[key][region]
            assert torch.equal(state[key][region][held], local[held]), \
                f"ranks hold different pieces of {key} at (generation, step) {where}"
            state[key][region] = local
            covered[key][region] = True
    return state if all(bool(c.all()) for c in covered.values()) else None
