"""A whole local deployment with one fault injector over every part of it.

`Deployment` starts what a real job runs on, all on loopback: a 3-member etcd
cluster, two `springback coordinator` replicas (each reaching every etcd
member through its own `NetProxy`), a moto S3 server behind a `NetProxy`
and an HTTP fault proxy (`s3faults.FaultyS3`: the checkpoints' store), and
node agents whose coordinator connections go through one `NetProxy` per
replica. `Faults` injects one fault of a class by name and undoes what
must be undone (a restarted member, a healed link), so a soak draws them at
random::

    with Deployment(tmp_path) as deployment:
        job = deployment.create_job(spec)
        faults = Faults(deployment, job_id, rng)
        for name in ...:
            what = faults.inject(name)   # None when the fault does not apply now

Faults (names in `FAULTS`), by class:

* worker: ``kill-node`` (agent and ranks SIGKILLed; a new node replaces it),
  ``kill-rank`` (one rank SIGKILLed; its agent restarts it), ``stop-node``
  (SIGSTOP past the liveness timeout, then SIGCONT: fenced, rejoins),
  ``drain-node`` (SIGTERM: the node drains and leaves; a new node replaces it),
  ``skewed-node`` (a node SIGKILLed and replaced by one whose wall clock runs a
  day ahead, an hour behind, and jumps between the two at later faults:
  tests/wallclock); ``crash-every-rank`` (every rank of every node SIGKILLed
  at once while the agents live on: a correlated crash, the job restarts
  every rank and restores from the store);
* inside recovery: ``kill-in-recovery`` (a node SIGKILLed, then a second one
  0-1.5 s after the coordinator planned the next generation: inside its
  rendezvous, state agreement, exchange, hand-over or restore; both replaced);
* rank <-> rank network: ``reset-rank-links`` (every connection between the
  ranks destroyed: `sockreset`);
* agents <-> coordinator network: ``slow-agent-links`` (200 +- 50 ms each way
  for a few seconds), ``reset-agent-links`` (RST every connection, thrice),
  ``refuse-agent-links`` (new connections refused for 1 s);
* coordinator: ``kill-replica`` (SIGKILL, restarted on its address),
  ``term-replica`` (SIGTERM: drains, then restarted), ``cut-replica`` (its
  etcd links held past the leader TTL: it must step down; then healed);
* etcd: ``kill-etcd-member`` (the raft leader or another member SIGKILLed,
  restarted 5 s later), ``etcd-quorum-loss`` (two of three members down for
  10 s);
* storage: ``reset-storage`` (every S3 connection reset, twice over a few
  seconds: uploads and commits in flight fail and are retried),
  ``slow-storage`` (S3 delayed 300 ms each way for 10 s),
  ``storage-brownout-restore`` (every node SIGKILLed and replaced while S3
  answers 15 % of requests 503 SlowDown, resets 5 % before and 5 % after the
  server answered and truncates 10 % of GET bodies, until the new nodes have
  restored and trained a step: `s3faults.FaultInjector.rate`).
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from pathlib import Path

import sockreset
from cluster import AgentProcess, steps
from etcdcluster import EtcdCluster
from netproxy import NetProxy
from s3faults import FaultyS3
from sbtest import CoordinatorProcess, ranks_of, wait_for
from springback.cli.local import free_port
from springback.client.api import Client

FAULTS = ("kill-node", "kill-rank", "stop-node", "drain-node", "skewed-node", "crash-every-rank",
          "kill-in-recovery", "reset-rank-links", "slow-agent-links", "reset-agent-links",
          "refuse-agent-links", "kill-replica", "term-replica", "cut-replica", "kill-etcd-member",
          "etcd-quorum-loss", "reset-storage", "slow-storage", "storage-brownout-restore")

WALLCLOCK_SHIM = str(Path(__file__).resolve().parent / "wallclock")
LIVENESS_S = 3.0
LEADER_TTL_S = 2


class Deployment:
    """etcd x3, two coordinator replicas, S3, and node agents; see the module docstring."""

    def __init__(self, root: Path, num_replicas: int = 2, *, script: str | None = None,
                 nproc: int = 1) -> None:
        from moto.server import ThreadedMotoServer

        self.root = root
        self.node_args = {"nproc": nproc, **({"script": script} if script else {})}
        """What every node runs (the DDP form's tiny_train.py unless `script`)."""
        self.etcd = EtcdCluster(str(root / "etcd"), size=3)
        self.etcd.start()
        self.replica_addresses = [f"127.0.0.1:{free_port()}" for _ in range(num_replicas)]
        # each replica reaches each etcd member through a link of its own
        self.etcd_links = {a: [NetProxy(m.endpoint) for m in self.etcd.members]
                           for a in self.replica_addresses}
        self.replicas = {a: self._spawn_replica(a) for a in self.replica_addresses}
        self.agent_links = [NetProxy(a) for a in self.replica_addresses]
        self._s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        self._s3.start()
        host, port = self._s3.get_host_and_port()
        # agents -> storage_link (TCP faults) -> storage_faults (HTTP faults) -> moto
        self.storage_faults = FaultyS3(f"http://{host}:{port}")
        self.storage_link = NetProxy(self.storage_faults.url)
        self.s3_env = {"SPRINGBACK_S3_ENDPOINT_URL": self.storage_link.url,
                       "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}
        self.agents: dict[str, AgentProcess] = {}
        self.wall_clocks: list[Path] = []  # offset files of the skewed nodes
        self._names = iter(range(10_000))

    @property
    def coordinator(self) -> str:
        """What agents and clients are given: the agent-side links, comma-separated."""
        return ",".join(link.address for link in self.agent_links)

    def bucket(self) -> str:
        """A fresh S3 bucket (created directly, not through the faulty link)."""
        import boto3

        host, port = self._s3.get_host_and_port()
        name = f"soak-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                     aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=name)
        return f"s3://{name}"

    def _spawn_replica(self, address: str) -> CoordinatorProcess:
        etcd = ",".join(link.url for link in self.etcd_links[address])
        log = str(self.root / f"coordinator-{address.rsplit(':', 1)[1]}.log")
        return CoordinatorProcess(etcd, "--listen", address, "--liveness-timeout-s",
                                  str(LIVENESS_S), "--leader-ttl-s", str(LEADER_TTL_S),
                                  "--drain-s", "1", log_path=log)

    def restart_replica(self, address: str) -> None:
        self.replicas[address] = self._spawn_replica(address)

    def start_node(self, job_id: str, env: dict[str, str] | None = None) -> AgentProcess:
        name = f"n{next(self._names)}"
        self.agents[name] = AgentProcess(self.root, name, job_id, self.coordinator,
                                         env={**self.s3_env, **(env or {})},
                                         **self.node_args)
        return self.agents[name]

    def live_nodes(self) -> list[str]:
        return sorted(n for n, a in self.agents.items() if a.process.poll() is None)

    def close(self) -> None:
        for agent in self.agents.values():
            agent.stop()
        for replica in self.replicas.values():
            replica.stop()
        for link in [*self.agent_links, self.storage_link,
                     *(lk for links in self.etcd_links.values() for lk in links)]:
            link.close()
        self.storage_faults.close()
        self._s3.stop()
        self.etcd.stop()

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Faults:
    """Injects the faults of `FAULTS` into a `Deployment` running `job_id`.

    `inject(name)` returns what it did (for the trace), or None when the
    fault does not apply now (e.g. a node fault with fewer than three nodes
    up). It returns once the fault is over (restarted, healed); whether the
    job trains again is for the caller to wait on."""

    def __init__(self, deployment: Deployment, job_id: str, rng: random.Random,
                 num_nodes: int = 3) -> None:
        self.d = deployment
        self.job_id = job_id
        self.rng = rng
        self.num_nodes = num_nodes

    def inject(self, name: str) -> str | None:
        return getattr(self, "_" + name.replace("-", "_"))()

    def _full(self) -> list[str] | None:
        """The nodes up, when all `num_nodes` are up and joined with ranks
        running (a replacement still starting does not count: a node fault
        then would take the job below its minimum and measure start-up)."""
        live = [n for n in self.d.live_nodes()
                if "joined job" in self.d.agents[n].log() and ranks_of(self.d.agents[n].pid)]
        return live if len(live) >= self.num_nodes else None

    # -- worker --------------------------------------------------------------

    def _kill_node(self) -> str | None:
        if not (live := self._full()):
            return None
        victim = self.rng.choice(live)
        self.d.agents[victim].signal_node(signal.SIGKILL)
        self.d.start_node(self.job_id)
        return victim

    def _kill_rank(self) -> str | None:
        victim = self.rng.choice(self.d.live_nodes())
        ranks = ranks_of(self.d.agents[victim].pid)
        if not ranks:
            return None
        os.kill(self.rng.choice(ranks), signal.SIGKILL)
        return victim

    def _stop_node(self) -> str | None:
        if not (live := self._full()):
            return None
        victim = self.d.agents[self.rng.choice(live)]
        victim.signal_node(signal.SIGSTOP)
        self._hold_for(LIVENESS_S * 2)  # past the liveness timeout: fenced
        victim.signal_node(signal.SIGCONT)
        return victim.name

    def _drain_node(self) -> str | None:
        if not (live := self._full()):
            return None
        victim = self.rng.choice(live)
        self.d.agents[victim].process.send_signal(signal.SIGTERM)
        self.d.start_node(self.job_id)
        return victim

    def _kill_in_recovery(self) -> str | None:
        if not (live := self._full()):
            return None
        first, second = self.rng.sample(live, 2)
        with Client(self.d.coordinator) as client:
            before = wait_for(lambda: client.get_job(self.job_id), 30, "the job").status.generation
            self.d.agents[first].signal_node(signal.SIGKILL)
            wait_for(lambda: client.get_job(self.job_id).status.generation > before, 30,
                     "the generation after the first kill")
        delay = self.rng.uniform(0, 1.5)
        self._hold_for(delay)  # where in the recovery the second fault lands
        self.d.agents[second].signal_node(signal.SIGKILL)
        self.d.start_node(self.job_id)
        self.d.start_node(self.job_id)
        return f"{first}, then {second} {delay:.2f} s into the recovery"

    def _skewed_node(self) -> str | None:
        if not (live := self._full()):
            return None
        victim = self.rng.choice(live)
        self.d.agents[victim].signal_node(signal.SIGKILL)
        clock = self.d.root / f"wallclock-{len(self.d.agents)}"
        clock.write_text(self.rng.choice(["86400", "-3600"]))
        self.d.wall_clocks.append(clock)
        pythonpath = os.pathsep.join(p for p in (WALLCLOCK_SHIM, os.environ.get("PYTHONPATH"))
                                     if p)
        self.d.start_node(self.job_id, env={"PYTHONPATH": pythonpath,
                                            "SPRINGBACK_TEST_WALLCLOCK_FILE": str(clock)})
        for earlier in self.d.wall_clocks[:-1]:  # the skewed nodes before it jump
            earlier.write_text("-3600" if float(earlier.read_text()) > 0 else "86400")
        return f"{victim} replaced by a node {clock.read_text()} s off"

    def _crash_every_rank(self) -> str | None:
        if not self._full():
            return None
        ranks = [pid for n in self.d.live_nodes() for pid in ranks_of(self.d.agents[n].pid)]
        for pid in ranks:  # one after another at once: a correlated crash, agents live on
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return f"{len(ranks)} ranks"

    # -- networks ------------------------------------------------------------

    def _reset_rank_links(self) -> str | None:
        ranks = {pid for n in self.d.live_nodes() for pid in ranks_of(self.d.agents[n].pid)}
        count = sockreset.reset_between(ranks)
        return f"{count} connections" if count else None

    def _slow_agent_links(self) -> str:
        for link in self.d.agent_links:
            link.delay(0.2, jitter=0.05)
        self._hold_for(6)
        for link in self.d.agent_links:
            link.heal()
        return "200 +- 50 ms for 6 s"

    def _reset_agent_links(self) -> str:
        for _ in range(3):
            for link in self.d.agent_links:
                link.reset()
            self._hold_for(0.5)
        return "3 resets"

    def _refuse_agent_links(self) -> str:
        for link in self.d.agent_links:
            link.reset().refuse()
        self._hold_for(1)
        for link in self.d.agent_links:
            link.heal()
        return "1 s"

    # -- coordinator ---------------------------------------------------------

    def _kill_replica(self) -> str:
        address = self.rng.choice(self.d.replica_addresses)
        self.d.replicas[address].kill()
        self.d.restart_replica(address)
        return address

    def _term_replica(self) -> str:
        address = self.rng.choice(self.d.replica_addresses)
        self.d.replicas[address].stop()
        self.d.restart_replica(address)
        return address

    def _cut_replica(self) -> str:
        address = self.rng.choice(self.d.replica_addresses)
        for link in self.d.etcd_links[address]:
            link.hold()
        self._hold_for(LEADER_TTL_S * 3)
        for link in self.d.etcd_links[address]:
            link.reset().heal()
        return address

    # -- etcd ----------------------------------------------------------------

    def _kill_etcd_member(self) -> str:
        member = (self.d.etcd.raft_leader() if self.rng.random() < 0.5
                  else self.rng.choice(self.d.etcd.members))
        member.stop(kill=True)
        self._hold_for(5)
        member.start(wait=False)
        member.wait_serving(30)
        return member.name

    def _etcd_quorum_loss(self) -> str:
        down = self.rng.sample(self.d.etcd.members, 2)
        for member in down:
            member.stop(kill=True)
        self._hold_for(10)
        for member in down:
            member.start(wait=False)
        for member in down:
            member.wait_serving(30)
        return ",".join(m.name for m in down)

    # -- storage -------------------------------------------------------------

    def _reset_storage(self) -> str:
        for _ in range(2):
            self.d.storage_link.reset()
            self._hold_for(1.5)
        return "2 resets"

    def _slow_storage(self) -> str:
        self.d.storage_link.delay(0.3)
        self._hold_for(10)
        self.d.storage_link.heal()
        return "300 ms for 10 s"

    def _storage_brownout_restore(self) -> str | None:
        if not (live := self._full()):
            return None
        injector = self.d.storage_faults.injector
        before = len(injector.injected)
        with Client(self.d.coordinator) as client:
            for name in live:
                self.d.agents[name].signal_node(signal.SIGKILL)
            for name in live:
                self.d.agents[name].wait(30)
            generation = wait_for(lambda: client.get_job(self.job_id), 30,
                                  "the job").status.generation
        injector.rate(self.rng.randrange(2**32))
        try:
            for _ in live:
                self.d.start_node(self.job_id)
            # the brown-out lasts the restore: until the new nodes trained a step
            wait_for(lambda: any(r["generation"] > generation for r in steps(self.d.root)), 240,
                     "a step after the restore through the brown-out")
        finally:
            injector.clear()
        return (f"{len(live)} nodes replaced, {len(injector.injected) - before} "
                f"requests failed")

    @staticmethod
    def _hold_for(seconds: float) -> None:
        """Keeps a fault in place for `seconds` (the fault's duration, not a sync)."""
        time.sleep(seconds)
