"""Members driven the way `springback run` drives them, without ranks.

`SimMember` joins with a join token over a `springback.client.channel`
channel (the agent's: round-robin, health-checked, retrying idempotent calls)
and heartbeats on its own thread with the agent's cadence and deadline
(every liveness/4, deadline at least 1 s), counting every outcome, so fault
tests can assert how liveness fared. Real gRPC, real coordinator, real etcd.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections import Counter

import grpc

from springback.client.channel import Backoff, _service_config, connect
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc


def join(workers: ws_grpc.WorkerServiceStub, job_id: str, port: int) -> str:
    """A one-rank member registered through `workers`, without heartbeats: its id."""
    return workers.JoinJob(ws.JoinJobRequest(job_id=job_id, host="127.0.0.1", rendezvous_port=port,
                                             num_local_ranks=1), timeout=10).member.id


class SimMember:
    def __init__(self, addresses: list[str], job_id: str, *, port: int = 9900) -> None:
        self.job_id = job_id
        self._channel = connect(addresses)
        self.stub = ws_grpc.WorkerServiceStub(self._channel)
        response = self.stub.JoinJob(ws.JoinJobRequest(
            job_id=job_id, host="127.0.0.1", rendezvous_port=port, num_local_ranks=1,
            join_token=uuid.uuid4().hex), timeout=10)
        self.id = response.member.id
        self.interval_s = response.heartbeat_interval.ToTimedelta().total_seconds()
        self.num_ok = 0
        self.failures: Counter[str] = Counter()  # status code name -> count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"beat-{self.id}")
        self._thread.start()

    def _beat(self) -> None:
        request = ws.HeartbeatRequest(job_id=self.job_id, member_id=self.id)
        while not self._stop.wait(self.interval_s):
            try:
                self.stub.Heartbeat(request, timeout=max(self.interval_s, 1.0))
                self.num_ok += 1
            except grpc.RpcError as e:
                self.failures[e.code().name] += 1

    def heartbeat_once(self) -> None:
        """One heartbeat now, outside the thread; raises RpcError."""
        self.stub.Heartbeat(ws.HeartbeatRequest(job_id=self.job_id, member_id=self.id), timeout=5)

    def commit(self, generation: int, step: int,
               checkpoint_uri: str = "file:///tmp") -> ws.CommitCheckpointResponse:
        """Commits step `step` in the job's own directory under
        `checkpoint_uri` (the spec's; the coordinator refuses any other)."""
        return self.stub.CommitCheckpoint(ws.CommitCheckpointRequest(
            job_id=self.job_id, member_id=self.id, generation=generation,
            checkpoint=pb.CheckpointRef(
                step=step, uri=f"{checkpoint_uri}/{self.job_id}/step-{step}")),
            timeout=10)

    def report_step(self, generation: int, step: int) -> ws.ReportStepResponse:
        return self.stub.ReportStep(ws.ReportStepRequest(
            job_id=self.job_id, member_id=self.id, generation=generation, step=step,
            samples_consumed=step * 32), timeout=10)

    def stop_heartbeats(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def close(self) -> None:
        self.stop_heartbeats()
        self._channel.close()


class SimFleet:
    """`n` members driven on one asyncio loop (a thread of its own) over a few
    `grpc.aio` channels, the way agents drive them: JoinJob with a token, a
    WatchPlans stream (reconnected with jittered backoff on UNAVAILABLE) and
    heartbeats every liveness/4 (jittered, deadline at least 1 s). Counts what
    happened, so scale tests and `bench/agent_scale.py` can assert on it."""

    def __init__(self, addresses: list[str], job_id: str, n: int, *, num_channels: int = 4) -> None:
        self.addresses, self.job_id, self.n = addresses, job_id, n
        self._num_channels = num_channels
        self.join_s: list[float] = []
        self.heartbeat_s: list[float] = []
        self.failures: Counter[str] = Counter()  # "call:CODE" -> count
        self.expired: set[str] = set()  # members told NOT_FOUND (fenced)
        self.planned: dict[str, tuple[int, int]] = {}  # member -> (generation, members planned)
        self.first_join_at = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fleet")
        self._tasks: list[asyncio.Future] = []

    def start(self) -> SimFleet:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    async def _start(self) -> None:
        target = ("ipv4:" + ",".join(self.addresses)) if len(self.addresses) > 1 else self.addresses[0]
        options = [("grpc.enable_retries", 1), ("grpc.service_config", _service_config()),
                   ("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        self._channels = [grpc.aio.insecure_channel(target, options=options + [("sim.channel", i)])
                          for i in range(self._num_channels)]
        self.first_join_at = time.monotonic()
        for i in range(self.n):
            stub = ws_grpc.WorkerServiceStub(self._channels[i % len(self._channels)])
            self._tasks.append(asyncio.ensure_future(self._member(stub, i)))

    async def _member(self, stub: ws_grpc.WorkerServiceStub, i: int) -> None:
        started = time.monotonic()
        try:
            response = await stub.JoinJob(ws.JoinJobRequest(
                job_id=self.job_id, host="127.0.0.1", rendezvous_port=10000 + i % 50000,
                num_local_ranks=1, join_token=uuid.uuid4().hex), timeout=60)
        except grpc.RpcError as e:
            self.failures[f"JoinJob:{e.code().name}"] += 1
            return
        self.join_s.append(time.monotonic() - started)
        member_id = response.member.id
        interval = response.heartbeat_interval.ToTimedelta().total_seconds()
        await asyncio.gather(self._beat(stub, member_id, interval), self._watch(stub, member_id))

    async def _beat(self, stub: ws_grpc.WorkerServiceStub, member_id: str, interval: float) -> None:
        request = ws.HeartbeatRequest(job_id=self.job_id, member_id=member_id)
        while member_id not in self.expired:
            await asyncio.sleep(interval * random.uniform(0.8, 1.0))
            started = time.monotonic()
            try:
                await stub.Heartbeat(request, timeout=max(interval, 1.0))
                self.heartbeat_s.append(time.monotonic() - started)
            except grpc.RpcError as e:
                self.failures[f"Heartbeat:{e.code().name}"] += 1
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self.expired.add(member_id)

    async def _watch(self, stub: ws_grpc.WorkerServiceStub, member_id: str) -> None:
        request = ws.WatchPlansRequest(job_id=self.job_id, member_id=member_id)
        backoff = Backoff(base_s=0.1, cap_s=2.0)
        while member_id not in self.expired:
            try:
                async for response in stub.WatchPlans(request):
                    plan = response.plan
                    self.planned[member_id] = (plan.generation, len(plan.members) + len(plan.spares))
                    backoff.reset()
            except grpc.RpcError as e:
                self.failures[f"WatchPlans:{e.code().name}"] += 1
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self.expired.add(member_id)
                    return
            await asyncio.sleep(backoff.next_s())  # jittered, as the agent does

    def num_holding(self, num_members: int) -> int:
        """Members whose newest plan is one generation that places `num_members`."""
        views = list(self.planned.values())
        if not views:
            return 0
        newest = max(g for g, _ in views)
        return sum(1 for g, k in views if g == newest and k == num_members)

    def close(self) -> None:
        async def stop() -> None:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for channel in self._channels:
                await channel.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
