"""One rank of test_handover.py: ``python handover_peer.py RANK WORLD
STORE_PATH [VICTIM]``. Ranks 0..WORLD-2 hold the same trained DDP state
(step 3, ended cleanly); the last rank is a joiner with other values. Every
rank runs the library's own `StateAgreement.agree` and prints
``RESULT <json>``: the step it holds, the SHA-256 of its state's bytes, the
bytes it sent through gloo's isend (counted around the library's calls),
or the error the agreement raised.

With VICTIM = k, holder k exits (``os._exit(9)``) after sending its first
chunk: a holder lost mid hand-over; the others must keep what they held."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

import springback.worker.state.handover as handover_module
from springback.v1 import types_pb2 as pb
from springback.worker.rank.context import RankContext
from springback.worker.train.agreement import StateAgreement

from peerexit import exit_without_finalizing

RANK, WORLD, STORE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
VICTIM = int(sys.argv[4]) if len(sys.argv) > 4 else -1
JOINER = WORLD - 1


def digest(state: dict[str, Any]) -> str:
    """SHA-256 over the bytes of every tensor (and the repr of every other
    value) of the state dicts, by key path."""
    h = hashlib.sha256()

    def feed(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                feed(f"{prefix}/{k}", value[k])
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                feed(f"{prefix}/{i}", v)
        elif isinstance(value, torch.Tensor):
            h.update(prefix.encode() + str(value.dtype).encode()
                     + value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={value!r}".encode())

    feed("", {k: v.state_dict() for k, v in state.items()})
    return h.hexdigest()


def main() -> None:
    torch.manual_seed(RANK if RANK == JOINER else 0)
    # ~6 MiB of parameters + 12 MiB of AdamW moments in 1 MiB chunks: large
    # tensors cut into pieces, small ones packed
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1536), torch.nn.ReLU(),
                                torch.nn.Linear(1536, 10), torch.nn.LayerNorm(10))
    model.register_buffer("counts", torch.arange(7, dtype=torch.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ctx = RankContext(env=SimpleNamespace(rendezvous_timeout_s=60.0, job_id=""),  # type: ignore[arg-type]
                      state={"model": model, "optimizer": opt}, device=torch.device("cpu"))
    if RANK != JOINER:
        for _ in range(3):
            model(torch.randn(4, 1024)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        ctx.held.step_applied(3, None)
        ctx.held.ended_cleanly()
    before = digest(ctx.state)
    sent = [0]
    real_isend = handover_module.dist.isend

    def counting_isend(tensor: torch.Tensor, dst: int, *args: Any, **kwargs: Any) -> Any:
        if RANK == VICTIM and sent[0] > 0:
            sys.stdout.flush()
            os._exit(9)  # a holder lost mid hand-over
        sent[0] += tensor.numel() * tensor.element_size()
        return real_isend(tensor, dst, *args, **kwargs)

    handover_module.dist.isend = counting_isend  # type: ignore[assignment]
    handover_module.CHUNK_BYTES = 2**20  # ~20 chunks: each holder sends several
    store = dist.FileStore(STORE, WORLD)
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=20))
    p = pb.Plan(generation=2, world_size=WORLD)
    p.restore.kind = pb.RESTORE_KIND_PEERS
    p.restore.source_rank = 0
    result: dict[str, Any] = {"before": before}
    try:
        outcome = StateAgreement(ctx, None, None).agree(p, RANK)
        result["source"] = outcome.source
    except RuntimeError as e:
        result["error"] = str(e).splitlines()[0]
    result.update(step=ctx.state_step, digest=digest(ctx.state), sent=sent[0])
    print("RESULT " + json.dumps(result))
    exit_without_finalizing(0)  # also: no teardown of a group a peer may have left


main()
