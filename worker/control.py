"""The agent → rank control channel: the current plan, published as a file.

The agent writes every plan it receives to ``<control_dir>/plan.pb`` (atomic
rename, so a reader sees a whole plan or the previous one) and, during a
drain, a ``drain`` marker, plus a ``last-holder`` marker when the coordinator
answered that no survivor will hold the state (the ranks must checkpoint, then
stop). Ranks poll the file: a ``stat`` per step boundary
costs microseconds, needs no extra socket and survives the rank being
restarted. A file channel also means a rank whose agent died keeps reading the
last plan; the agent's death kills its ranks anyway (parent-death signal).
"""

from __future__ import annotations

import json
import os
import time

from springback.v1 import types_pb2 as pb

PLAN_FILE = "plan.pb"
DRAIN_FILE = "drain"
LAST_HOLDER_FILE = "last-holder"


class PlanPublisher:
    """Agent side. `publish` is idempotent and never leaves a torn file."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        for name in (PLAN_FILE, DRAIN_FILE, LAST_HOLDER_FILE):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass

    def publish(self, plan: pb.Plan) -> None:
        path = os.path.join(self.directory, PLAN_FILE)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(plan.SerializeToString())
        os.replace(tmp, path)

    def request_drain(self) -> None:
        """Tells the ranks the node is draining (they may checkpoint first)."""
        with open(os.path.join(self.directory, DRAIN_FILE), "w") as f:
            f.write("drain\n")

    def request_last_holder_stop(self) -> None:
        """Tells draining ranks that no survivor will hold the state: write a
        checkpoint of the step they stop at, then stop (no new plan will come)."""
        with open(os.path.join(self.directory, LAST_HOLDER_FILE), "w") as f:
            f.write("checkpoint, then stop\n")


class PlanChannel:
    """Rank side: the newest published plan, re-read only when the file changed."""

    def __init__(self, directory: str) -> None:
        self._path = os.path.join(directory, PLAN_FILE)
        self._drain_path = os.path.join(directory, DRAIN_FILE)
        self._last_holder_path = os.path.join(directory, LAST_HOLDER_FILE)
        self._key: tuple[int, int, int] | None = None
        self._plan: pb.Plan | None = None

    def latest(self) -> pb.Plan | None:
        """The newest plan, or None before the agent published one. Never blocks."""
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return self._plan
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._key:
            try:
                with open(self._path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                return self._plan
            plan = pb.Plan()
            plan.ParseFromString(data)
            if self._plan is None or plan.generation >= self._plan.generation:
                self._plan = plan
            self._key = key
        return self._plan

    def draining(self) -> bool:
        return os.path.exists(self._drain_path)

    def last_holder(self) -> bool:
        return os.path.exists(self._last_holder_path)


def activate_standby(path: str, *, local_rank: int, member_id: str, control_dir: str,
                     collective_timeout_s: float, credential: str = "") -> None:
    """Agent side: hands a warm standby rank its identity (atomic write, the
    file readable by its owner only: it holds the member's credential). The
    standby was started before the agent joined, so everything learnt at join
    time travels here rather than in its environment."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w", encoding="utf-8") as f:
        json.dump({"local_rank": local_rank, "member_id": member_id,
                   "control_dir": control_dir, "collective_timeout_s": collective_timeout_s,
                   "credential": credential}, f)
    os.replace(tmp, path)


def ready_path(path: str) -> str:
    """Marker a standby writes once its script reached `Session()`."""
    return f"{path}.ready"


def await_activation(path: str, poll_s: float = 0.02) -> dict:
    """Rank side: marks this standby ready, then blocks until the agent
    activates it; returns the identity. No deadline: an unused standby is
    killed by its agent."""
    with open(ready_path(path), "w") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            time.sleep(poll_s)
