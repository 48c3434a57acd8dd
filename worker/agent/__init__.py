"""The node agent (``springback run``): the process that joins a job as a
member, supervises the node's ranks and relays plans to them. It never imports
torch or the training library (a contract in pyproject.toml): it must start its
ranks before torch's import would have finished.

`node` is the agent (`Agent`), `config` what it runs, `command` its command
line; `ranks` (library mode) and `restart` (restart mode) supervise the rank
processes; `startup`, `launch`, `watchdog`, `ranklogs`, `preemption` and
`metrics` are the pieces it drives."""
