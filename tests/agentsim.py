"""Members driven the way `springback run` drives them, without ranks.

`SimMember` joins with a join token over a `springback.client.channel`
channel (the agent's: round-robin, health-checked, retrying idempotent calls)
and heartbeats on its own thread with the agent's cadence and deadline
(every liveness/4, deadline at least 1 s), counting every outcome, so fault
tests can assert how liveness fared. Real gRPC, real coordinator, real etcd.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter

import grpc

from springback.client.channel import connect
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

    def commit(self, generation: int, step: int) -> ws.CommitCheckpointResponse:
        return self.stub.CommitCheckpoint(ws.CommitCheckpointRequest(
            job_id=self.job_id, member_id=self.id, generation=generation,
            checkpoint=pb.CheckpointRef(step=step, uri=f"file:///tmp/{self.job_id}/step-{step}")),
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
