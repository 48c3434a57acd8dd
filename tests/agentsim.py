"""Members driven the way `springback run` drives them, without ranks.

`SimMember` joins with a join token over a `springback.client.channel`
channel (the agent's: round-robin, health-checked, retrying idempotent calls)
and heartbeats on its own thread with the agent's cadence and deadline (at
the interval the coordinator names last, deadline at least 1 s), counting
every outcome, so fault tests can assert how liveness fared. `SimFleet` drives thousands of members
of one or many jobs from one process at little CPU each, for scale tests and
`bench/agent_scale.py`. Real gRPC, real coordinator, real etcd.
"""

from __future__ import annotations

import asyncio
import heapq
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc

from sbtest import CoordinatorProcess, wait_for
from springback.client.channel import LOCAL_READ, Backoff, _service_config, connect
from springback.service.etcd import keys
from springback.service.etcd.store import Store
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc
from springback.worker.agent.startup import RETRIED_JOIN_CODES


def leader_of(store: Store) -> str | None:
    """The address of the replica set's leader, from etcd; None while none is elected."""
    entry = store.get(keys.LEADER)
    return entry.value.decode() if entry else None


def start_replicas(spawn: Callable[..., CoordinatorProcess], store: Store, *extra: str,
                   num_replicas: int = 2) -> list[CoordinatorProcess]:
    """`num_replicas` coordinators from `spawn(*extra)`, once one of them
    leads (AssertionError after 30 s without a leader)."""
    replicas = [spawn(*extra) for _ in range(num_replicas)]
    wait_for(lambda: leader_of(store), 30, "a leader")
    return replicas


def kill_leader(replicas: list[CoordinatorProcess], store: Store, timeout_s: float = 60.0) -> str:
    """SIGKILLs the replica that leads now and waits for another to lead:
    the killed one's address. AssertionError when no new leader is elected
    within `timeout_s`."""
    leader = wait_for(lambda: leader_of(store), timeout_s, "a leader")
    next(r for r in replicas if r.address == leader).kill()
    wait_for(lambda: leader_of(store) not in (None, leader), timeout_s, "a new leader")
    return leader


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
                response = self.stub.Heartbeat(request, timeout=max(self.interval_s, 1.0))
                self.num_ok += 1
                if response.HasField("heartbeat_interval"):  # the newest interval told wins
                    self.interval_s = response.heartbeat_interval.ToTimedelta().total_seconds()
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


def members_placed(plan: pb.Plan) -> int:
    """How many members `plan` places: its active nodes plus its spares.

    WatchPlans sends each member its own slice of a plan: `members` or
    `spares` hold only the member itself; `nodes` (runs of equal-size nodes)
    and `num_spares` count the whole plan."""
    return sum(r.num_nodes for r in plan.nodes) + plan.num_spares


def _interval_in(response: bytes) -> float | None:
    """The `heartbeat_interval` of a serialized HeartbeatResponse, if set.

    Most responses hold only the generation (field 1, a varint): those are
    recognised without parsing; anything more is parsed."""
    i, end = 0, len(response)
    if end and response[0] == 0x08:
        i = 1
        while i < end and response[i] & 0x80:
            i += 1
        i += 1
    if i >= end:
        return None
    response_pb = ws.HeartbeatResponse.FromString(response)
    if not response_pb.HasField("heartbeat_interval"):
        return None
    d = response_pb.heartbeat_interval
    return d.seconds + d.nanos / 1e9 or None


_METHOD = "/springback.v1.WorkerService/"
_RAW = {"request_serializer": None, "response_deserializer": None}  # bytes in, bytes out
JOIN_DEADLINE_S = 300.0  # a member gives up joining after this
TICK_S = 0.02  # the scheduler's longest sleep: heartbeats go out at most this late


class SimFleet:
    """Members of one or more jobs driven on one asyncio loop (a thread of
    its own) over a few shared `grpc.aio` channels, or (``agent_channels``)
    as a cluster's agents connect: one channel and TCP connection per agent,
    the start-up GetJob (``LOCAL_READ``) and JoinJob with the job's join
    credential, then heartbeats and WatchPlans on a channel of their own with
    the member credential JoinJob returned (the join channel closed), as
    `springback run` does. In both modes members drive their calls the way
    agents drive them:
    JoinJob with a token (all at once, or `join_rate_per_s` a second; retried with the same token on the agent's
    `RETRIED_JOIN_CODES` for `JOIN_DEADLINE_S`), a WatchPlans stream (reconnected with jittered
    backoff on any error) and heartbeats at the interval the coordinator
    names (JoinJobResponse's, then the newest HeartbeatResponse's that sets
    one), jittered to 0.8-1.0 of it, deadline at least 1 s.

    Built to cost the client as little CPU per agent as possible, so that
    thousands of agents share one process and a bench measures the
    coordinator, not the simulator: requests are serialized once per member
    and sent as bytes over raw (bytes in, bytes out) calls; a heartbeat's
    response is parsed only when it holds more than the generation; one
    scheduler (a heap of due times, woken at least every `TICK_S`) starts the
    heartbeats, instead of a sleeping task per member. Plan messages are
    counted in bytes per member and per generation.

    A member told NOT_FOUND (expired, fenced) stops and is counted in
    `expired`. Counters are written on the loop thread and read from others
    (snapshots by `list(...)`, good enough for tests that poll)."""

    def __init__(self, addresses: list[str], job_id: str, n: int, *, num_channels: int = 4,
                 join_rate_per_s: float | None = None,
                 join_credential: str | None = None) -> None:
        """`join_credential` (``springback job join-credential``): members
        connect as agents do (``agent_channels``), one connection each, with
        it and then their member credentials; None: `num_channels` shared
        channels, no credentials (a coordinator without a token)."""
        self._init(addresses, {job_id: n}, num_channels)
        self._join_rate_per_s = join_rate_per_s
        self._join_credential = join_credential

    @classmethod
    def many(cls, addresses: list[str], jobs: dict[str, int], *, num_channels: int = 4) -> SimFleet:
        """One fleet driving `jobs[job_id]` members of each job."""
        fleet = cls.__new__(cls)
        fleet._init(addresses, jobs, num_channels)
        return fleet

    def _init(self, addresses: list[str], jobs: dict[str, int], num_channels: int) -> None:
        self.addresses, self.jobs = addresses, dict(jobs)
        self.job_id = next(iter(jobs))
        self.n = sum(jobs.values())
        self._num_channels = num_channels
        self._join_rate_per_s: float | None = None  # None: all join at once (a storm)
        self._join_credential: str | None = None  # set: one channel per agent, as agents do
        self.join_s: list[float] = []
        self.heartbeat_s: list[float] = []
        self.failures: Counter[str] = Counter()  # "call:CODE" -> count
        self.expired: set[str] = set()  # members told NOT_FOUND (fenced)
        self.planned: dict[str, tuple[int, int]] = {}  # member -> (generation, members placed)
        self.job_of: dict[str, str] = {}  # member -> job
        self.first_join_at = self.last_join_at = 0.0  # time.monotonic()
        self.num_joined = 0
        # per member, by index (the order of `jobs`, then of joins)
        self._job = [job for job, k in jobs.items() for _ in range(k)]
        self.member_ids: list[str] = [""] * self.n
        self.num_ok = [0] * self.n  # heartbeats answered OK
        self.plan_bytes = [0] * self.n
        self.plan_messages = [0] * self.n
        self.generation_bytes: Counter[tuple[str, int]] = Counter()  # (job, generation) -> bytes
        self.generation_receivers: Counter[tuple[str, int]] = Counter()
        self._interval = [1.0] * self.n
        self._heartbeat_request = [b""] * self.n
        self._member_metadata: list[tuple[tuple[str, str], ...] | None] = [None] * self.n
        self._member_channel: list[grpc.aio.Channel | None] = [None] * self.n
        self._member_calls: list[tuple[Any, Any] | None] = [None] * self.n  # Heartbeat, WatchPlans
        self._due: list[tuple[float, int]] = []  # heap of (loop time, member index)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fleet")
        self._cpu_at_start = 0.0

    def start(self) -> SimFleet:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    @property
    def agent_channels(self) -> bool:
        """Members connect as agents do: a channel each, with credentials."""
        return self._join_credential is not None

    def _channel(self, tag: int) -> grpc.aio.Channel:
        """A new channel to the replicas; with ``agent_channels`` on a TCP
        connection of its own (a local subchannel pool: channels of one
        process share connections otherwise)."""
        target = ("ipv4:" + ",".join(self.addresses)) if len(self.addresses) > 1 else self.addresses[0]
        options = [("grpc.enable_retries", 1), ("grpc.service_config", _service_config()),
                   ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   ("grpc.keepalive_time_ms", 10_000), ("sim.channel", tag)]
        if self.agent_channels:
            options.append(("grpc.use_local_subchannel_pool", 1))
        return grpc.aio.insecure_channel(target, options=options)

    async def _start(self) -> None:
        self._channels = [] if self.agent_channels else [
            self._channel(i) for i in range(self._num_channels)]
        self._join_calls = [c.unary_unary(_METHOD + "JoinJob", **_RAW) for c in self._channels]
        self._heartbeat_calls = [c.unary_unary(_METHOD + "Heartbeat", **_RAW)
                                 for c in self._channels]
        self._watch_calls = [c.unary_stream(_METHOD + "WatchPlans", **_RAW) for c in self._channels]
        self._cpu_at_start = time.process_time()
        self.first_join_at = time.monotonic()
        self._tasks = [asyncio.ensure_future(self._schedule())]
        self._tasks += [asyncio.ensure_future(self._member(i)) for i in range(self.n)]

    async def _member(self, i: int) -> None:
        if self._join_rate_per_s:
            await asyncio.sleep(i / self._join_rate_per_s)
        job_id = self._job[i]
        request = ws.JoinJobRequest(job_id=job_id, host="127.0.0.1", rendezvous_port=10000 + i % 50000,
                                    num_local_ranks=1, join_token=uuid.uuid4().hex)
        started = time.monotonic()
        if self.agent_channels:
            channel = self._channel(i)
            metadata = (("authorization", f"Bearer {self._join_credential}"),)
            join = channel.unary_unary(_METHOD + "JoinJob", **_RAW)
            if not await self._check_job(i, channel, metadata, started):
                await channel.close()
                return
        else:
            join, metadata = self._join_calls[i % self._num_channels], None
        raw = await self._join(join, request.SerializeToString(), metadata, started)
        if self.agent_channels:
            await channel.close()  # as the agent drops its join channel
        if raw is None:
            return
        self.last_join_at = time.monotonic()
        self.num_joined += 1
        self.join_s.append(self.last_join_at - started)
        response = ws.JoinJobResponse.FromString(raw)
        member_id = response.member.id
        if self.agent_channels:
            channel = self._member_channel[i] = self._channel(i)
            self._member_calls[i] = (channel.unary_unary(_METHOD + "Heartbeat", **_RAW),
                                     channel.unary_stream(_METHOD + "WatchPlans", **_RAW))
            self._member_metadata[i] = (("authorization", f"Bearer {response.member_credential}"),)
        self.member_ids[i] = member_id
        self.job_of[member_id] = job_id
        d = response.heartbeat_interval
        self._interval[i] = d.seconds + d.nanos / 1e9 or 1.0
        self._heartbeat_request[i] = ws.HeartbeatRequest(job_id=job_id,
                                                         member_id=member_id).SerializeToString()
        heapq.heappush(self._due, (self._loop.time() + self._interval[i] * random.uniform(0.8, 1.0), i))
        await self._watch(i, ws.WatchPlansRequest(job_id=job_id, member_id=member_id).SerializeToString())

    async def _check_job(self, i: int, channel: grpc.aio.Channel,
                         metadata: tuple[tuple[str, str], ...], started: float) -> bool:
        """The agent's start-up GetJob, answered by any replica (``LOCAL_READ``),
        retried as `startup.check_job` retries it; False once it gives up."""
        get_job = channel.unary_unary("/springback.v1.JobService/GetJob", **_RAW)
        request = js.GetJobRequest(job_id=self._job[i]).SerializeToString()
        answer = await self._retried("GetJob", get_job, request, metadata + (LOCAL_READ,),
                                     started, timeout_s=16, backoff=Backoff(base_s=0.25, cap_s=4.0))
        return answer is not None

    async def _join(self, call: grpc.aio.UnaryUnaryMultiCallable, request: bytes,
                    metadata: tuple[tuple[str, str], ...] | None, started: float) -> bytes | None:
        """JoinJob, retried as the agent does (the same token again, so a join
        lands once); None once it gives up."""
        return await self._retried("JoinJob", call, request, metadata, started, timeout_s=60,
                                   backoff=Backoff(base_s=0.5, cap_s=5.0))

    async def _retried(self, name: str, call: grpc.aio.UnaryUnaryMultiCallable, request: bytes,
                       metadata: tuple[tuple[str, str], ...] | None, started: float, *,
                       timeout_s: float, backoff: Backoff) -> bytes | None:
        """`call` until it answers, each failure counted under `name`; after a
        code outside the agent's `RETRIED_JOIN_CODES`, or `JOIN_DEADLINE_S`
        after `started`, None."""
        while True:
            try:
                return await call(request, timeout=timeout_s, metadata=metadata)
            except grpc.RpcError as e:
                self.failures[f"{name}:{e.code().name}"] += 1
                if (e.code() not in RETRIED_JOIN_CODES
                        or time.monotonic() - started > JOIN_DEADLINE_S):
                    return None
            await asyncio.sleep(backoff.next_s())

    def _member_call(self, i: int, stream: bool = False) -> Any:
        """Member `i`'s Heartbeat (WatchPlans with `stream`) call: on its own
        channel (``agent_channels``), else on a shared one."""
        own = self._member_calls[i]
        if own is not None:
            return own[1] if stream else own[0]
        return (self._watch_calls if stream else self._heartbeat_calls)[i % self._num_channels]

    async def _schedule(self) -> None:
        due, loop = self._due, self._loop
        while True:
            now = loop.time()
            while due and due[0][0] <= now:
                _, i = heapq.heappop(due)
                loop.create_task(self._heartbeat(i))
            await asyncio.sleep(min(TICK_S, due[0][0] - now) if due else TICK_S)

    async def _heartbeat(self, i: int) -> None:
        interval = self._interval[i]
        started = time.monotonic()
        try:
            response = await self._member_call(i)(
                self._heartbeat_request[i], timeout=max(interval, 1.0),
                metadata=self._member_metadata[i])
        except grpc.RpcError as e:
            self.failures[f"Heartbeat:{e.code().name}"] += 1
            if e.code() == grpc.StatusCode.NOT_FOUND:
                self.expired.add(self.member_ids[i])
                return
        else:
            self.heartbeat_s.append(time.monotonic() - started)
            self.num_ok[i] += 1
            told = _interval_in(response)
            if told is not None:
                self._interval[i] = interval = told
        heapq.heappush(self._due, (self._loop.time() + interval * random.uniform(0.8, 1.0), i))

    async def _watch(self, i: int, request: bytes) -> None:
        member_id, job_id = self.member_ids[i], self._job[i]
        backoff = Backoff(base_s=0.1, cap_s=2.0)
        while member_id not in self.expired:
            try:
                async for message in self._member_call(i, stream=True)(
                        request, metadata=self._member_metadata[i]):
                    plan = ws.WatchPlansResponse.FromString(message).plan
                    self.planned[member_id] = (plan.generation, members_placed(plan))
                    self.plan_bytes[i] += len(message)
                    self.plan_messages[i] += 1
                    self.generation_bytes[job_id, plan.generation] += len(message)
                    self.generation_receivers[job_id, plan.generation] += 1
                    backoff.reset()
            except grpc.RpcError as e:
                self.failures[f"WatchPlans:{e.code().name}"] += 1
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self.expired.add(member_id)
                    return
            await asyncio.sleep(backoff.next_s())  # jittered, as the agent does

    def num_holding(self, num_members: int, job_id: str | None = None) -> int:
        """Members (of `job_id`, else of the fleet's first job) whose newest
        plan is one generation, the job's newest seen, that places `num_members`."""
        job_id = job_id or self.job_id
        views = [v for m, v in list(self.planned.items()) if self.job_of.get(m) == job_id]
        if not views:
            return 0
        newest = max(g for g, _ in views)
        return sum(1 for g, k in views if g == newest and k == num_members)

    def settled_jobs(self) -> set[str]:
        """Jobs whose members all hold one plan (their newest) placing all of them."""
        views: dict[str, list[tuple[int, int]]] = {}
        for member_id, view in list(self.planned.items()):
            views.setdefault(self.job_of[member_id], []).append(view)
        return {job for job, vs in views.items()
                if len(vs) == self.jobs[job] and len(set(vs)) == 1 and vs[0][1] == self.jobs[job]}

    def cpu_s(self) -> float:
        """CPU seconds this process used since `start()` (all its threads:
        the loop and gRPC's own; the fleet's, where the process runs nothing else)."""
        return time.process_time() - self._cpu_at_start

    def bytes_per_generation(self) -> float:
        """Plan bytes one member received for one generation, on average."""
        receivers = sum(self.generation_receivers.values())
        return sum(self.generation_bytes.values()) / receivers if receivers else 0.0

    def close(self) -> None:
        async def stop() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for channel in self._channels + [c for c in self._member_channel if c is not None]:
                await channel.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
