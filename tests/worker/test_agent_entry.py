"""``python -m springback.worker.agent``: the `run` command without the CLI,
which alone knows how to start a local coordinator."""

from __future__ import annotations

from springback.worker.agent.command import main


def test_standalone_needs_the_springback_cli_and_says_so(capsys):
    assert main(["--standalone", "--", "python", "train.py"]) == 2
    assert "--standalone is a `springback run` option" in capsys.readouterr().err
