"""`springback job watch` on a terminal: a `rich` live line (cli/main.py show_live)."""

from __future__ import annotations

import io

from rich.console import Console

from springback.cli.main import show_live
from springback.v1 import types_pb2 as pb


def _job(generation: int, step: int) -> pb.Job:
    return pb.Job(id="j1", spec=pb.JobSpec(name="n", max_steps=10),
                  status=pb.JobStatus(state=pb.JOB_STATE_RUNNING, generation=generation,
                                      world_size=2, step=step))


def test_steps_rewrite_the_live_line_and_a_new_generation_keeps_the_last_one():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    events = [(_job(1, 1), "step"), (_job(1, 2), "step"), (_job(1, 3), "step"),
              (_job(2, 3), "generation"), (_job(2, 4), "step")]
    show_live(events, console)
    # What stays on screen: for each finished line, what was drawn after its last \r.
    screen = [seg.split("\r")[-1].replace("\x1b[2K", "").strip()
              for seg in out.getvalue().split("\n")]
    screen = [line for line in screen if line and not line.startswith("\x1b[?")]
    assert len(screen) == 2, screen
    assert screen[0].startswith("[gen   1]") and "step      3/10" in screen[0]
    assert screen[1].startswith("[gen   2]") and "step      4/10" in screen[1]
