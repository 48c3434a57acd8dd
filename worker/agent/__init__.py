"""The node agent (``springback run``): the process that joins a job as a
member, supervises the node's ranks and relays plans to them. It never imports
torch or the training library (a contract in pyproject.toml): it must start its
ranks before torch's import would have finished.

`node` is the agent (`Agent`), `config` what it runs, `command` its command
line; a `runner.RankRunner` runs the rank processes, seeing the agent through
`runner.AgentPort`: `library` (library mode, over `ranks`) or `restart`
(restart mode), picked by `command.runner_for`; `startup`, `launch`, `watchdog`, `ranklogs`, `preemption` and
`metrics` are the pieces it drives."""
