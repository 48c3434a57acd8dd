"""One rank of tests/worker/test_boundary.py's broken-vote test: two gloo
ranks vote at a step boundary; rank 1 then exits, so rank 0's next vote fails
(connection reset), and rank 0 leaves the broken group as a Generation does,
passing the exception. Prints one JSON line: whether gloo's tensors were
released (`leave_group` logs a warning when its wait for them times out)."""

import json
import logging
import os
import sys

from springback.worker.train.boundary import StepBoundary, Vote
from springback.worker.rank.rendezvous import form_group, leave_group

from peerexit import exit_without_finalizing


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def vote(boundary: StepBoundary, step: int):  # noqa: ANN201
    return boundary.vote(Vote(step=step, generation_seen=1, loss_share=1.0, draining=False,
                              last_holder=False, ended_t=float(step)))


def main(rank: int, port: int) -> int:
    form_group(secret="", job_id="broken-vote", generation=1, rank=rank, world_size=2,
               master_addr="127.0.0.1", master_port=port, backend="gloo",
               collective_timeout_s=30, rendezvous_timeout_s=30, superseded=lambda: False)
    boundary = StepBoundary(rank, 2)
    vote(boundary, 1)
    boundary.settle()
    if rank == 1:
        os._exit(0)  # dies with the group up: the peer's next collective is reset
    warnings = Warnings()
    logging.getLogger("springback.worker.rank.rendezvous").addHandler(warnings)
    try:
        vote(boundary, 2)
        vote(boundary, 3)  # waits for step 2's all-reduce: raises
        failed = ""
    except RuntimeError as e:
        failed = str(e).splitlines()[0]
        boundary.abandon()
        leave_group(broken=True, cause=e, release_timeout_s=20.0)
    print(json.dumps({"failed": failed, "warnings": warnings.lines}), flush=True)
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main(int(sys.argv[1]), int(sys.argv[2])))
