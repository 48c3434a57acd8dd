"""The node agent: ``springback run --job JOB -- python train.py …``.

One agent per node. It first checks that the job exists and the token is
accepted (GetJob, within ``--connect-timeout-s``), so a typo fails before any
rank starts. Its ranks are run by a `RankRunner` (`runner.py`, picked by
`command.runner_for`), which sees the agent only through its `AgentLink`: in
library mode (`library.py`) it starts the ranks and joins once their set-up
is done (`ranks.py`); in restart mode (`restart.py`) it joins and
(re)starts the ranks on every generation. It holds the node's rendezvous store
address (a port, named in JoinJob: in library mode a listening socket whose
TCPStore the process of local rank 0 serves, in restart mode a TCPStore
server in the agent itself), joins the job as a *member*, keeps the member alive
with heartbeats, relays every plan to its ranks through the control directory
(`control.py`), and spawns ``--nproc-per-node`` local ranks with the torchrun
environment plus the SPRINGBACK_* variables of `env.py`.

Failure semantics:

* A local rank exiting non-zero is reported at once (ReportFailure) so the
  coordinator makes a new generation without waiting for a timeout; the warm
  standby (`ranks.py`) takes the rank's place and receives its state from a
  surviving peer. More than
  ``--max-restarts`` failures end the agent with exit status 1.
* SIGTERM, SIGINT or a preemption notice start a *drain*: DrainMember (the
  coordinator leaves this member out of the next plan), the ranks finish their
  step and exit when they see that plan, then LeaveJob. Ranks still running at
  ``--drain-timeout-s`` are killed; the member leaves anyway. Under Slurm,
  whose SIGTERM (``scancel``, a preemption) reaches the ranks too, library-mode
  ranks ignore SIGTERM (`ranks.py`), so the drain reaches them intact; the drain's
  reason names the Slurm job, step, node and signal (`slurm.signal_reason`).
  Slurm's SIGTERM and a preemption notice mark the drain *preempted*
  (DrainMember and LeaveJob say so): the job's events record ``preempted``.
* Heartbeat or plan stream answering NOT_FOUND means the member expired (the
  node was stopped or partitioned longer than the liveness timeout) and is
  *fenced*; UNAUTHENTICATED, that the coordinator revoked its member credential
  for that reason (or the operator token changed), the same: its ranks are killed at once, and the agent joins again as a new
  member (``--on-fenced rejoin``, the default) or exits with status 3.
* Ranks get the parent-death signal SIGKILL, so an agent killed with SIGKILL
  takes its ranks with it and its peers see the failure at once.
* Coordinator unavailable: at start-up the check is retried, with a log line
  per attempt, until ``--connect-timeout-s`` (then exit status 1 naming the
  addresses); later, heartbeats and the plan stream retry with backoff; if the
  outage outlasts the liveness timeout the member is fenced as above.
* A drain before this node ever trained (no plan ran it yet) stops the ranks
  at once: they hold nothing to hand over.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import uuid

import grpc

from springback.client import plans
from springback.client.channel import connect, parse_addresses
from springback.client.polling import wait_until
from springback.client.workers import MemberCalls
from springback.client.metrics import serve as serve_metrics
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as wpb
from springback.v1 import worker_service_pb2_grpc as wgrpc
from springback.client import env as E
from springback.worker import rankstats
from springback.worker.agent.member import MemberLink
from springback.worker.agent.metrics import node_registry
from springback.worker.control import PlanPublisher
from springback.worker.agent.watchdog import RankWatchdog
from springback.worker.agent.ranklogs import RankLogs, job_logs_base, rank_label
from springback.worker.agent.config import AgentConfig
from springback.worker.agent.runner import (
    EXIT_ERROR,
    EXIT_FENCED,
    EXIT_OK,
    RankRunner,
    RunnerFactory,
)
from springback.worker.agent.startup import (
    DrainedBeforeJoin,
    JobFinished,
    StartupClock,
    StartupRefused,
    check_job,
    join_job,
)

log = logging.getLogger("springback.agent")

__all__ = ["EXIT_ERROR", "EXIT_FENCED", "EXIT_OK", "Agent", "AgentLink"]

RPC_TIMEOUT_S = 5.0


class Agent:
    """One node's agent; `run` blocks until the job ends, the node drained, or
    the agent gives up, and returns the process exit status. Its ranks are run
    by the `RankRunner` that `runner` makes (`runner.py`; chosen by
    `command.runner_for`), which sees this agent through an `AgentLink`."""

    def __init__(self, config: AgentConfig, runner: RunnerFactory) -> None:
        self.config = config
        # The agent's own token (a job's join credential, or the operator's)
        # only checks the job and joins it; the member's calls then carry the
        # member credential JoinJob issued (`_join`).
        self._channel = connect(config.coordinator or parse_addresses(None), token=config.token)
        self._join_stub = wgrpc.WorkerServiceStub(self._channel)
        self._stub = self._join_stub
        self._workdir = tempfile.mkdtemp(prefix=f"springback-agent-{config.job_id}-")
        self._drain_reason: str | None = None
        self._drain_preempted = False  # the scheduler takes the node back (see request_drain)
        self._lock = threading.Lock()
        self._plan: pb.Plan | None = None
        self._fenced = threading.Event()
        self._stop = threading.Event()
        self._rank_logs = RankLogs(
            label_of=lambda p: rank_label(p, self._runner.ranks, self._plan,
                                          self.member.id if self.member else None),
            member_of=lambda: self.member.id if self.member else None,
            base_uri_of=lambda: job_logs_base(self._plan, self.config.job_id))
        self._ran = False  # a RUN plan included this member: its ranks may hold state
        self._num_restarts = 0
        self.member: pb.Member | None = None
        self._num_joins = 0  # a Slurm task's join tokens count them (`_join_token`)
        self._member_credential = ""  # JoinJob's, for the ranks (empty without auth)
        self.liveness_timeout_s = 5.0
        self._runner: RankRunner = runner(AgentLink(self))

    # -- membership ------------------------------------------------------------

    def _check_job(self) -> None:
        """The start-up check (`startup.check_job`), before any rank starts."""
        check_job(self._channel, job_id=self.config.job_id,
                  target=self.config.coordinator or ",".join(parse_addresses(None)),
                  connect_timeout_s=self.config.connect_timeout_s, nnodes=self.config.nnodes,
                  drain_reason=lambda: self._drain_reason)

    def _join_token(self) -> str:
        """One per join (its retries share it): the Slurm task's next token
        (`slurm.SlurmTask.join_token`), else a random one."""
        num_joins, self._num_joins = self._num_joins, self._num_joins + 1
        if self.config.slurm is not None:
            return self.config.slurm.join_token(num_joins)
        return uuid.uuid4().hex

    def _join(self) -> None:
        """JoinJob (`join_job`: retried until the connect timeout); raises
        RpcError for a permanent error (unknown job, bad token)."""
        req = wpb.JoinJobRequest(job_id=self.config.job_id, host=self.config.host,
                                 rendezvous_port=self._runner.rendezvous_port(),
                                 num_local_ranks=self.config.nproc_per_node,
                                 join_token=self._join_token())
        resp = join_job(self._join_stub, req,
                        deadline=time.monotonic() + self.config.connect_timeout_s,
                        attempt_timeout_s=RPC_TIMEOUT_S, drain_reason=lambda: self._drain_reason)
        self.member = resp.member
        self._member_credential = resp.member_credential
        if resp.member_credential:  # a previous member's channel closes when dropped
            self._stub = wgrpc.WorkerServiceStub(connect(
                self.config.coordinator or parse_addresses(None), token=resp.member_credential))
        self._calls = MemberCalls(self._stub, self.config.job_id, resp.member.id,
                                  timeout_s=RPC_TIMEOUT_S)
        self.liveness_timeout_s = resp.liveness_timeout.ToTimedelta().total_seconds() or 5.0
        self._heartbeat_s = (resp.heartbeat_interval.ToTimedelta().total_seconds()
                             or self.liveness_timeout_s / 3)
        self._plan = None
        self._fenced.clear()
        self._publisher = PlanPublisher(os.path.join(self._workdir, self.member.id))
        self._watchdog = RankWatchdog(self._publisher.directory, self._collective_timeout_s())
        log.info("joined job %s as member %s (liveness %.1fs)", self.config.job_id,
                 self.member.id, self.liveness_timeout_s)
        member_id = self.member.id
        link = MemberLink(self._stub, self.config.job_id, member_id,
                          alive=lambda: self._current(member_id), fenced=self._fenced,
                          stop=self._stop)
        threading.Thread(target=link.keep_alive, args=(self._heartbeat_s,), daemon=True,
                         name="heartbeat").start()
        threading.Thread(target=link.follow_plans, args=(self._on_plan,), daemon=True,
                         name="watch-plans").start()

    def _current(self, member_id: str) -> bool:
        return self.member is not None and self.member.id == member_id and not self._stop.is_set()

    def _on_plan(self, plan: pb.Plan) -> None:
        with self._lock:
            if self._plan is not None and plan.generation <= self._plan.generation:
                return
            self._plan = plan
            self._publisher.publish(plan)
            self._watchdog.published(plan.generation)
            if plan.action == pb.PLAN_ACTION_RUN and self.member is not None and \
                    plans.own_entry(plan, self.member.id) is not None:
                self._ran = True
        log.info("generation %d: %s, world %d (%s)", plan.generation,
                 pb.PlanAction.Name(plan.action), plan.world_size, plan.reason)

    # -- ranks -----------------------------------------------------------------

    def _collective_timeout_s(self) -> float:
        return self.config.collective_timeout_s or self.liveness_timeout_s

    def _rank_env(self, local_rank: int) -> dict[str, str]:
        environ = dict(os.environ)
        environ.update(self.config.extra_env)
        timeout = self._collective_timeout_s()
        environ.update({
            E.LOCAL_RANK: str(local_rank), E.LOCAL_WORLD_SIZE: str(self.config.nproc_per_node),
            E.JOB_ID: self.config.job_id,
            E.COORDINATOR: self.config.coordinator or os.environ.get(E.COORDINATOR, ""),
            E.COLLECTIVE_TIMEOUT_S: str(timeout),
        })
        if self.member is not None:  # a standby learns these when activated
            environ[E.MEMBER_ID] = self.member.id
            environ[E.CONTROL_DIR] = self._publisher.directory
        # Ranks never get the operator token (not even inherited from this
        # agent's environment, nor where its file is): only this member's own
        # credential, which makes only this member's calls
        # (service/transport/credentials.py); a standby, started before the join, is
        # handed it at activation (`_identity`).
        environ.pop(E.TOKEN, None)
        environ.pop(E.TOKEN_FILE, None)
        if self.member is not None and self._member_credential:
            environ[E.TOKEN] = self._member_credential
        if self.config.host.startswith("127.") and "GLOO_SOCKET_IFNAME" not in environ:
            environ["GLOO_SOCKET_IFNAME"] = "lo"
        plan = self._plan
        me = None
        if plan is not None and self.member is not None:
            me = plans.own_entry(plan, self.member.id)
        if plan is not None and me is not None:
            environ.update({E.RANK: str(me.first_rank + local_rank),
                            E.WORLD_SIZE: str(plan.world_size),
                            E.MASTER_ADDR: plan.master_addr,
                            E.MASTER_PORT: str(plan.master_port),
                            E.GENERATION: str(plan.generation)})
        return environ

    def _identity(self) -> dict:
        """What an activated standby learns: known only after joining."""
        assert self.member is not None
        return {"member_id": self.member.id, "control_dir": self._publisher.directory,
                "collective_timeout_s": self._collective_timeout_s(),
                "credential": self._member_credential}

    def _kill_ranks(self) -> None:
        self._runner.kill_all()

    def _report_failure(self, local_rank: int, code: int, reason: str | None = None,
                        pid: int = 0, error: str = "") -> None:
        """Reports a local rank's exit for the generation it was in: the newest
        one the rank process `pid` read (its statistics, `rankstats`), else the
        agent's newest plan (a rank that never read one). Not the agent's plan
        alone: every rank of a job crashing at once is one event, and on a
        loaded machine the second agent's report comes after the first one's
        replan; reported for that new generation, it counted as a second
        failure without progress (`service/policy/failures.py`). `error`: the
        rank's last error line, added to the default reason."""
        assert self.member is not None
        generation = self._plan.generation if self._plan else 0
        stats = rankstats.read_all(self._publisher.directory).get(local_rank) if pid else None
        if stats is not None and stats.get("pid") == pid and stats.get("seen_generation"):
            generation = min(generation, int(stats["seen_generation"]))
        if not reason:
            reason = f"local rank {local_rank} of {self.member.id} exited with status {code}"
            if error:
                reason += f": {error}"
        log.warning("%s; reporting failure", reason)
        self._calls.report_failure(generation, reason)  # a failure: logged, keep going

    # -- main loop -------------------------------------------------------------

    def request_drain(self, reason: str, *, preempted: bool = False) -> None:
        """Starts a drain (idempotent: the first request wins; safe from a
        signal handler). `preempted`: the scheduler is taking the node back
        (Slurm's SIGTERM, a preemption notice), so the job's events record
        the member's departure as ``preempted`` rather than ``drain``."""
        if self._drain_reason is None:
            self._drain_preempted = preempted
            self._drain_reason = reason

    @property
    def drain_requested(self) -> bool:
        """A drain was requested (a signal, a preemption notice), whether or
        not it has run yet."""
        return self._drain_reason is not None

    def run(self) -> int:
        metrics_server = None
        try:
            if self.config.metrics_listen:
                metrics_server = serve_metrics(
                    node_registry(lambda: self._plan, lambda: self._num_restarts,
                                  lambda: getattr(self, "_publisher", None)),
                    self.config.metrics_listen)
                host, port = metrics_server.server_address[:2]
                log.info("metrics on http://%s:%d/metrics", host, port)
            phases = StartupClock()
            self._check_job()
            phases.done("job check")
            self._rank_logs.start()
            self._runner.start(phases)
            log.info("start-up: %s", phases.summary())
            return self._supervise()
        except (JobFinished, DrainedBeforeJoin) as e:
            log.warning("not joining: %s", e)
            return EXIT_OK
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                log.warning("not joining job %s: %s", self.config.job_id, e.details())
                return EXIT_OK
            log.error("cannot join job %s: %s %s", self.config.job_id, e.code().name, e.details())
            return EXIT_ERROR
        except (StartupRefused, RuntimeError) as e:
            log.error("%s", e)
            return EXIT_ERROR
        except OSError as e:
            log.error("--metrics-listen %s: %s", self.config.metrics_listen, e)
            return EXIT_ERROR
        finally:
            if metrics_server is not None:
                metrics_server.shutdown()
            self._stop.set()
            self._kill_ranks()
            self._rank_logs.close()
            self._runner.close()
            shutil.rmtree(self._workdir, ignore_errors=True)

    def _supervise(self) -> int:
        while True:
            if self._fenced.is_set():
                self._kill_ranks()
                if self.config.on_fenced == "exit":
                    log.warning("fenced: ranks stopped, exiting")
                    return EXIT_FENCED
                log.warning("fenced: ranks stopped, joining again as a new member")
                self._runner.start(StartupClock())
            if self._drain_reason is None:
                for source in self.config.preemption:
                    reason = source.poll()
                    if reason:
                        self.request_drain(reason, preempted=True)
                        break
            if self._drain_reason is not None:
                return self._drain()
            status = self._runner.check()
            if status is not None:
                return status
            time.sleep(0.05)

    def _drain(self) -> int:
        assert self.member is not None
        reason = self._drain_reason or "drain"
        log.warning("draining: %s", reason)
        if not self._ran:
            log.warning("this node never trained: stopping its ranks at once")
            self._kill_ranks()
            self._leave(reason, preempted=self._drain_preempted)
            return EXIT_OK
        deadline = time.monotonic() + self.config.drain_timeout_s
        # Before DrainMember: the plan that leaves this node out may arrive at
        # once, and ranks with checkpointing save at the boundary where they
        # see the marker, i.e. no later than where they switch.
        self._publisher.request_drain()
        resp = self._calls.drain_member(reason, preempted=self._drain_preempted)
        if resp is not None and resp.checkpoint:
            log.warning("coordinator asks for a drain checkpoint (no survivor holds "
                        "the state); the ranks write it, then stop")
            self._publisher.request_last_holder_stop()
        self._runner.drain_signal()
        if not wait_until(lambda: self._fenced.is_set() or all(
                p.poll() is not None for p in list(self._runner.ranks.values())),
                timeout_s=deadline - time.monotonic()):
            log.warning("drain deadline of %.0fs passed: killing ranks",
                        self.config.drain_timeout_s)
        self._runner.drained()
        self._kill_ranks()
        self._leave(reason, preempted=self._drain_preempted)
        log.info("drained")
        return EXIT_OK

    def _leave(self, reason: str, *, preempted: bool = False) -> None:
        assert self.member is not None
        self._calls.leave_job(reason, preempted=preempted)


class AgentLink:
    """The `runner.AgentPort` of an agent: all a `RankRunner` sees of it."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    @property
    def config(self) -> AgentConfig:
        return self._agent.config

    @property
    def workdir(self) -> str:
        return self._agent._workdir

    @property
    def rank_logs(self) -> RankLogs:
        return self._agent._rank_logs

    def plan(self) -> pb.Plan | None:
        return self._agent._plan

    def member_id(self) -> str:
        member = self._agent.member
        assert member is not None, "a runner asks for the member after the join"
        return member.id

    def control_dir(self) -> str | None:
        publisher = getattr(self._agent, "_publisher", None)
        return publisher.directory if publisher is not None else None

    def calls(self) -> MemberCalls:
        return self._agent._calls

    def join(self) -> None:
        self._agent._join()

    def identity(self) -> dict:
        return self._agent._identity()

    def rank_env(self, local_rank: int) -> dict[str, str]:
        return self._agent._rank_env(local_rank)

    def drain_reason(self) -> str | None:
        return self._agent._drain_reason

    def fenced(self) -> bool:
        return self._agent._fenced.is_set()

    def hung_ranks(self, running: list[tuple[int, int]]) -> list[tuple[int, str]]:
        return list(self._agent._watchdog.hung(running))

    def report_failure(self, local_rank: int, code: int, reason: str | None = None,
                       pid: int = 0, error: str = "") -> None:
        self._agent._report_failure(local_rank, code, reason, pid=pid, error=error)

    def count_failure(self) -> bool:
        self._agent._num_restarts += 1
        return self._agent._num_restarts > self._agent.config.max_restarts

    def leave(self, reason: str) -> None:
        self._agent._leave(reason)
