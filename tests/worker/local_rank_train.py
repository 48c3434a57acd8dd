"""A library-mode script that records, per process, what a torchrun-minded
script would read after `Session()`: LOCAL_RANK from the environment, next to
the session's own local rank and the generation's global rank."""

import json
import os

import torch

from springback.worker import Session


def main() -> None:
    torch.set_num_threads(1)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = Session(model=model, optimizer=opt, num_samples=16, global_batch_size=4,
                      max_steps=3)
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:  # the fork server, or the agent
        parent = f.read().replace(b"\0", b" ").decode()
    record = {"pid": os.getpid(), "parent": parent, "LOCAL_RANK": os.environ["LOCAL_RANK"],
              "session_local_rank": session.env.local_rank, "ranks": []}
    for gen in session.generations():
        with gen:
            record["ranks"].append(gen.rank)
            for batch in gen.batches():
                loss = model(torch.ones(len(batch.indices), 2)).sum() * batch.loss_scale
                loss.backward()
                opt.step()
                opt.zero_grad()
    out = os.path.join(os.environ["LOCAL_RANK_OUT"], f"rank-{os.getpid()}.json")
    with open(out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
