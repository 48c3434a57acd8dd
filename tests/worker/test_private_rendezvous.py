"""A job's rendezvous is private (issue 44): a party that reaches a node's
store but holds no plan finds none of a running generation's keys under
their old predictable names, and what it writes there does not disturb the
job. Real etcd, coordinator, agent and gloo ranks."""

from __future__ import annotations

import datetime
import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import otherhost
import pytest
import torch.distributed as dist

from cluster import FAST_FORWARD, AgentProcess, steps
from sbtest import wait_for
from springback.client import plans
from springback.service.transport.jobmetrics import JobMetrics
from springback.v1 import types_pb2 as pb
from springback.worker.agent.startup import listen_on, self_address
from springback.worker.agent.storegate import StoreForwarder, store_proof
from springback.worker.rank import rendezvous

INTRUDER = str(Path(__file__).with_name("store_intruder.py"))
GATE_INTRUDER = str(Path(__file__).with_name("gate_intruder.py"))
TORCHRUN_EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "torchrun_ddp"
                       / "train.py")
MAX_STEPS = 40
SPEC = {"name": "private", "min_workers": 1, "max_workers": 1,
        "data": {"num_samples": 256, "global_batch_size": 8, "seed": 1},
        "max_steps": MAX_STEPS}

ENDED = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.skipif(not otherhost.available(), reason="needs root and ip(8) for a netns")
def test_a_party_without_the_plan_finds_no_key_of_the_generation_and_the_job_trains_on(
        tmp_path, client, coordinator):
    with otherhost.other_host() as intruder:
        job_id = client.create_job(SPEC).id
        # slow steps: the job must outlast the intruder's run and the test's
        # own connection to the store (40 steps at 0.1 s could end before
        # them); the test fast-forwards once its checks are done
        agent = AgentProcess(tmp_path, "a", job_id, coordinator.address,
                             "--host", intruder.node_address, nproc=2,
                             env={"TINY_STEP_SLEEP_S": "0.5"})
        try:
            _check_privacy(tmp_path, client, coordinator, job_id, agent, intruder)
        finally:
            agent.stop()


def _check_privacy(root, client, coordinator, job_id: str, agent: AgentProcess,
                   intruder: otherhost.OtherHost) -> None:
    wait_for(lambda: any(r["step"] >= 5 for r in steps(root)), 40, "step 5")
    plan = coordinator.coordinator.current_plan(job_id)
    assert plan.action == pb.PLAN_ACTION_RUN and plan.world_size == 2
    assert len(plan.rendezvous_secret) == 32  # 128 bits, hex

    assert plan.master_addr == intruder.node_address
    # the store listens on the node's advertised address only
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", plan.master_port), timeout=5).close()

    # from another host, which reaches the store (its address is in every plan)
    out = subprocess.run(intruder.command(
        sys.executable, INTRUDER, plan.master_addr, str(plan.master_port), job_id,
        str(plan.generation)), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.splitlines()[-1])
    assert not any(found["seen"].values()), found  # nothing under the predictable names
    assert found["arrived_after_add"] == 1000  # only its own count: no rank counted there

    # the keys are there, under the secret (the check above is not vacuous)
    store = dist.TCPStore(plan.master_addr, plan.master_port, is_master=False,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    secret = f"springback/{job_id}/g{plan.generation}/{plan.rendezvous_secret}//"
    assert store.add(secret + "arrived", 0) == 2
    assert store.check([secret + "endpoints/0", secret + "endpoints/1"])

    # the attempt is on the job: rank 0 found the intruder's keys under the
    # guessable names and reported them; counted once, said in the message
    job = wait_for(lambda: (j := client.get_job(job_id)).status.num_store_intrusions and j, 20,
                   "the intrusion on the job")
    assert job.status.num_store_intrusions == 1
    intrusion = job.status.last_store_intrusion
    assert intrusion.startswith(f"generation {plan.generation}: "), intrusion
    old = f"springback/{job_id}/g{plan.generation}//"
    assert old + "arrived" in intrusion and old + "endpoints/1" in intrusion, intrusion
    assert secret not in intrusion and plan.rendezvous_secret not in intrusion
    metrics = {m.name: m for m in JobMetrics(coordinator.coordinator).collect()}
    assert [s.value for s in metrics["springback_job_store_intrusions"].samples
            if s.labels["job"] == job_id and s.name.endswith("_total")] == [1]

    (root / FAST_FORWARD).touch()  # the checks are done: no more slow steps
    job = wait_for(lambda: (j := client.get_job(job_id)).status.state in ENDED and j, 40,
                   "the job to end")
    assert job.status.state == pb.JOB_STATE_SUCCEEDED, job.status.message
    assert job.status.num_store_intrusions == 1  # once per generation, not per report
    assert job.status.step == MAX_STEPS
    # no generation broke: every step from the intrusion on ran in the same one
    after = [r for r in steps(root) if r["step"] > 5]
    assert after and {r["generation"] for r in after} == {plan.generation}
    assert sorted(r["step"] for r in steps(root)) == list(range(1, MAX_STEPS + 1))
    assert agent.wait(20) == 0, agent.log()


RESTART_STEPS = 60


@pytest.mark.timeout(180)
@pytest.mark.skipif(not otherhost.available(), reason="needs root and ip(8) for a netns")
def test_in_restart_mode_a_party_without_the_plan_reaches_no_key_of_the_generations_store(
        tmp_path, client, coordinator):
    """An unmodified torchrun script: torch's keys are under no secret, so the
    generation's store is reachable only through the gate, with the proof."""
    with otherhost.other_host() as intruder:
        job_id = client.create_job({
            "name": "private-restart", "min_workers": 1, "max_workers": 1,
            "data": {"num_samples": 64, "global_batch_size": 8},
            "checkpoint": {"uri": f"file://{tmp_path}/ckpt"}, "max_steps": RESTART_STEPS}).id
        log_path = tmp_path / "agent.log"
        agent = subprocess.Popen(
            [sys.executable, "-m", "springback.cli", "run", "--job", job_id, "--coordinator",
             coordinator.address, "--mode", "restart", "--nproc-per-node", "2", "--host",
             intruder.node_address, "--", sys.executable, TORCHRUN_EXAMPLE, "--steps",
             str(RESTART_STEPS), "--checkpoint-every", "20", "--step-sleep-s", "0.5"],
            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
        try:
            _check_restart_privacy(client, coordinator, job_id, agent, log_path, intruder)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()


def _check_restart_privacy(client, coordinator, job_id: str, agent: subprocess.Popen,
                           log_path: Path, intruder: otherhost.OtherHost) -> None:
    wait_for(lambda: client.get_job(job_id).status.step >= 3, 90, "step 3")
    plan = coordinator.coordinator.current_plan(job_id)
    assert plan.master_addr == intruder.node_address and plan.world_size == 2
    # the gate's port, as a port scan would find it (the test reads it where
    # the members do, under the secret)
    rendezvous_store = dist.TCPStore(plan.master_addr, plan.master_port, is_master=False,
                                     wait_for_workers=False,
                                     timeout=datetime.timedelta(seconds=10))
    gate_port = int(rendezvous_store.get(
        plans.store_prefix(job_id, plan.generation, plan.rendezvous_secret)
        + "restart-master-port"))

    out = subprocess.run(intruder.command(sys.executable, GATE_INTRUDER, plan.master_addr,
                                          str(gate_port)),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.splitlines()[-1])
    assert found["reached"] is False and found["num_keys"] is None, found  # nothing read
    assert found["wrote"] is False, found
    assert client.get_job(job_id).status.state == pb.JOB_STATE_RUNNING  # it ran meanwhile

    # a member's way in (the proof) reaches torch's keys: the check above is
    # not vacuous; and nothing of the intruder's is there
    member = StoreForwarder((plan.master_addr, gate_port),
                            store_proof(plan.rendezvous_secret, job_id, plan.generation),
                            label="test")
    try:
        store = dist.TCPStore("127.0.0.1", member.port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=10))
        assert store.num_keys() > 0
        assert not store.check(["forged/rank"])
    finally:
        member.close()
    assert f"refused a connection from {intruder.address}:" in log_path.read_text()
    # and the attempt is on the job, from node rank 0's relay (one count per
    # report that says more refusals; no generation made)
    job = wait_for(lambda: (j := client.get_job(job_id)).status.num_store_intrusions and j, 30,
                   "the intrusion on the job")
    intrusion = job.status.last_store_intrusion
    assert intrusion.startswith(f"generation {plan.generation}: the store gate refused "), \
        intrusion
    assert f"the last from {intruder.address}:" in intrusion, intrusion
    assert plan.rendezvous_secret not in intrusion

    job = wait_for(lambda: (j := client.get_job(job_id)).status.state in ENDED and j, 120,
                   "the job to end")
    assert job.status.state == pb.JOB_STATE_SUCCEEDED, job.status.message
    assert job.status.step == RESTART_STEPS
    assert agent.wait(60) == 0, log_path.read_text()
    # one generation throughout: the intruder broke nothing
    assert "generation %d: started ranks" % plan.generation in log_path.read_text()
    assert log_path.read_text().count(": started ranks") == 1, log_path.read_text()


class TestStoreListenAddress:
    def test_the_store_listens_on_the_nodes_advertised_address_only(self):
        with listen_on("127.0.0.1") as sock:
            assert sock.getsockname()[0] == "127.0.0.1"
            assert self_address(sock) == "127.0.0.1"

    @pytest.mark.parametrize("host", ["192.0.2.1", "node.example"])
    def test_an_address_that_is_not_the_nodes_falls_back_to_every_interface(self, host,
                                                                              caplog):
        with listen_on(host) as sock:  # behind NAT, or a name: ranks still reach it
            assert sock.getsockname()[0] in ("0.0.0.0", "::")
            assert self_address(sock) in ("127.0.0.1", "::1")
        assert "listens on every interface" in caplog.text


@pytest.mark.timeout(30)
def test_endpoints_that_no_connection_of_the_rank_has_or_two_ranks_claim_are_refused(caplog):
    # A real peer process at the far end of one real connection of this rank.
    peer = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys\n"
         "s = socket.create_server(('127.0.0.1', 0)); print(s.getsockname()[1], flush=True)\n"
         "c, _ = s.accept(); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    caplog.set_level(logging.INFO, logger=rendezvous.__name__)
    try:
        port = int(peer.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as conn:
            far = "%s:%d" % conn.getpeername()[:2]
            mine = "%s:%d" % conn.getsockname()[:2]
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            # rank 1 is the real peer; rank 2 forges its address; rank 3 claims this
            # rank's own (the far end of no connection of it); rank 4 names an
            # address this rank has no connection to
            for r, published in ((1, [far]), (2, [far]), (3, [mine]), (4, ["10.9.9.9:1"])):
                store.set(f"e/{r}", json.dumps(published))
            rendezvous._endpoint_ranks.clear()
            rendezvous._publish_endpoints(store, "e", 0, 5)
            assert far not in rendezvous._endpoint_ranks  # two claims: neither believed
            assert mine not in rendezvous._endpoint_ranks
            assert "10.9.9.9:1" not in rendezvous._endpoint_ranks
            assert f"refused e {far} claimed by ranks [1, 2]" in caplog.text
            store.set("f/1", json.dumps([far]))
            for r in (2, 3, 4):
                store.set(f"f/{r}", "[]")
            rendezvous._publish_endpoints(store, "f", 0, 5)
            assert rendezvous._endpoint_ranks == {far: 1}  # the one true claim
    finally:
        rendezvous._endpoint_ranks.clear()
        peer.stdin.close()
        peer.wait(timeout=10)
