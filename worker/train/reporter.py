"""Step reports from global rank 0 to the coordinator, off the step loop.

`StepReporter.submit` never blocks: it replaces the pending report (only the
newest matters: the coordinator keeps the last step) and a background thread
sends it with a deadline, at most one every `STEP_REPORT_INTERVAL_S` (`flush`
sends the pending one at once: the final step). A report per step cost a
3-rank DDP job of the goodput bench about 1 ms per step (rank 0's reporter
thread takes the GIL in the middle of the next step, and every rank waits for
rank 0 at the gradient all-reduce); the coordinator's view of the step is
then up to that interval old, which `springback job get` shows and the count
of steps redone after a restore with no survivor (the only record of how far
the lost ranks got) can miss. A coordinator that is down or slow costs
nothing but staleness of `springback job get`; failures are logged, counted
and retried with the next report.

`start` reports the state a generation agreed on (once per generation). It
is not replaced by later step reports: it is sent first and retried every
`START_RETRY_S` until the coordinator takes it or fences it, because the
coordinator learns from it which members hold state and how far training
rewound. A FAILED_PRECONDITION, NOT_FOUND or UNAUTHENTICATED (the member
credential revoked) reply means this rank's generation is no longer current
(it was fenced or a new plan exists): the
report is dropped, a start report is not retried, and the training loop learns
of the next plan from its agent (the plan channel), not from here.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import cast

import grpc

from springback.client.channel import connect
from springback.client.workers import MemberCalls
from springback.worker.rank import rendezvous
from springback.worker.train.ranktiming import MemberTimings
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as wpb
from springback.v1 import worker_service_pb2_grpc as wgrpc

log = logging.getLogger(__name__)

REPORT_TIMEOUT_S = 5.0
LOST_PEER_TIMEOUT_S = 2.0
"""Deadline of a lost-peer report: sent on the rank's way out of a broken
generation, so an unreachable coordinator must not hold up its recovery."""
START_RETRY_S = 0.5
STEP_REPORT_INTERVAL_S = 0.25
"""Least time between two step reports (see the module docstring)."""


class StepReporter:
    """Sends the newest ReportStep in the background; see the module docstring."""

    def __init__(self, addresses: str, token: str | None, job_id: str, member_id: str) -> None:
        self._channel = connect(addresses, token=token)
        self._stub = wgrpc.WorkerServiceStub(self._channel)
        self.stub = self._stub  # shared with the checkpoint commit path (its own MemberCalls)
        self.calls = MemberCalls(self._stub, job_id, member_id, timeout_s=REPORT_TIMEOUT_S)
        """This rank's failure reports (below), logged and dropped on error."""
        self._job_id = job_id
        self._member_id = member_id
        self._cond = threading.Condition()
        self._pending: tuple[int, int, int, float, int, int, float, float,
                             tuple[float, float, float], MemberTimings | None] | None = None
        """The newest step report's fields (`submit`), until the thread sends it."""
        self._pending_start: wpb.ReportStepRequest | None = None
        self._in_flight = False
        self._closed = False
        self._flushing = 0  # callers of flush() waiting: send without the interval
        self._next_step_at = 0.0  # monotonic: the next step report goes no earlier
        self.coordinator_generation = 0
        self.accepted: tuple[int, int] = (0, 0)  # (generation, step) of the last report taken
        self._intrusion_taken = 0  # the generation whose store intrusion the coordinator took
        self.num_failures = 0
        self._thread = threading.Thread(target=self._loop, name="springback-reporter",
                                        daemon=True)
        self._thread.start()

    def submit(self, *, generation: int, step: int, samples_consumed: int, loss: float,
               epoch: int, offset: int, checkpoint_stall_s: float = 0.0,
               checkpoint_stall_total_s: float = 0.0,
               step_quantiles: tuple[float, float, float] = (0.0, 0.0, 0.0),
               member_timings: MemberTimings | None = None) -> None:
        """Replaces the pending step report (called at every step by rank 0:
        the request is built by the sending thread, which is woken only when
        no report was pending, i.e. at most once per interval).
        `checkpoint_stall_s`: the newest checkpoint's stall (0: none yet);
        `checkpoint_stall_total_s`: the generation's stalls summed;
        `step_quantiles`: the generation's step time p50, p90, p99 (`steptimes`);
        `member_timings`: every member's step timing, whose medians the
        sending thread computes (`ranktiming`)."""
        report = (generation, step, samples_consumed, loss, epoch, offset, checkpoint_stall_s,
                  checkpoint_stall_total_s, step_quantiles, member_timings)
        with self._cond:
            idle = self._pending is None
            self._pending = report
            if idle:
                self._cond.notify_all()

    def start(self, *, generation: int, step: int, samples_consumed: int, restored_from: int,
              epoch: int, offset: int, state_lost: str = "",
              spans: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> None:
        """Queues the generation-start report (see the module docstring);
        `state_lost` says why the ranks started from scratch although trained
        state existed; `spans`: (startup, rendezvous, transfer) seconds."""
        req = wpb.ReportStepRequest(
            job_id=self._job_id, member_id=self._member_id, generation=generation, step=step,
            samples_consumed=samples_consumed, cursor=pb.DataCursor(epoch=epoch, offset=offset),
            generation_start=True, restored_from=cast(pb.RestoreKind, restored_from),
            state_lost=state_lost, startup_s=spans[0], rendezvous_s=spans[1],
            transfer_s=spans[2])
        with self._cond:
            self._pending_start = req
            self._pending = None  # reports of an older generation are moot
            self._cond.notify_all()

    def flush(self, timeout_s: float = REPORT_TIMEOUT_S) -> bool:
        """Waits until the pending report was sent (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                while (self._pending is not None or self._pending_start is not None
                       or self._in_flight):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
            finally:
                self._flushing -= 1
        return True

    def report_broken(self, generation: int, reason: str, *,
                      storage_unavailable: bool = False) -> bool:
        """Tells the coordinator that `generation` broke on this live rank
        (state kept; see ReportFailureRequest.state_kept), so it is made again
        when no membership change follows; with `storage_unavailable`, that it
        could not start because the store refused its restore past the retry
        budget (the job then waits for storage). One call with a deadline;
        False when it failed (the caller re-sends while it waits for a plan).
        Sent by the calling thread, not queued: the step loop is stopped anyway."""
        resp = self.calls.report_failure(
            generation, reason, state_kept=True, storage_unavailable=storage_unavailable,
            what=f"ReportFailure(generation={generation}, state kept)",
            then="sent again while the rank waits for a plan")
        if resp is None:
            return False
        self.coordinator_generation = max(self.coordinator_generation, resp.generation)
        return True

    def report_lost_peer(self, plan: pb.Plan, *, rank: int, peer: int) -> bool:
        """Tells the coordinator that `rank` saw `peer`, a rank of another
        node, reset its connection in `plan`'s generation
        (worker/train/peerloss.py, service/core/evidence.py). Best effort, never raises:
        one call with a `LOST_PEER_TIMEOUT_S` deadline; a refusal (a stale
        generation: another report already replanned; the peer already
        fenced) or an unreachable coordinator is logged, and the liveness
        timeout still fences a lost node. True when the report was taken."""
        if self.calls.report_failure(
                plan.generation, f"rank {rank} saw rank {peer}'s connection reset",
                lost_peer=True, lost_rank=peer, timeout_s=LOST_PEER_TIMEOUT_S,
                what=f"rank {rank}: report of lost peer rank {peer}",
                then="the liveness timeout fences a lost node") is None:
            return False
        log.warning("rank %d: reported lost peer rank %d", rank, peer)
        return True

    def report_fatal(self, plan: pb.Plan, reason: str) -> bool:
        """Tells the coordinator that the job cannot go on whatever the
        membership (the ranks agreed: `agreement.StateUnrecoverable`); it
        ends the job FAILED with `reason`. Never raises: one call with a
        `LOST_PEER_TIMEOUT_S` deadline; when it is not taken the rank's exit
        is still reported by its agent. True when the report was taken."""
        return self.calls.report_failure(
            plan.generation, reason, job_fatal=True, timeout_s=LOST_PEER_TIMEOUT_S,
            what="fatal report", then="the agent reports the rank's exit") is not None

    def report_pause(self, plan: pb.Plan, reason: str) -> bool:
        """Asks the coordinator to pause the job by its own policy (the
        ranks agreed: too many bad steps, `badstep.BadSteps`), `reason` as
        its message; the member keeps its state. Never raises: one call with
        a `LOST_PEER_TIMEOUT_S` deadline; False when it was not taken (the
        caller asks again at the next bad step)."""
        return self.calls.report_failure(
            plan.generation, reason, state_kept=True, job_pause=True,
            timeout_s=LOST_PEER_TIMEOUT_S, what="pause report",
            then="asked again at the next bad step") is not None

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=1)
        self._channel.close()

    def _next(self) -> wpb.ReportStepRequest | None:
        """The report to send next (the start report first); None once closed."""
        with self._cond:
            while not self._closed:
                if self._pending_start is not None:
                    self._in_flight = True
                    return self._pending_start
                wait_s = self._next_step_at - time.monotonic()
                if self._pending is not None and (wait_s <= 0 or self._flushing):
                    self._in_flight = True
                    self._next_step_at = time.monotonic() + STEP_REPORT_INTERVAL_S
                    report, self._pending = self._pending, None
                    return self._request(*report)
                self._cond.wait(wait_s if self._pending is not None else None)
            return None

    def _request(self, generation: int, step: int, samples_consumed: int, loss: float,
                 epoch: int, offset: int, stall_s: float, stall_total_s: float,
                 quantiles: tuple[float, float, float],
                 timings: MemberTimings | None) -> wpb.ReportStepRequest:
        return wpb.ReportStepRequest(
            job_id=self._job_id, member_id=self._member_id, generation=generation, step=step,
            samples_consumed=samples_consumed, loss=loss,
            cursor=pb.DataCursor(epoch=epoch, offset=offset), checkpoint_stall_s=stall_s,
            checkpoint_stall_total_s=stall_total_s, step_p50_s=quantiles[0],
            step_p90_s=quantiles[1], step_p99_s=quantiles[2],
            member_timing=timings.report() if timings is not None else [],
            store_intrusion=(rendezvous.store_intrusion(generation)
                             if self._intrusion_taken != generation else ""))

    def _loop(self) -> None:
        while (req := self._next()) is not None:
            retry = False
            try:
                resp = self._stub.ReportStep(req, timeout=REPORT_TIMEOUT_S)
                self.coordinator_generation = resp.generation
                if not req.generation_start:
                    self.accepted = (req.generation, req.step)
                if req.store_intrusion:
                    self._intrusion_taken = req.generation
            except grpc.RpcError as e:
                fenced = e.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                      grpc.StatusCode.NOT_FOUND,
                                      grpc.StatusCode.UNAUTHENTICATED)
                retry = req.generation_start and not fenced
                self.num_failures += 1
                log.warning("ReportStep(step=%d, generation=%d%s) failed: %s %s", req.step,
                            req.generation, ", start" if req.generation_start else "",
                            e.code().name, e.details())
            finally:
                with self._cond:
                    if req is self._pending_start and not retry:
                        self._pending_start = None
                    self._in_flight = False
                    self._cond.notify_all()
            if retry:
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, timeout=START_RETRY_S)
