"""Goodput benchmark, Springback side: bench/_goodput_common.py's model under a
Springback Session (run by `python -m springback.worker.agent ... -- python
bench/_springback_train.py`; bench/goodput.py starts it). GOODPUT_LOG=info
logs the library's info lines with timestamps into the node logs."""

from __future__ import annotations

import logging
import os
import sys


import _goodput_common as C
from springback.worker import Session


def main() -> int:
    if os.environ.get("GOODPUT_LOG") == "info":  # the library's own lines, for diagnosis
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model, opt = C.make_model()
    session = Session(model=model, optimizer=opt, num_samples=C.NUM_SAMPLES,
                      global_batch_size=C.GLOBAL_BATCH, seed=C.SEED, max_steps=C.MAX_STEPS)
    for gen in session.generations():
        with gen:
            ddp = gen.ddp(model)
            for batch in gen.batches():
                C.slow_compute(batch.step)  # a slow node's compute (goodput.py --straggler)
                gen.report(loss=C.train_step(ddp, opt, batch.indices, batch.loss_scale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
