"""bench/goodput.py's options for the straggler trace (--straggler): parsing
only, no bench run (the bench is run by hand; docs/benchmarks.md); and its
breakdown table of a kill's and a join's time, from hand-made costs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def goodput():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_goodput", BENCH / "goodput.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def test_the_straggler_trace_defaults(goodput):
    args = goodput._parse(["--straggler"])
    assert (args.nodes, args.max_steps, args.slow_node, args.slow_from_step) == (4, 600, 3, 150)
    assert args.only == "springback,torchft"
    assert args.kill_every_s == float("inf")  # no kills
    assert goodput.straggler_spec(args) == {"straggler": {
        "enabled": True, "window_steps": 30, "change_cost_s": 5.0}}


def test_the_kill_trace_keeps_its_defaults(goodput):
    args = goodput._parse([])
    assert (args.nodes, args.max_steps, args.kill_every_s) == (3, 1500, 20.0)
    assert args.only == "springback,torchft,torchrun" and not args.straggler


def test_the_straggler_options(goodput):
    args = goodput._parse(["--straggler", "--nodes", "3", "--slow-node", "0", "--max-steps", "300",
                           "--slow-from-step", "40", "--slow-sleep-s", "0.1",
                           "--straggler-window-steps", "10", "--straggler-change-cost-s", "2"])
    assert (args.nodes, args.slow_node, args.max_steps, args.slow_from_step) == (3, 0, 300, 40)
    assert goodput.straggler_spec(args)["straggler"] == {
        "enabled": True, "window_steps": 10, "change_cost_s": 2.0}
    from _baselines import slow_env
    assert slow_env(args, "springback-node0") == {
        "GOODPUT_COMPUTE_SLEEP_S": "0.1", "GOODPUT_COMPUTE_SLEEP_FROM_STEP": "40"}
    assert slow_env(args, "torchft-hb5000-node1") == {}
    assert slow_env(goodput._parse([]), "springback-node0") == {}  # kill traces: nobody slow


@pytest.mark.parametrize("argv", [
    ["--straggler", "--sharded"],
    ["--straggler", "--only", "springback,torchrun"],
    ["--straggler", "--springback-checkpoints", "auto"],
    ["--straggler", "--repeat", "2"],
    ["--straggler", "--slow-node", "4"],
    ["--straggler", "--slow-from-step", "600"],
    ["--straggler", "--slow-from-step", "5"],
])
def test_straggler_trace_refuses(goodput, argv, capsys):
    with pytest.raises(SystemExit):
        goodput._parse(argv)
    assert "--s" in capsys.readouterr().err


def test_the_breakdown_table_puts_each_cost_in_its_column(goodput, capsys):
    import json

    from springback.client.badput import ChangeCost
    from springback.v1 import job_service_pb2 as js

    kill = ChangeCost(generation=3, kind="kill", change_kind=js.CHANGE_KIND_NODE_LOST, at_s=13,
                      waits=False, started=True, detection=5.0, waiting=0.0, reforming=1.5,
                      build=0.25, fill=0.75, first_step=None, redone=2.0, steps_redone=4)
    join = ChangeCost(generation=4, kind="join", change_kind=js.CHANGE_KIND_JOIN, at_s=20,
                      waits=False, started=True, detection=0.0, waiting=0.0, reforming=3.0,
                      build=0.0, fill=0.5, first_step=0.125, redone=0.0, steps_redone=0,
                      step_gap_s=4.0, median_step_s=0.25)
    goodput._print_changes("springback lt 5s", [kill, join])
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0] + " " + line.split()[1]: line.split()[2:] for line in lines
            if line.startswith(("kill", "join"))}
    # detect, wait, reform, build, fill, 1st step, redone, total, steps redone, gap, x step
    assert rows["kill g3"] == ["13.0", "5.00", "0.00", "1.50", "0.25", "0.75", "-", "2.00",
                               "9.50", "4", "-", "-"]
    assert rows["join g4"] == ["20.0", "0.00", "0.00", "3.00", "0.00", "0.50", "0.12", "0.00",
                               "3.62", "0", "4.00", "16.00"]
    assert any("join: the survivors' longest pause 16.0 x their median step" in line
               for line in lines)
    assert rows["kill mean"] == ["5.00", "0.00", "1.50", "0.25", "0.75", "-", "2.00", "9.50",
                                 "4.0"]
    assert any("kill: first step measured for 0 of 1" in line for line in lines)
    out = json.loads(json.dumps(goodput._change_json(
        [{"system": "springback lt 5s", "changes": [kill, join]}, {"system": "torchft"}])))
    assert [r["generation"] for r in out[0]["rows"]] == [3, 4] and len(out) == 1
    assert out[0]["summary"]["join"]["mean"]["first_step"] == 0.125
    assert out[0]["rows"][0]["total"] == 9.5
