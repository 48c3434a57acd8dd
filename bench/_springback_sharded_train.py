"""Sharded goodput benchmark, Springback side (bench/goodput.py --sharded):
bench/_goodput_common.py's `Blocks` model in the Session's sharded form,
HSDP on the generation's mesh: every block and the root FSDP2 units over
``mesh["replicate", "shard"]``, AdamW. The job's layout fixes shard = 2, so
4 nodes train replicate 2 x shard 2 and 2 or 3 nodes replicate 1 x shard 2
(a third node waits as a spare); the state moves between generations in
memory (worker/state/reshard.py). Started by the agent on each node."""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed.fsdp import fully_shard

import _goodput_common as C
from springback.worker import Session


def build(mesh):  # noqa: ANN001, ANN201 - the form a user writes
    model = C.make_blocks()
    dp = mesh["replicate", "shard"]
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, C.make_adamw(model)


def main() -> int:
    if os.environ.get("GOODPUT_LOG") == "info":  # the library's own lines, for diagnosis
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    session = Session(build=build, num_samples=C.NUM_SAMPLES, global_batch_size=C.GLOBAL_BATCH,
                      seed=C.SEED, max_steps=C.MAX_STEPS)
    for gen in session.generations():
        with gen:
            for batch in gen.batches():
                gen.report(loss=C.train_step(gen.model, gen.optimizer, batch.indices,
                                             batch.loss_scale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
