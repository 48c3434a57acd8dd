"""The agent's two streams to the coordinator while it is a member: the
heartbeat (its etcd lease, renewed at the coordinator's cadence) and the plan
stream. NOT_FOUND from either means the member expired, UNAUTHENTICATED that
its member credential was revoked (the member was fenced, or the operator
token changed): ``fenced`` is set and the stream ends, and the agent joins
again; any other error is retried with jittered backoff (a
failover is no thundering herd) until the member is no longer `alive`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc

from springback.client.channel import Backoff
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as wpb

log = logging.getLogger("springback.agent")

FENCED_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED)
"""Answers to a member's own calls that mean it is no member any more."""


class MemberLink:
    """The streams of one member (`member_id`) of `job_id`."""

    def __init__(self, stub: Any, job_id: str, member_id: str, *, alive: Callable[[], bool],
                 fenced: threading.Event, stop: threading.Event) -> None:
        self._stub, self._job_id, self._member_id = stub, job_id, member_id
        self._alive, self._fenced, self._stop = alive, fenced, stop

    def _current(self) -> bool:
        return self._alive() and not self._fenced.is_set()

    def keep_alive(self, interval_s: float) -> None:
        """Heartbeats every `interval_s`, then at the interval each answer names
        (the coordinator paces its members), until the member ends or is fenced."""
        req = wpb.HeartbeatRequest(job_id=self._job_id, member_id=self._member_id)
        backoff = Backoff(base_s=0.1, cap_s=max(interval_s, 0.1))
        while self._current():
            wait_s = interval_s
            try:
                resp = self._stub.Heartbeat(req, timeout=max(interval_s, 1.0))
                backoff.reset()
                told = resp.heartbeat_interval.ToTimedelta().total_seconds()
                if told > 0:
                    interval_s = wait_s = told
            except grpc.RpcError as e:
                if e.code() in FENCED_CODES:
                    log.warning("member %s fenced: %s", self._member_id, e.details())
                    self._fenced.set()
                    return
                log.warning("heartbeat failed: %s", e.code().name)
                wait_s = backoff.next_s()  # sooner than the cadence, spread out
            self._stop.wait(wait_s)

    def follow_plans(self, on_plan: Callable[[pb.Plan], None]) -> None:
        """Hands every plan the stream sends to `on_plan`, reconnecting, until
        the member ends or is fenced."""
        req = wpb.WatchPlansRequest(job_id=self._job_id, member_id=self._member_id)
        backoff = Backoff(base_s=0.1, cap_s=2.0)
        while self._current():
            try:
                for resp in self._stub.WatchPlans(req, timeout=3600):
                    if not self._alive():
                        return
                    on_plan(resp.plan)
                    backoff.reset()
            except grpc.RpcError as e:
                if e.code() in FENCED_CODES:
                    self._fenced.set()
                    return
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    log.warning("plan stream broke: %s; reconnecting", e.code().name)
            self._stop.wait(backoff.next_s())  # jittered: a failover is no thundering herd
