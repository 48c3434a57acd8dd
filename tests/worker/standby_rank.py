"""A standby for tests/worker/test_ranks.py: starts a thread during its
set-up, waits for activation, then prints the scheduling class of every
thread it has (thread ids -> "idle" or "normal") and exits."""

import json
import os
import threading

from springback.client import env as E
from springback.worker.control import await_activation


def policies() -> dict[str, str]:
    return {tid: "idle" if os.sched_getscheduler(int(tid)) == os.SCHED_IDLE else "normal"
            for tid in os.listdir("/proc/self/task")}


done = threading.Event()
threading.Thread(target=done.wait, daemon=True).start()  # started while set up
identity = await_activation(os.environ[E.STANDBY_FILE])
print(json.dumps({"local_rank": identity["local_rank"], "threads": policies()}), flush=True)
done.set()
