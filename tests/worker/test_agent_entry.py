"""``python -m springback.worker.agent``: the `run` command without the CLI,
which alone knows how to start a local coordinator."""

from __future__ import annotations

from springback.worker.agent.command import main


def test_standalone_needs_the_springback_cli_and_says_so(capsys):
    assert main(["--standalone", "--", "python", "train.py"]) == 2
    assert "--standalone is a `springback run` option" in capsys.readouterr().err


def test_a_bad_fork_server_variable_is_named_and_nothing_starts(capsys, monkeypatch):
    monkeypatch.setenv("SPRINGBACK_FORK_SERVER", "yes")
    assert main(["--job", "j", "--coordinator", "127.0.0.1:1", "--", "python", "train.py"]) == 2
    assert "SPRINGBACK_FORK_SERVER='yes': 1" in capsys.readouterr().err
