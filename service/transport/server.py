"""Building, starting and stopping one coordinator replica.

A replica binds its gRPC port (port 0 picks a free one; `address` tells which),
serves the Springback services plus gRPC health checking and reflection,
campaigns for leadership, and, while leader, runs the reconcile loop. The
server is `grpc.aio` on a loop thread of its own: unary handlers run on a
thread pool, plan and health streams on the loop (no thread each), and every
replica serves heartbeats and plan streams itself (plans from its etcd watch,
`planboard`); other calls are forwarded to the leader.

`stop` (SIGTERM, SIGINT) drains before it stops: health turns NOT_SERVING at
once (load balancers and Springback's client channels stop choosing this
replica), leadership is resigned at once (a successor takes over within one
campaign interval, well inside the leader TTL), and the replica keeps
serving as a follower, forwarding calls to the successor, for ``drain_s``;
only then does the server stop, giving in-flight calls ``grace_s``. A write
acknowledged before or during the drain is in etcd; a write caught by the
resignation fails its fencing compare and is not acknowledged.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
from concurrent import futures
from collections.abc import Callable
from typing import Any
from http.server import ThreadingHTTPServer

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from springback.client import metrics
from springback.client.channel import MAX_MESSAGE_BYTES, read_file
from springback.client.polling import wait_until
from springback.service.core.coordinator import Coordinator
from springback.service.transport.dashboard import Dashboard
from springback.service.etcd.election import Election
from springback.service.core.evidence import PeerLossEvidence
from springback.service.transport.health import Health
from springback.service.transport.heartbeats import Heartbeats, LeaseRenewer
from springback.service.policy.pacing import HeartbeatPacer
from springback.service.transport.jobmetrics import JobMetrics
from springback.service.transport import credentials
from springback.service.transport.config import CoordinatorConfig
from springback.service.transport.auth import BearerAuth
from springback.service.transport.interceptors import CallCounter, LeaderForwarding
from springback.service.etcd.liveness import EtcdReachability
from springback.service.transport.planboard import PlanBoard
from springback.service.transport.planstreams import PlanStreams
from springback.service.core.reconcile import Reconciler
from springback.service.transport.revocation import Revocation
from springback.service.transport.servicers import JobServicer, WorkerServicer
from springback.service.etcd.store import Store
from springback.service.transport.streamnotes import StreamNotes
from springback.v1 import job_service_pb2, job_service_pb2_grpc, worker_service_pb2
from springback.v1 import worker_service_pb2_grpc

log = logging.getLogger(__name__)


class _Handlers:
    """Collects what a generated ``add_*Servicer_to_server`` registers."""

    def __init__(self) -> None:
        self.service = ""
        self.methods: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same methods arrive through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, methods: dict) -> None:
        self.service, self.methods = service, dict(methods)


class _Malformed:
    """A request whose bytes did not parse (stands in for the message)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # noqa: BLE001 (answered INVALID_ARGUMENT below)
            return _Malformed(e)

    return parse


def _refusing_malformed(handler: Any) -> Any:
    """`handler` whose malformed requests get INVALID_ARGUMENT (grpc.aio's own
    answer to a deserialiser's error is UNKNOWN) and change nothing."""
    def details(request: _Malformed) -> str:
        return f"malformed request: {type(request.error).__name__}: {request.error}"

    if handler.unary_unary is not None:
        behaviour = handler.unary_unary

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, details(request))
            return behaviour(request, context)

        async def unary_async(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, details(request))
            return await behaviour(request, context)

        wrapped = unary_async if inspect.iscoroutinefunction(behaviour) else unary
        return handler._replace(unary_unary=wrapped,
                                request_deserializer=_tolerant(handler.request_deserializer))
    stream = handler.unary_stream
    if not inspect.isasyncgenfunction(stream):
        return handler  # sync streams (WatchJob): its request has no required field

    async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, details(request))
        async for response in stream(request, context):
            yield response

    return handler._replace(unary_stream=unary_stream,
                            request_deserializer=_tolerant(handler.request_deserializer))


def _service_handler(add: Callable[[Any, Any], None], servicer: Any,
                     raw: dict[str, Any] | None = None) -> grpc.GenericRpcHandler:
    """The generated handlers of `servicer` (`add` is its ``add_*_to_server``),
    with `raw` methods replaced, malformed requests refused."""
    handlers = _Handlers()
    add(servicer, handlers)
    handlers.methods.update(raw or {})
    return grpc.method_handlers_generic_handler(
        handlers.service, {name: _refusing_malformed(h) for name, h in handlers.methods.items()})


def _worker_service_handler(servicer: WorkerServicer) -> grpc.GenericRpcHandler:
    """WorkerService's handlers, WatchPlans without a response serializer: its
    responses are bytes the plan board encoded once per plan (`planboard`)."""
    watch_plans = grpc.unary_stream_rpc_method_handler(
        servicer.WatchPlans, request_deserializer=worker_service_pb2.WatchPlansRequest.FromString)
    return _service_handler(worker_service_pb2_grpc.add_WorkerServiceServicer_to_server,
                            servicer, {"WatchPlans": watch_plans})


BLOCKING_THREADS = 64
"""Threads of the loop's default executor, where handlers on the loop run
their blocking etcd calls (`asyncio.to_thread`: joins, plan streams' and
heartbeats' registration reads, WatchJob's first read). They wait on etcd
rather than compute: the default (CPUs + 4) made a join storm queue there."""


class _Loop:
    """The asyncio loop the gRPC server runs on, on a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(futures.ThreadPoolExecutor(
            max_workers=BLOCKING_THREADS, thread_name_prefix="blocking"))
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self._thread.start()

    def run(self, coroutine: Any, timeout_s: float | None = None) -> Any:
        """Runs `coroutine` on the loop and waits for its result (up to `timeout_s`)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        """Ends what still runs on the loop as `asyncio.run` would (its tasks
        cancelled and awaited, its async generators closed), then stops and
        closes it. A task left pending on a closed loop (a lease stream's
        request generator waiting in `Queue.get`) is finalized by a later
        garbage collection, anywhere: its `call_soon` on the closed loop
        raises, and inside `compile` CPython 3.11 turns that into a
        SystemError ("AST constructor recursion depth mismatch"; it failed
        pytest's session end)."""
        async def finish() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
            await self.loop.shutdown_asyncgens()

        try:
            self.run(finish(), timeout_s=10)
        except (TimeoutError, asyncio.TimeoutError, RuntimeError) as e:
            log.warning("the server's loop did not finish its tasks: %r", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


class CoordinatorServer:
    """One replica: a `grpc.aio` server on a loop thread of its own. Unary calls
    run on ``max_workers`` threads; plan and health streams run on the loop and
    cost no thread (WatchJob, an operator's stream, holds one)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.store = Store(config.etcd, timeout_s=5.0, security=config.etcd_security)
        # The advertised address is known once the port is bound (below).
        self.election = Election(self.store, "", ttl_s=config.leader_ttl_s,
                                 on_elected=self._on_leadership, on_lost=self._on_leadership)
        self.counter = CallCounter(
            f"/{service.full_name}/{method.name}"
            for module, name in ((job_service_pb2, "JobService"),
                                 (worker_service_pb2, "WorkerService"), (health_pb2, "Health"))
            for service in (module.DESCRIPTOR.services_by_name[name],)
            for method in service.methods)
        # WatchJob streams (operators') read the leader's watch on these threads.
        self._stream_pool = futures.ThreadPoolExecutor(max_workers=config.max_workers,
                                                       thread_name_prefix="stream")
        self._forwarding = LeaderForwarding(self.election, self._stream_pool)
        # Authentication first: a call refused UNAUTHENTICATED is not counted.
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if config.token or config.tls_roles:
            tls_roles = (credentials.parse_tls_roles((read_file(config.tls_roles) or b"").decode(),
                                                     config.tls_roles)
                         if config.tls_roles else None)
            auth = BearerAuth(config.token, config.viewer_token, tls_roles)
            interceptors.append(auth)
        else:
            auth = None
        interceptors += [self.counter, self._forwarding]
        self._loop = _Loop()
        self._server = self._loop.run(self._make_server(interceptors))
        port = self._bind()
        host = config.listen.rpartition(":")[0]
        self.address = config.advertise or f"{host}:{port}"
        self.election.address = self.address
        self.coordinator = Coordinator(
            self.store, self.election, liveness_timeout_s=config.liveness_timeout_s,
            progress_flush_s=config.progress_flush_s,
        )
        self.reconciler = Reconciler(self.coordinator)
        self.board = PlanBoard(self.store, self._loop.loop)
        self.liveness = EtcdReachability(config.etcd, on_change=lambda _: self._update_health(),
                                          security=config.etcd_security)
        if auth is not None:
            auth.revocation = Revocation(self.coordinator, self.liveness.store)
        self.plan_streams = PlanStreams(self.store, self.board, self.liveness)
        self.renewer = LeaseRenewer(config.etcd, security=config.etcd_security)
        heartbeats = Heartbeats(self.coordinator, self.board, self.renewer, self.liveness,
                                HeartbeatPacer(config.liveness_timeout_s,
                                               config.heartbeat_budget_per_s))
        self.stream_notes = StreamNotes(
            self.election, PeerLossEvidence(self.coordinator), token=config.token,
            window_s=lambda: self.coordinator.liveness_timeout_s)
        self._server.add_generic_rpc_handlers([
            _service_handler(job_service_pb2_grpc.add_JobServiceServicer_to_server,
                             JobServicer(self.coordinator, self._stream_pool, issue_join=(
                                 functools.partial(credentials.issue_join, config.token)
                                 if config.token else None))),
            _worker_service_handler(
                WorkerServicer(self.coordinator, self.liveness, self.plan_streams, heartbeats,
                               self.stream_notes, issue_credential=(
                                   functools.partial(credentials.issue, config.token)
                                   if config.token else None))),
        ])
        self._draining = False
        self._stopped = False
        self.health = Health()
        self.health.bind(self._loop.loop)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection((
            job_service_pb2.DESCRIPTOR.services_by_name["JobService"].full_name,
            worker_service_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ), self._server)
        self.registry = self._metrics()
        self._metrics_server: ThreadingHTTPServer | None = None
        self.dashboard = Dashboard(self.coordinator)

    async def _make_server(self, interceptors: list[grpc.aio.ServerInterceptor]) -> grpc.aio.Server:
        keepalive_ms = int(self.config.client_keepalive_s * 1000)
        return grpc.aio.server(
            migration_thread_pool=futures.ThreadPoolExecutor(
                max_workers=self.config.max_workers, thread_name_prefix="rpc"),
            interceptors=interceptors,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                # clients ping every 10 s (channel.py), also while idle: allow
                # it, or the server answers GOAWAY too_many_pings and drops them
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
                # the server's own pings find clients that vanished without a
                # FIN (config.client_keepalive_s); unlimited, since a silent
                # WatchPlans stream sends no data between generations
                ("grpc.keepalive_time_ms", keepalive_ms),
                ("grpc.keepalive_timeout_ms", keepalive_ms),
                ("grpc.http2.ping_timeout_ms", keepalive_ms),  # else 60 s (gRPC >= 1.6x)
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.http2.min_time_between_pings_ms", keepalive_ms),
                # no max connection age: an agent's channel already spreads
                # over every replica (round robin), and a forced reconnect
                # would cut its plan stream for nothing (docs/scale.md)
            ],
        )

    def _bind(self) -> int:
        config = self.config
        if config.tls_cert:
            credentials = grpc.ssl_server_credentials(
                [(read_file(config.tls_key), read_file(config.tls_cert))],
                root_certificates=read_file(config.tls_client_ca),
                require_client_auth=bool(config.tls_client_ca),
            )
            port = self._server.add_secure_port(config.listen, credentials)
        else:
            port = self._server.add_insecure_port(config.listen)
        if port == 0:
            raise OSError(f"listen: cannot bind {config.listen}")
        return port

    def _on_leadership(self) -> None:
        self.coordinator.leadership_changed()

    def _update_health(self) -> None:
        """SERVING unless draining or cut off from etcd (clients' channels skip
        a NOT_SERVING replica, see `channel`); plan streams re-check too."""
        self.board.wake_all()
        serving = self.liveness.reachable and not self._draining
        self.health.set("", health_pb2.HealthCheckResponse.SERVING if serving
                        else health_pb2.HealthCheckResponse.NOT_SERVING)

    def _metrics(self) -> metrics.Registry:
        registry = metrics.Registry()
        c = self.coordinator
        registry.add("springback_coordinator_is_leader", "gauge", "1 on the leader replica",
                     lambda: float(self.election.is_leader()))
        registry.add("springback_coordinator_generations_total", "counter",
                     "generations made by this replica", lambda: c.num_generations)
        registry.add("springback_coordinator_replan_seconds", "gauge",
                     "duration of the last planning step (planner only)", lambda: c.last_replan_s)
        registry.add("springback_coordinator_loop_errors_total", "counter",
                     "failed reconcile iterations", lambda: self.reconciler.num_loop_errors)
        registry.add("springback_coordinator_etcd_reachable", "gauge",
                     "1 while this replica reaches etcd (it serves liveness only then)",
                     lambda: float(self.liveness.reachable))
        registry.add("springback_coordinator_stream_notes_dropped_total", "counter",
                     "plan-stream notes this follower could not relay to the leader in time",
                     lambda: self.stream_notes.num_dropped)
        registry.add("springback_coordinator_rpc_total", "counter", "calls received, by method",
                     lambda: [({"method": m}, n) for m, n in self.counter.calls.items()])
        registry.add_collector(JobMetrics(c))
        return registry

    def start(self) -> None:
        self._loop.run(self._server.start())
        self.board.start()
        self.election.start()
        self.reconciler.start()
        self.liveness.start()
        self._update_health()
        if self.config.metrics_listen:
            self._metrics_server = metrics.serve(self.registry, self.config.metrics_listen,
                                                 pages=self.dashboard.pages(), token=self.config.token,
                                                 viewer_token=self.config.viewer_token,
                                                 tls_cert=self.config.metrics_tls_cert,
                                                 tls_key=self.config.metrics_tls_key)
            self.dashboard.start()
        log.info("coordinator replica serving on %s", self.address)

    @property
    def metrics_address(self) -> str | None:
        """``HOST:PORT`` of the metrics (and dashboard) HTTP listener, once started."""
        if self._metrics_server is None:
            return None
        host, port = self._metrics_server.server_address[:2]
        return f"{host!s}:{port}"

    def wait_for_leadership(self, timeout_s: float) -> bool:
        """Blocks until this replica leads (True) or `timeout_s` passes (False)."""
        return wait_until(self.election.is_leader, timeout_s=timeout_s) is not None

    def wait(self) -> None:
        self._loop.run(self._server.wait_for_termination())

    def stop(self, grace_s: float = 2.0) -> None:
        """Drains (see the module docstring), then stops serving. Blocks about
        ``drain_s + grace_s`` at most; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._draining = True
        self._update_health()
        self.election.resign()  # first: a successor's campaign waits on nothing else here
        self.reconciler.stop()  # a pass under way fails its fencing compares
        self.coordinator.leadership_changed()  # wakes the watchers: they end
        if self.config.drain_s:
            log.info("draining for %.1f s before stopping", self.config.drain_s)
            time.sleep(self.config.drain_s)  # the drain interval itself, not a synchronisation
        self.health.enter_graceful_shutdown()
        self._loop.run(self._server.stop(grace_s), grace_s + 5)
        self._loop.run(self.renewer.close(), 5)
        self._stream_pool.shutdown(wait=False, cancel_futures=True)
        if self._metrics_server is not None:
            self.dashboard.stop()
            self._metrics_server.shutdown()
        self._forwarding.close()
        self.stream_notes.close()
        self.board.close()
        self.liveness.close()
        self.health.close()
        self._loop.close()
        self.store.close()
