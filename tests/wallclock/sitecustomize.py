"""Test shim: a process whose wall clock is off, and jumps, while its monotonic
clock runs true (what an NTP step or a VM restored from a snapshot does).

Put this directory on PYTHONPATH and name a file in SPRINGBACK_TEST_WALLCLOCK_FILE;
the file holds the offset in seconds (e.g. ``86400`` a day ahead, ``-3600`` an
hour behind) and may be rewritten while the process runs: the new offset is
read within 0.1 s, so the wall clock jumps. Children inherit the environment,
so an agent and its ranks jump together.

What is shifted: `time.time`, `time.time_ns` and `datetime.datetime.now`/
`utcnow`/`today` (logging, protobuf timestamps and every wall-clock read in
Springback's Python go through these). What is not: the monotonic clocks
(`time.monotonic`, `perf_counter`, C++ steady clocks: deadlines, gloo), wall-
clock reads inside C libraries, and `time.time` called from gRPC's Python
package, which turns a call's timeout into an absolute wall-clock deadline for
its C core: on a machine whose clock is off, both sides of that pair are off
together, so they must stay paired here too. libfaketime cannot do this here: it
shifts the monotonic clock too (Python's timed waits then block for the
offset), or, told not to, breaks `time.sleep` (EINVAL from clock_nanosleep).
"""

import datetime as _datetime
import os
import time as _time

_PATH = os.environ.get("SPRINGBACK_TEST_WALLCLOCK_FILE")

if _PATH:
    _real_time, _real_time_ns, _monotonic = _time.time, _time.time_ns, _time.monotonic
    _state = {"read_at": -1.0, "offset": 0.0}

    def _offset() -> float:
        now = _monotonic()
        if now - _state["read_at"] >= 0.1:
            _state["read_at"] = now
            try:
                with open(_PATH) as f:
                    _state["offset"] = float(f.read().strip() or 0)
            except (OSError, ValueError):
                pass  # being rewritten: keep the last offset
        return _state["offset"]

    import sys as _sys

    def _paired_with_c(depth: int = 2) -> bool:
        """True when the caller is gRPC's Python (see the module docstring)."""
        name = _sys._getframe(depth).f_globals.get("__name__", "")
        return name == "grpc" or name.startswith(("grpc.", "grpc_"))

    def _shifted_time() -> float:
        return _real_time() + (0.0 if _paired_with_c() else _offset())

    def _shifted_time_ns() -> int:
        return _real_time_ns() + (0 if _paired_with_c() else int(_offset() * 1e9))

    class _ShiftedDateTime(_datetime.datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ANN001, ANN206 (the stdlib signature)
            return _datetime.datetime.fromtimestamp(_shifted_time(), tz)

        @classmethod
        def utcnow(cls):  # noqa: ANN206
            return _datetime.datetime.fromtimestamp(
                _shifted_time(), _datetime.timezone.utc).replace(tzinfo=None)

        @classmethod
        def today(cls):  # noqa: ANN206
            return _datetime.datetime.fromtimestamp(_shifted_time())

    _time.time = _shifted_time
    _time.time_ns = _shifted_time_ns
    _datetime.datetime = _ShiftedDateTime
