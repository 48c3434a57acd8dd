"""The gRPC health service (``grpc.health.v1.Health``) of a coordinator replica.

Clients' channels watch it (client-side health checking, see `channel`), so a
replica has one open Watch stream per client channel: thousands with
thousands of agents. Watch runs on the server's asyncio loop (no thread per
stream): a status change is recorded under a lock and the watchers are woken
on the loop (`set` never blocks and never waits on a watcher; an earlier
design that sent while holding its lock could deadlock with a stream closing
at the same moment). `Check` answers from memory.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

Status = int  # health_pb2.HealthCheckResponse.ServingStatus


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[str, Status] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._final = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None  # touched on the loop only

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop that serves Watch (the server's); before the server starts."""
        self._loop = loop

    # -- the service ---------------------------------------------------------------

    def Check(self, request: health_pb2.HealthCheckRequest,
              context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        sent: Status | None = None
        while True:
            with self._lock:
                status = self._status.get(request.service,
                                          health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != sent:
                sent = status
                yield health_pb2.HealthCheckResponse(status=status)
                continue
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    def _wake(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    # -- the replica's side ------------------------------------------------------------

    def set(self, service: str, status: Status) -> None:
        """Records `status` and wakes the watchers; never blocks; thread-safe.
        Ignored after `enter_graceful_shutdown`."""
        with self._lock:
            if self._final or self._status.get(service) == status:
                return
            self._status[service] = status
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake)

    def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for every service, for good (later `set`s are ignored)."""
        for service in list(self._status):
            self.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        with self._lock:
            self._final = True

    def close(self) -> None:
        """Nothing to stop (kept for the server's shutdown sequence)."""
