"""bench/goodput.py's options for the straggler trace (--straggler): parsing
only, no bench run (the bench is run by hand; docs/benchmarks.md)."""

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
