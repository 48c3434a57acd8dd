"""The gRPC health service (``grpc.health.v1.Health``) of a coordinator replica.

Clients' channels watch it (client-side health checking, see `channel`), so a
replica has one open Watch stream per client channel. grpcio's own
`HealthServicer` sends status changes to those streams while holding its lock,
and a stream that ends meanwhile needs that lock in its close callback: the
two wait on each other, and `set` never returns (seen as a coordinator whose
``stop`` hung when a client closed its channel at the same moment). Here a
status change only records the status and queues the notification; one
notifier thread sends it to the watchers, outside any lock, so `set` never
blocks and a stream that ends (or stalls) delays nobody but the notifier.

Watch streams are non-blocking (no server thread each). `Check` answers from
memory.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

Status = int  # health_pb2.HealthCheckResponse.ServingStatus
_SendResponse = Callable[[Any], None]


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[str, Status] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._watchers: dict[str, set[_SendResponse]] = {}
        self._final = False
        self._outbox: queue.SimpleQueue[tuple[list[_SendResponse], Status] | None] = (
            queue.SimpleQueue())
        self._notifier = threading.Thread(target=self._notify, name="health-notify", daemon=True)
        self._notifier.start()

    # -- the service ---------------------------------------------------------------

    def Check(self, request: health_pb2.HealthCheckRequest,
              context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext,
              send_response_callback: _SendResponse | None = None) -> None:
        assert send_response_callback is not None, "Watch is registered as non-blocking"
        service = request.service
        with self._lock:
            status = self._status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            self._watchers.setdefault(service, set()).add(send_response_callback)

        def forget() -> None:
            with self._lock:
                self._watchers.get(service, set()).discard(send_response_callback)

        context.add_callback(forget)
        send_response_callback(health_pb2.HealthCheckResponse(status=status))

    Watch.experimental_non_blocking = True  # type: ignore[attr-defined]
    Watch.experimental_thread_pool = None  # type: ignore[attr-defined]

    # -- the replica's side ------------------------------------------------------------

    def set(self, service: str, status: Status) -> None:
        """Records `status` and queues it for the watchers; never blocks.
        Ignored after `enter_graceful_shutdown`."""
        with self._lock:
            if self._final or self._status.get(service) == status:
                return
            self._status[service] = status
            watchers = list(self._watchers.get(service, ()))
        self._outbox.put((watchers, status))

    def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for every service, for good (later `set`s are ignored)."""
        for service in list(self._status):
            self.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        with self._lock:
            self._final = True

    def close(self) -> None:
        """Stops the notifier (after what is queued)."""
        self._outbox.put(None)
        self._notifier.join(timeout=5)

    def _notify(self) -> None:
        while (item := self._outbox.get()) is not None:
            watchers, status = item
            for send in watchers:
                try:
                    send(health_pb2.HealthCheckResponse(status=status))
                except Exception as e:  # noqa: BLE001 (a watcher gone meanwhile)
                    log.debug("health watcher not notified: %s", e)
