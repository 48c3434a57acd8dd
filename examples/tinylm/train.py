"""A small character-level transformer language model, trained elastically.

Data: corpus.txt (docstrings of the Python standard library, see
make_corpus.py) cut into fixed windows of SEQ_LEN+1 characters; sample ``i`` is
window ``i``. The library decides which windows each rank trains on, so any
rank can build any batch and every window is used exactly once per epoch
however workers come and go.

    springback job submit examples/tinylm/job.yaml            # prints the job id
    springback run --job JOB -- python examples/tinylm/train.py   # on each node
    python examples/tinylm/train.py                           # standalone, one rank

Set TINYLM_MAX_STEPS to shorten a standalone run.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from springback.worker import Session

SEQ_LEN = 64
VOCAB = 128  # printable ASCII and newline
CORPUS = Path(__file__).with_name("corpus.txt")


class TinyLM(nn.Module):
    def __init__(self, d_model: int = 96, n_layers: int = 2, n_heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.zeros(SEQ_LEN, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, dim_feedforward=4 * d_model,
                                           dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ_LEN),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        x = self.blocks(x, mask=self.mask, is_causal=True)
        return self.head(self.norm(x))


def load_windows() -> torch.Tensor:
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    n = len(data) // (SEQ_LEN + 1)
    return data[: n * (SEQ_LEN + 1)].view(n, SEQ_LEN + 1).clamp_(max=VOCAB - 1)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(levelname)s %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    windows = load_windows()
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    max_steps = int(os.environ.get("TINYLM_MAX_STEPS", "300"))
    session = Session(model=model, optimizer=opt, num_samples=len(windows),
                      global_batch_size=24, seed=0, max_steps=max_steps)
    for gen in session.generations():
        with gen:
            if gen.stream.num_samples > len(windows):
                raise ValueError(f"data.num_samples={gen.stream.num_samples} but corpus.txt "
                                 f"has only {len(windows)} windows of {SEQ_LEN + 1} chars")
            ddp = gen.ddp(model)
            for batch in gen.batches():
                seqs = windows[torch.as_tensor(batch.indices)]
                logits = ddp(seqs[:, :-1])
                per_token = F.cross_entropy(logits.reshape(-1, VOCAB), seqs[:, 1:].reshape(-1),
                                            reduction="none").view(len(seqs), SEQ_LEN)
                per_sample = per_token.mean(dim=1)
                (per_sample.sum() * batch.loss_scale).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                loss = per_sample.mean().item() if len(per_sample) else 0.0
                gen.report(loss=loss)
                if gen.rank == 0 and batch.step % 25 == 0:
                    logging.info("step %d loss %.3f (ppl %.1f) world %d generation %d",
                                 batch.step, loss, math.exp(loss), gen.world_size,
                                 gen.generation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
