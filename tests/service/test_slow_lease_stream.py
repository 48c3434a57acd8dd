"""A replica whose lease renewals come back late is slow, not cut off.

On a saturated machine (a join storm of thousands of agents beside busy
loops) etcd still answers but late, and the replica's asyncio loop lags: a
renewal then misses its 0.5 s deadline though etcd is reachable. A replica
that took that as a cut from etcd refused every liveness call, ended every
plan stream and dropped its lease stream on each such stall (both replicas
of the 2,000-agent storm flapped 35 times a minute and members expired). Here
the lease stream reaches a real etcd through a `NetProxy` that delays each
segment 0.6 s, the probe reaches it directly: the heartbeats fail (their
renewal is late) but the replica stays reachable, and the renewals still land,
so the member outlives two liveness timeouts.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from agentsim import join
from netproxy import NetProxy
from springback.client.errors import StoreUnavailable
from springback.service.etcd import keys
from springback.service.etcd.liveness import EtcdReachability
from springback.service.transport.heartbeats import Heartbeats, LeaseRenewer
from springback.v1 import worker_service_pb2_grpc as ws_grpc
from springback.client.api import Client

pytestmark = pytest.mark.timeout(60)

LIVENESS_S = 2.0  # the fixture's
BEATS_FOR_S = 2.5 * LIVENESS_S


def test_late_renewals_fail_heartbeats_but_leave_the_replica_serving_and_the_member_alive(
        etcd, coordinator, make_spec):
    liveness = EtcdReachability(etcd.endpoint, security=etcd.client_security)
    liveness.start()
    try:
        with NetProxy(etcd.endpoint) as link, Client(coordinator.address) as client, \
                grpc.insecure_channel(coordinator.address) as channel:
            heartbeats = Heartbeats(coordinator.coordinator, coordinator.board,
                                    LeaseRenewer(link.url, security=etcd.client_security),
                                    liveness)
            link.delay(0.6)  # each way: every renewal is answered ~1.2 s after it was sent
            job = client.create_job(make_spec(max_workers=1))
            member = join(ws_grpc.WorkerServiceStub(channel), job.id, 9700)
            reachable, failed = asyncio.run(_beat(heartbeats, liveness, job.id, member))
    finally:
        liveness.close()
    assert failed > 0  # the renewals were late: these heartbeats failed ...
    assert all(reachable), reachable  # ... and the replica never called itself cut off
    assert coordinator.store.get(keys.member(job.id, member)) is not None  # renewed all along


async def _beat(heartbeats: Heartbeats, liveness: EtcdReachability, job_id: str,
                member: str) -> tuple[list[bool], int]:
    """Heartbeats every 0.3 s for `BEATS_FOR_S`: whether the replica was
    reachable after each, and how many failed."""
    reachable, failed = [], 0
    end = time.monotonic() + BEATS_FOR_S
    while time.monotonic() < end:
        try:
            await heartbeats.beat(job_id, member)
        except StoreUnavailable:
            failed += 1
        reachable.append(liveness.reachable)
        await asyncio.sleep(0.3)  # the agent's cadence, not a synchronisation
    return reachable, failed
