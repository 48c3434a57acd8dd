"""Coordinator at scale: replanning with 10,000 members, and etcd writes per event.

Starts a real etcd and a real coordinator on loopback, registers N simulated
members (their records written straight to etcd under one shared lease, as
JoinJob would, to keep setup fast), then measures:

* the pure planner on N members (make_plan),
* a full replan after a member failure (read members, plan, one etcd txn),
  against the baseline of just reading the N member records from etcd,
* etcd revisions consumed by K heartbeats and K step reports (target 0: they
  are lease renewals and in-memory progress) versus K joins (one key + one
  plan write each).

Usage: python bench/coordinator_scale.py [--members 10000] [--reports 200]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import grpc

from _local_coordinator import local_coordinator
from springback.service.etcd import keys
from springback.service.policy.planner import Progress, make_plan
from springback.service.transport.server import CoordinatorServer
from springback.client.spec import spec_from_dict
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc


def revision(server: CoordinatorServer) -> int:
    return server.store._client.status().raft_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=10_000)
    parser.add_argument("--reports", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as state, \
            local_coordinator(state, progress_flush_s=3600) as server:
        run(server, args)


def run(server: CoordinatorServer, args: argparse.Namespace) -> None:
    coordinator = server.coordinator
    spec = spec_from_dict({"name": "scale", "min_workers": 1, "max_workers": args.members + 10,
                           "data": {"num_samples": 10**9, "global_batch_size": 4096},
                           "max_steps": 10**9})
    from springback.service.core.jobs import JobControl

    job = JobControl(coordinator).create(spec)
    store = server.store
    lease = store.grant_lease(3600)
    members = []
    for i in range(args.members):
        m = pb.Member(id=f"m{i:05d}", job_id=job.id, host=f"10.0.{i // 250}.{i % 250}",
                      rendezvous_port=29500, num_local_ranks=1)
        store.put(keys.member(job.id, m.id), m, lease=lease)
        members.append(m)
    coordinator.change(job.id, "bench: initial plan", kind=js.CHANGE_KIND_START)
    # Measure one replan at a time: the reconcile loop would notice each
    # deletion below too and replan concurrently (on 2 cores, sharing the GIL).
    server.reconciler.stop()

    # Pure planner.
    previous = coordinator.current_plan(job.id)
    survivors = members[1:]
    planner_s = []
    current = coordinator.get_job(job.id)
    for _ in range(args.repeats):
        t = time.perf_counter()
        make_plan(current, survivors, previous, progress=Progress(), newest_checkpoint=None)
        planner_s.append(time.perf_counter() - t)

    # Full replans after a failure versus reading the members.
    replan_s, read_s = [], []
    for r in range(args.repeats):
        t = time.perf_counter()
        store.get_prefix(keys.members(job.id))
        read_s.append(time.perf_counter() - t)
        victim = members[r]
        store.delete(keys.member(job.id, victim.id))
        t = time.perf_counter()
        coordinator.change(job.id, f"bench: lost {victim.id}", kind=js.CHANGE_KIND_NODE_LOST)
        replan_s.append(time.perf_counter() - t)
    plan = coordinator.current_plan(job.id)
    assert plan.world_size == args.members - args.repeats, plan.world_size

    # etcd writes per event.
    channel = grpc.insecure_channel(server.address)
    workers = ws_grpc.WorkerServiceStub(channel)
    joined = workers.JoinJob(ws.JoinJobRequest(job_id=job.id, host="127.0.0.1", rendezvous_port=1,
                                               num_local_ranks=1), timeout=30).member
    generation = coordinator.current_generation(job.id)
    before = revision(server)
    for i in range(args.reports):
        workers.Heartbeat(ws.HeartbeatRequest(job_id=job.id, member_id=joined.id), timeout=10)
    after_heartbeats = revision(server)
    head = coordinator.current_plan(job.id).members[0].member_id
    for i in range(args.reports):
        workers.ReportStep(ws.ReportStepRequest(job_id=job.id, member_id=head, generation=generation,
                                                step=i + 1, samples_consumed=(i + 1) * 4096), timeout=10)
    after_steps = revision(server)
    num_joins = 5
    for _ in range(num_joins):
        workers.JoinJob(ws.JoinJobRequest(job_id=job.id, host="127.0.0.1", rendezvous_port=1,
                                          num_local_ranks=1), timeout=30)
    after_joins = revision(server)
    channel.close()

    med = statistics.median
    print(f"members                       {args.members}")
    print(f"planner only (median)         {med(planner_s) * 1e3:8.1f} ms")
    print(f"replan after a failure        {med(replan_s) * 1e3:8.1f} ms   (target < 100 ms)")
    print(f"baseline: read member records {med(read_s) * 1e3:8.1f} ms")
    print(f"ratio replan / read           {med(replan_s) / med(read_s):8.2f}x")
    print(f"etcd raft entries per heartbeat   {(after_heartbeats - before) / args.reports:.3f}"
          "   (lease renewals are not raft writes)")
    print(f"etcd raft entries per step report {(after_steps - after_heartbeats) / args.reports:.3f}")
    print(f"etcd raft entries per join        {(after_joins - after_steps) / num_joins:.1f}")


if __name__ == "__main__":
    main()
