"""The node agent's rank logs: each rank's output, prefixed and shipped.

Every rank process the agent starts writes its stdout and stderr into a pipe
(`ranks.LocalRanks(output=...)`); a reader thread per process prefixes each
line with the rank it is now (``[rank3]``, from the agent's current plan;
``[standby]`` before a warm standby is given an identity), echoes it to the
agent's own stdout (so `kubectl logs` or journald see it), and buffers it.
Every ``flush_interval_s`` the buffer is shipped as one chunk beside the job's
checkpoints, in the job's own directory (`springback.storage.ranklogs`:
``{checkpoint.uri}/{job id}/logs/{member}/``, `job_logs_base`) for
``springback job logs``; a job without a checkpoint URI keeps only the echo.

Failure semantics: shipping never blocks a rank (the pipe is drained by the
reader whatever happens to storage). A failed upload is logged and retried
with the next flush; the buffer is capped at ``max_buffer_bytes``, past which
the oldest lines are dropped and a line saying so is shipped instead. `close`
waits for a shipment in flight (up to `SHIP_WAIT_S`), then ships what is
left, once, within the store's retry budget.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from springback.worker.agent.rankprocess import RankProcess

log = logging.getLogger("springback.agent.logs")

SHIP_WAIT_S = 20.0
"""How long `close` waits for a shipment in flight (a slow store: the
shipment holds the lines it took); the agent exits right after `close`. A
shipment imports the object store only (`springback.storage` loads its
checkpoint modules, and torch, on first use of one of their names)."""

_RANK_PREFIX = re.compile(rb"^(?:\[[^\]\n]{1,32}\]:? ?)+")
"""Leading tags such as torch's ``[rank0]: `` on a rank's output lines."""


def job_logs_base(plan: Any, job_id: str) -> str | None:
    """Where the agent of job `job_id` ships rank logs under `plan`: the job's
    own directory, ``<checkpoint.uri>/<job id>`` (`springback.client.jobdir`),
    so jobs sharing a ``checkpoint.uri`` never read or delete each other's
    logs. None before a plan, without a checkpoint URI, or when the two do not
    make a directory (the lines stay buffered; the coordinator refuses such a
    spec)."""
    from springback.client.jobdir import job_directory

    uri = plan.spec.checkpoint.uri if plan is not None else ""
    if not uri:
        return None
    try:
        return job_directory(uri, plan.job_id or job_id)
    except ValueError as e:
        log.warning("not shipping rank logs: %s", e)
        return None


class RankLogs:
    def __init__(self, *, label_of: Callable[[RankProcess], str],
                 member_of: Callable[[], str | None], base_uri_of: Callable[[], str | None],
                 echo: IO[bytes] | None = None, flush_interval_s: float = 2.0,
                 max_buffer_bytes: int = 8 << 20) -> None:
        self._label_of = label_of
        self._member_of = member_of
        self._base_uri_of = base_uri_of
        self._echo = echo if echo is not None else sys.stdout.buffer
        self._flush_interval_s = flush_interval_s
        self._max_buffer = max_buffer_bytes
        self._lock = threading.Lock()
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._dropped = 0
        self._seq = 0
        self._readers: list[threading.Thread] = []
        self._stop = threading.Event()
        self._shipper = threading.Thread(target=self._ship_loop, name="rank-logs", daemon=True)
        self._stores: dict[str, Any] = {}
        self._last_error: dict[int, str] = {}  # pid -> the last traceback's exception line
        self._reader_of: dict[int, threading.Thread] = {}

    def last_error(self, proc: RankProcess, wait_s: float = 0.5) -> str:
        """The exception line ending the last Python traceback `proc` printed
        (``ValueError: bad batch``), or ``""``; waits up to `wait_s` for its
        output to be read to the end (the caller saw it exit). Cut to 300
        characters: it goes into a failure report."""
        reader = self._reader_of.get(proc.pid)
        if reader is not None:
            reader.join(timeout=wait_s)
        with self._lock:
            return self._last_error.get(proc.pid, "")[:300]

    def start(self) -> None:
        self._shipper.start()

    def attach(self, proc: RankProcess) -> None:
        """Starts reading `proc.stdout` (a pipe); returns at once."""
        reader = threading.Thread(target=self._read, args=(proc,), name=f"rank-log-{proc.pid}",
                                  daemon=True)
        self._readers.append(reader)
        self._reader_of[proc.pid] = reader
        reader.start()

    def _read(self, proc: RankProcess) -> None:
        assert proc.stdout is not None
        in_traceback = False
        for line in iter(proc.stdout.readline, b""):
            text = _RANK_PREFIX.sub(b"", line)  # torch prefixes a rank's stderr: "[rank0]: "
            if text.startswith(b"Traceback (most recent call last):"):
                in_traceback = True
            elif in_traceback and text.strip() and not text[:1].isspace():
                in_traceback = False
                with self._lock:
                    self._last_error[proc.pid] = text.decode(errors="replace").strip()
            prefixed = f"[{self._label_of(proc)}] ".encode() + line
            if not prefixed.endswith(b"\n"):
                prefixed += b"\n"
            try:
                self._echo.write(prefixed)
                self._echo.flush()
            except (OSError, ValueError):
                pass  # the agent's stdout is gone: keep draining the pipe
            with self._lock:
                self._buffer.append(prefixed)
                self._buffered += len(prefixed)
                while self._buffered > self._max_buffer and self._buffer:
                    self._buffered -= len(self._buffer.pop(0))
                    self._dropped += 1
        proc.stdout.close()

    def _ship_loop(self) -> None:
        while not self._stop.wait(self._flush_interval_s):
            self.ship()

    def ship(self) -> bool:
        """Writes the buffered lines as one chunk; False if they stay buffered
        (no member or checkpoint URI yet, or the upload failed)."""
        member, base = self._member_of(), self._base_uri_of()
        if not member or not base:
            return False
        with self._lock:
            lines, dropped = self._buffer, self._dropped
            if not lines and not dropped:
                return True
            self._buffer, self._buffered, self._dropped = [], 0, 0
            self._seq += 1
            seq = self._seq
        if dropped:
            lines.insert(0, f"[agent] {dropped} line(s) dropped: the buffer filled before "
                            "they could be shipped\n".encode())
        try:
            from springback.storage.ranklogs import write_chunk
            from springback.storage.store import ObjectStore

            store = self._stores.get(base) or self._stores.setdefault(base, ObjectStore(base))
            write_chunk(store, base, member, int(time.time() * 1000), seq, b"".join(lines))
            return True
        except Exception as e:  # noqa: BLE001 (storage trouble must never stop the ranks)
            log.warning("shipping rank logs to %s failed (%s); retrying with the next flush",
                        base, e)
            with self._lock:
                self._buffer[:0] = lines
                self._buffered += sum(len(line) for line in lines)
            return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Waits (up to `timeout_s`) for the readers of exited ranks, then for
        a shipment in flight (up to `SHIP_WAIT_S`: it holds the lines it
        took), then ships what is left. Idempotent."""
        deadline = time.monotonic() + timeout_s
        for reader in self._readers:
            reader.join(timeout=max(deadline - time.monotonic(), 0))
        self._stop.set()
        if self._shipper.is_alive():
            self._shipper.join(timeout=SHIP_WAIT_S)
        self.ship()


def rank_label(proc: RankProcess, ranks: dict[int, RankProcess], plan: Any,
               member_id: str | None) -> str:
    """``rankN`` for a process that is local rank ``lr`` of `member_id` in `plan`,
    ``local-rankL`` when the plan does not place this member, else ``standby``."""
    local_rank = next((lr for lr, p in ranks.items() if p is proc), None)
    if local_rank is None:
        return "standby"
    placed = next((m for m in getattr(plan, "members", ()) if m.member_id == member_id), None)
    if placed is None:
        return f"local-rank{local_rank}"
    return f"rank{placed.first_rank + local_rank}"
