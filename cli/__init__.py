"""The `springback` command line: the one package that knows every side.

It wires the coordinator (`springback.service`), the node agent
(`springback.worker`), checkpoint storage (`springback.storage`) and the
client (`springback.client`) into sub-commands; nothing below imports it.
`python -m springback.cli` is the `springback` command.
"""
