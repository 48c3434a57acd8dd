"""Restart mode: an unmodified torchrun script, restarted on every generation.

A script that never creates a `Session` (it reads RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT and calls ``init_process_group``) runs
under `springback run --mode restart` with torchrun's semantics: on every
generation whose plan includes this node, the agent stops the ranks it runs
(SIGTERM, then SIGKILL after `STOP_GRACE_S`) and starts ``--nproc-per-node``
new ones with the environment ``torchrun`` gives its workers (`torchrun_env`).
Springback's coordinator, etcd membership, fencing, drains and job API stay
around it; the state comes back through the script's own checkpoint (see
`springback.storage.resume`).

Like torchrun's c10d rendezvous (``TORCHELASTIC_USE_AGENT_STORE=True``),
each generation gets a fresh TCPStore server, hosted by the agent of node
rank 0, to which ``init_process_group`` connects as a client. torch's keys
there are not under any secret, so the store listens on 127.0.0.1 only and
the network reaches it through an authenticated gate (`storegate`): node
rank 0's agent opens a `storegate.StoreGate` on the node's advertised
address (`startup.listen_on`) and publishes the gate's port under
``springback/<job>/g<generation>/<secret>/restart-master-port`` of its
long-lived rendezvous store (the plan's master address; the secret is the
plan's `rendezvous_secret`, so no party without the plan can point the other
nodes' ranks at a store of its own), where the other agents read it. Every
node's agent (node rank 0's too) runs a `storegate.StoreForwarder` on
127.0.0.1 and gives its ranks that as MASTER_ADDR:MASTER_PORT; each of their
connections reaches the gate with the generation's proof
(`storegate.store_proof`, an HMAC under the secret) and is spliced through.
A connection without the proof is closed before it reaches the store, and
logged with its peer's address. The gate, the forwarder and the store end
with the generation (`GenerationStores.end_generation`).

Failure semantics:

* A rank exiting non-zero: the agent reports the failure once per generation
  (ReportFailure, fenced by the generation the ranks were started in, so the
  crash of peers that follows is rejected as stale), stops its other ranks
  (torchrun stops the whole local group) and waits for the next plan. More
  than ``--max-restarts`` failures end the agent with status 1.
* Every local rank exiting 0: the job is done (torchrun's rule). The agent of
  global rank 0 relays the last progress and reports the final step; every
  agent then waits for the STOP plan (at most the drain timeout) and leaves.
* The master port not published within `MASTER_PORT_TIMEOUT_S` (node rank 0
  died before publishing it, and no newer plan came): reported as a failure.
* The gate unreachable once published (node rank 0 died): the forwarder
  closes the ranks' store connections, their ``init_process_group`` fails as
  against a dead master, and the ranks' exit is handled as any other.
* Progress: global rank 0's `springback.storage.resume` helper writes its
  step and commits to the control directory; the agent relays them with
  ReportStep / CommitCheckpoint (a rejected relay is logged and dropped).
  The commit a generation restored is relayed too, in that generation: a
  checkpoint the ranks wrote while SIGTERM stopped them (the plan of the next
  generation had already come) is recorded by the generation that resumes
  from it.
  While ranks run, the relayed step stays below ``max_steps``: the job
  succeeds when the ranks exit 0, after their last checkpoint was committed.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from springback.v1 import types_pb2 as pb
from springback.client import plans
from springback.client.polling import wait_until
from springback.client import env as E
from springback.worker.agent.rankprocess import RankProcess, RankStarter
from springback.worker.agent.runner import AgentPort
from springback.worker.agent.startup import RendezvousStore, StartupClock, serve_store
from springback.worker.agent.storegate import LOOPBACK, StoreForwarder, StoreGate, store_proof

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("springback.agent")

STOP_GRACE_S = 5.0
"""SIGTERM to SIGKILL when a generation's ranks are stopped."""
MASTER_PORT_TIMEOUT_S = 60.0
RELAY_INTERVAL_S = 0.5
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def torchrun_env(*, plan: pb.Plan, me: pb.PlanMember, local_rank: int, master_port: int,
                 restart_count: int, max_restarts: int, error_file: str,
                 environ: dict[str, str]) -> dict[str, str]:
    """The variables torchrun sets for one worker, for this plan (torch 2.x
    ``LocalElasticAgent``; one role, ``default``). `environ` is the agent's
    environment, for the variables torchrun passes through or defaults.
    MASTER_ADDR:MASTER_PORT is the node's `storegate.StoreForwarder`
    (127.0.0.1:`master_port`), not the plan's master."""
    rank = me.first_rank + local_rank
    out = {
        E.RANK: str(rank), E.LOCAL_RANK: str(local_rank), E.WORLD_SIZE: str(plan.world_size),
        E.LOCAL_WORLD_SIZE: str(me.num_local_ranks),
        E.GROUP_RANK: str(me.node_rank), E.GROUP_WORLD_SIZE: str(plans.num_nodes(plan)),
        E.ROLE_NAME: "default", E.ROLE_RANK: str(rank), E.ROLE_WORLD_SIZE: str(plan.world_size),
        E.MASTER_ADDR: LOOPBACK, E.MASTER_PORT: str(master_port),
        E.TORCHELASTIC_RUN_ID: plan.job_id,
        E.TORCHELASTIC_RESTART_COUNT: str(restart_count),
        E.TORCHELASTIC_MAX_RESTARTS: str(max_restarts),
        E.TORCHELASTIC_USE_AGENT_STORE: "True",
        E.TORCHELASTIC_ERROR_FILE: error_file,
        E.TORCHELASTIC_SIGNALS_TO_HANDLE: environ.get(E.TORCHELASTIC_SIGNALS_TO_HANDLE,
                                                      TORCHRUN_SIGNALS),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    # torchrun's default for more than one local worker, unless the user set it
    out["OMP_NUM_THREADS"] = environ.get("OMP_NUM_THREADS") or (
        "1" if me.num_local_ranks > 1 else "")
    if not out["OMP_NUM_THREADS"]:
        del out["OMP_NUM_THREADS"]
    return out


class GenerationStores:
    """The per-generation TCPStore of the ranks' ``init_process_group``, its
    gate and the node's forwarder to it; see the module docstring. Not
    thread-safe: used by the supervising thread."""

    def __init__(self, agent_store: dist.TCPStore, job_id: str) -> None:
        self._agent_store = agent_store
        self._job_id = job_id
        self._hosted: dist.TCPStore | None = None  # node rank 0: this generation's server
        self._gate: StoreGate | None = None        # node rank 0: its door to the network
        self._forwarder: StoreForwarder | None = None  # every node: the ranks' way to it
        self._clients: dict[tuple[str, int], dist.TCPStore] = {}

    def _key(self, plan: pb.Plan) -> str:
        return plans.store_prefix(self._job_id, plan.generation, plan.rendezvous_secret) + (
            "restart-master-port")

    def master_port(self, plan: pb.Plan, me: pb.PlanMember,
                    abandon: Callable[[], bool]) -> int | None:
        """The port of this node's forwarder to the generation's store (on
        127.0.0.1; the previous generation's stores end first). Node rank 0
        starts the store (on 127.0.0.1) and its gate, and publishes the
        gate's port; the others wait for that port up to
        `MASTER_PORT_TIMEOUT_S`: None when `abandon()` turned true (a newer
        plan, a drain) or the time ran out."""
        self.end_generation()
        proof = store_proof(plan.rendezvous_secret, self._job_id, plan.generation)
        label = f"generation {plan.generation}"
        gate: tuple[str, int] | None
        if me.node_rank == 0:
            self._hosted = serve_store(LOOPBACK)
            self._gate = StoreGate(me.host, self._hosted.port, proof, label=label)
            self._agent_store.set(self._key(plan), str(self._gate.port))
            gate = self._gate.local_address
        else:
            port = self._published_port(plan, abandon)
            gate = None if port is None else (plan.master_addr, port)
        if gate is None:
            return None
        self._forwarder = StoreForwarder(gate, proof, label=label)
        return self._forwarder.port

    def intrusion(self, generation: int) -> str:
        """What this node's gate refused in `generation` (node rank 0), said
        as a store intrusion (``ReportStepRequest.store_intrusion``: it names
        the generation, and each new refusal reads differently); "" when
        nothing was refused."""
        gate = self._gate
        if gate is None or not gate.refused:
            return ""
        return (f"generation {generation}: the store gate refused {gate.refused} "
                f"connection(s) without the generation's proof, the last from "
                f"{gate.last_refusal}")

    def end_generation(self) -> None:
        """Closes the forwarder, the gate (their connections too) and the
        hosted store. Idempotent; the ranks are stopped first."""
        for relay in (self._forwarder, self._gate):
            if relay is not None:
                relay.close()
        self._forwarder = self._gate = None
        self._hosted = None  # its server stops with it

    def _published_port(self, plan: pb.Plan, abandon: Callable[[], bool]) -> int | None:
        import torch.distributed as dist  # loaded by the agent's store already

        key = self._key(plan)

        def published_port() -> int | None:
            try:
                client = self._client(plan.master_addr, plan.master_port)
                if client.check([key]):
                    return int(client.get(key))
            except (RuntimeError, dist.DistError) as e:  # master not reachable (yet)
                log.debug("master store %s:%d: %s", plan.master_addr, plan.master_port, e)
                self._clients.pop((plan.master_addr, plan.master_port), None)
            return None

        return wait_until(published_port, timeout_s=MASTER_PORT_TIMEOUT_S, abandon=abandon)

    def _client(self, host: str, port: int) -> dist.TCPStore:
        import torch.distributed as dist

        if (host, port) not in self._clients:
            self._clients[(host, port)] = dist.TCPStore(
                host, port, is_master=False, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=5))
        return self._clients[(host, port)]


class RestartRanks:
    """The restart-mode runner of one agent's ranks (`runner.RankRunner`);
    `check` is polled by the agent's main loop and returns an exit status once
    the agent is done. `rendezvous`: the node's store (by default the agent's
    own TCPStore server, `startup.RendezvousStore`, whose torch import runs
    beside the agent's start-up)."""

    def __init__(self, port: AgentPort, rendezvous: Any = None) -> None:
        self._port = port
        self._rendezvous = RendezvousStore(port.config.host) if rendezvous is None else rendezvous
        self.ranks: dict[int, RankProcess] = {}
        self._starter = RankStarter(port.config.command, fork=port.config.fork_server)
        self.generation = 0        # generation of the running ranks (0: none yet)
        self._me: pb.PlanMember | None = None
        self._num_starts = 0
        self._failure_reported = False
        self._finished = False     # every rank of this generation exited 0
        self._done_sent = False    # ... and the coordinator was told
        self._finish_deadline: float | None = None
        self._stores = GenerationStores(self._rendezvous.get(), port.config.job_id)
        self._relayed_step = 0
        self._start_sent = False
        self._relayed_checkpoint = 0
        self._next_relay = 0.0

    # -- the runner's part -------------------------------------------------------

    def rendezvous_port(self) -> int:
        return int(self._rendezvous.get().port)

    def start(self, phases: StartupClock) -> None:
        """Only joins: ranks start with the first plan that runs this node."""
        self._port.join()
        phases.done("join")

    def drain_signal(self) -> None:
        """As torchrun: the ranks get the signal."""
        self.signal_all(signal.SIGTERM)

    def drained(self) -> None:
        """Nothing to say: the ranks were signalled."""

    def close(self) -> None:
        self.kill_all()
        self._starter.close()
        self._stores.end_generation()
        self._rendezvous.close()

    # -- the loop ------------------------------------------------------------------

    def check(self) -> int | None:
        plan = self._port.plan()
        if plan is None:
            return None
        if plan.action == pb.PLAN_ACTION_STOP:
            return self._on_stop()
        if plan.generation != self.generation:
            self._switch(plan)
            return None
        self._relay()
        codes = {lr: p.poll() for lr, p in self.ranks.items()}
        failed = [(lr, c) for lr, c in codes.items() if c not in (None, 0)]
        if failed and not self._failure_reported:
            return self._on_failure(*failed[0])
        if self.ranks and not self._finished and all(c == 0 for c in codes.values()):
            self._on_finished(plan)
        elif self._finished and not self._done_sent and time.monotonic() >= self._next_relay:
            self._next_relay = time.monotonic() + RELAY_INTERVAL_S
            self._report_done(plan)  # the last try did not reach the coordinator
        if self._finished and self._finish_deadline and time.monotonic() > self._finish_deadline:
            log.warning("ranks finished but no STOP plan within %.0fs: leaving",
                        self._port.config.drain_timeout_s)
            self._port.leave("ranks finished")
            return 0
        return None

    def _switch(self, plan: pb.Plan) -> None:
        """Stops this generation's ranks and starts the next one's (if this node is in it)."""
        self.stop_all()
        self._stores.end_generation()
        self.generation = plan.generation
        self._failure_reported = self._finished = self._done_sent = False
        self._finish_deadline = None
        self._relayed_step = self._relayed_checkpoint = 0
        self._start_sent = False
        me = plans.own_entry(plan, self._member_id())
        self._me = me
        if plan.action != pb.PLAN_ACTION_RUN or me is None:
            log.info("generation %d: this node runs no ranks (%s)", plan.generation,
                     pb.PlanAction.Name(plan.action))
            return

        def abandon() -> bool:
            latest = self._port.plan()
            return (latest is not None and latest.generation > plan.generation
                    or self._port.drain_reason() is not None or self._port.fenced())

        port = self._stores.master_port(plan, me, abandon)
        if port is None:
            if not abandon():
                self._failure_reported = True
                self._port.report_failure(
                    -1, 0, reason=f"master port of generation {plan.generation} not "
                                  f"published within {MASTER_PORT_TIMEOUT_S:.0f}s")
            return
        restart_count = self._num_starts
        self._num_starts += 1
        for lr in range(me.num_local_ranks):
            environ = self._port.rank_env(lr)
            error_file = os.path.join(self._port.workdir, f"attempt_{restart_count}", str(lr),
                                      "error.json")
            os.makedirs(os.path.dirname(error_file), exist_ok=True)
            environ.update(torchrun_env(plan=plan, me=me, local_rank=lr, master_port=port,
                                        restart_count=restart_count,
                                        max_restarts=self._port.config.max_restarts,
                                        error_file=error_file, environ=environ))
            if plan.spec.checkpoint.uri:  # one directory per job, as in library mode
                environ[E.CHECKPOINT_URI] = self._checkpoint_uri(plan)
            if plan.restore.kind == pb.RESTORE_KIND_CHECKPOINT:  # e.g. `job restore --step N`
                environ[E.RESTORE_MAX_STEP] = str(plan.restore.checkpoint.step)
            self.ranks[lr] = self._launch(lr, environ, attempt=restart_count)
        log.info("generation %d: started ranks %d..%d of %d (restart %d)", plan.generation,
                 me.first_rank, me.first_rank + me.num_local_ranks - 1, plan.world_size,
                 restart_count)

    def _launch(self, local_rank: int, environ: dict[str, str], *,
                attempt: int) -> RankProcess:
        """Starts one rank (dies with the agent, output as configured)."""
        config = self._port.config
        return config.output.launch(self._starter, environ,
                                    local_rank=local_rank, attempt=f"attempt_{attempt}")

    def _on_failure(self, local_rank: int, code: int) -> int | None:
        self._failure_reported = True
        self._port.report_failure(local_rank, code)
        over = self._port.count_failure()
        self.stop_all()  # like torchrun: one failed worker stops the node's group
        if over:
            log.error("more than %d rank failures: giving up", self._port.config.max_restarts)
            self._port.leave("too many rank failures")
            return 1
        return None

    def _on_finished(self, plan: pb.Plan) -> None:
        self._finished = True
        self._finish_deadline = time.monotonic() + self._port.config.drain_timeout_s
        self._relay(final=True)
        if self._me is None or self._me.first_rank != 0:
            log.info("all local ranks exited 0; waiting for the job to stop")
            self._done_sent = True  # global rank 0's agent reports it
            return
        self._report_done(plan)

    def _report_done(self, plan: pb.Plan) -> None:
        """Global rank 0's agent: the job's last step (the generation's start
        report goes first while it has not reached the coordinator); tried
        again by `check` until it does."""
        if not self._start_sent:
            self._relay(final=True)
        step = max(plan.spec.max_steps, self._relayed_step)
        log.info("all local ranks exited 0: reporting the job done (step %d)", step)
        self._done_sent = self._send_step(step, loss=float("nan"))

    def _on_stop(self) -> int | None:
        """STOP plan (finished or cancelled): ranks still running get the
        drain timeout, then are killed; then the member leaves."""
        if any(p.poll() is None for p in self.ranks.values()):
            if self._finish_deadline is None:
                self._finish_deadline = time.monotonic() + self._port.config.drain_timeout_s
            if time.monotonic() < self._finish_deadline:
                return None
            log.warning("job stopped but ranks still running after %.0fs: killing them",
                        self._port.config.drain_timeout_s)
        self.stop_all()
        self._port.leave("job stopped")
        return 0

    # -- progress relay ------------------------------------------------------------

    def _relay(self, final: bool = False) -> None:
        """Relays global rank 0's progress file (see `springback.storage.resume`)."""
        me = self._me
        control_dir = self._port.control_dir()
        if me is None or me.first_rank != 0 or control_dir is None:
            return
        now = time.monotonic()
        if not final and now < self._next_relay:
            return
        self._next_relay = now + RELAY_INTERVAL_S
        # imported here: storage.resume imports torch (seconds of CPU), and
        # the agent of a library-mode job (and every CLI call) never needs it
        from springback.storage.resume import read_progress

        try:
            progress = read_progress(control_dir)
        except (OSError, ValueError, TypeError) as e:
            log.warning("unreadable rank progress: %s", e)
            return
        if progress is None or progress.generation != self.generation:
            return
        if not self._start_sent:  # where this generation resumed: steps redone, restores
            if not self._send_step(progress.restored_step, float("nan"), start=True):
                return  # resent at the next relay: nothing of this generation counts before it
            restored = progress.restored_checkpoint
            if restored and restored["step"] > self._relayed_checkpoint:
                # e.g. a drain checkpoint committed to storage after its own
                # generation ended (the ranks save when SIGTERM stops them, and
                # a commit of an ended generation is refused): recorded now, so
                # retention and `job get` know the state this job resumed from.
                # The same step and URI already recorded is a no-op.
                self._relayed_checkpoint = restored["step"]
                self._commit(restored)
        ckpt = progress.checkpoint
        if ckpt and ckpt["step"] > self._relayed_checkpoint:
            self._relayed_checkpoint = ckpt["step"]
            self._commit(ckpt)
        plan = self._port.plan()
        cap = plan.spec.max_steps - 1 if plan is not None and plan.spec.max_steps else progress.step
        step = min(progress.step, cap)
        if step > self._relayed_step:
            self._send_step(step, progress.loss)

    def _send_step(self, step: int, loss: float, *, start: bool = False) -> bool:
        """Relays a step report; `start`: the generation-start report (the step
        the script restored, 0 for a fresh start). False when the report did
        not reach the coordinator: a step report is superseded by the next one,
        but the start report is the only word of where the generation resumed
        (restores, steps redone), so it is not marked sent and the caller
        sends it again."""
        restored = pb.RESTORE_KIND_CHECKPOINT if step else pb.RESTORE_KIND_NONE
        intrusion = self._stores.intrusion(self.generation)
        if self._port.calls().report_step(
                self.generation, step, loss, start=start,
                restored_from=restored if start else pb.RESTORE_KIND_UNSPECIFIED,
                store_intrusion=intrusion) is None:
            return False
        self._relayed_step = max(self._relayed_step, step)
        self._start_sent = self._start_sent or start
        return True

    def _member_id(self) -> str:
        return self._port.member_id()

    def _commit(self, ckpt: dict) -> None:
        ref = pb.CheckpointRef(step=ckpt["step"], uri=ckpt["uri"], world_size=ckpt["world_size"],
                               size_bytes=ckpt["size_bytes"],
                               cursor=pb.DataCursor(epoch=ckpt["epoch"], offset=ckpt["offset"]))
        self._port.calls().commit_then_prune(self.generation, ref, self._prune)

    def _checkpoint_uri(self, plan: pb.Plan) -> str:
        from springback.storage import job_checkpoint_uri  # restart mode only: see _relay

        return job_checkpoint_uri(plan.spec.checkpoint.uri, plan.job_id)

    def _prune(self, retained: list[str]) -> None:
        """Deletes what the coordinator's record (`retained` URIs) no longer
        holds (retention is the coordinator's rule)."""
        from springback.storage import prune_to_record

        plan = self._port.plan()
        if plan is None or not plan.spec.checkpoint.uri:
            return
        prune_to_record(self._checkpoint_uri(plan), retained, current_generation=self.generation)

    # -- stopping ----------------------------------------------------------------

    def signal_all(self, sig: int) -> None:
        """Sends `sig` to every running rank (a drain forwards SIGTERM)."""
        for p in self.ranks.values():
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after `grace_s`, and reap. Idempotent."""
        self.signal_all(signal.SIGTERM)
        if not wait_until(lambda: all(p.poll() is not None for p in self.ranks.values()),
                          timeout_s=grace_s, interval_s=0.02):
            self.kill_all()
        self.ranks.clear()

    def kill_all(self) -> None:
        for p in self.ranks.values():
            if p.poll() is None:
                p.kill()
        for p in self.ranks.values():
            p.wait()
        self.ranks.clear()
