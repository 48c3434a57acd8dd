"""Plan-stream notes: every replica's plan streams, told to the leader.

Agents spread their plan streams over the replicas (`planstreams`), but the
peers'-evidence rule (`evidence`) is judged by the leader alone, and one of
its halves is "the agent's plan stream was ended by the agent's side". So
every replica reports each stream it opens and each that ends:

* the stream handlers only append the note to a queue (they run on the
  event loop and never block it); one daemon thread takes the queue in
  order, at most one batch per `flush_s`, and

  * on the leader, hands the batch to the leader's own `PeerLossEvidence`;
  * on a follower, relays it to the leader (``ReportPlanStreams``), with the
    replica credential derived from the operator `token` (the only role
    that call accepts, see `credentials`).

Failure semantics: a batch that cannot be delivered (no leader yet, the
leader unreachable, the call failed) is kept and sent again at the next
flush, before newer notes; notes older than the evidence window
(`window_s`, the liveness timeout) are dropped with a warning — by then the
lease has decided anyway. A leader change loses nothing queued here: the
next flush goes to the new leader (or, if that is this replica, to its own
evidence). What the old leader had been told is gone with it (see
`evidence`). Notes cost one small message per stream opened or ended:
O(membership changes), not O(members x time).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import grpc

from springback.client.channel import DEFAULT_TIMEOUT_S, connect
from springback.client.errors import SpringbackError
from springback.service.transport import credentials
from springback.service.etcd.election import Election
from springback.service.core.evidence import PeerLossEvidence
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

log = logging.getLogger(__name__)

MAX_BATCH = 1000
"""Notes per ReportPlanStreams call (a failover moves every stream at once)."""


class StreamNotes:
    """This replica's plan-stream notes; see the module docstring."""

    def __init__(self, election: Election, evidence: PeerLossEvidence, *, token: str | None,
                 window_s: Callable[[], float], flush_s: float = 0.05) -> None:
        self.election = election
        self.evidence = evidence
        # the leader accepts these notes only from the replica role (`credentials`);
        # without a token, the client certificate (SPRINGBACK_TLS_*) must map to it
        self._credential = credentials.replica_credential(token) if token else ""
        self._window_s = window_s
        self._flush_s = flush_s
        self._serial = itertools.count(1)
        self._queue: deque[tuple[float, ws.PlanStreamNote]] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._channel: tuple[str, grpc.Channel] | None = None
        self.num_relayed = 0
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="stream-notes")
        self._thread.start()

    def opened(self, job_id: str, member_id: str) -> str:
        """Notes a stream of `member_id` opened here; returns its id (for `ended`)."""
        stream_id = f"{self.election.address}/{next(self._serial)}"
        self._note(ws.PlanStreamNote(job_id=job_id, member_id=member_id, stream_id=stream_id,
                                     opened=True))
        return stream_id

    def ended(self, job_id: str, member_id: str, stream_id: str, *, by_client: bool) -> None:
        """Notes that stream `stream_id` ended (`by_client`: from the agent's side)."""
        self._note(ws.PlanStreamNote(job_id=job_id, member_id=member_id, stream_id=stream_id,
                                     by_client=by_client))

    def _note(self, note: ws.PlanStreamNote) -> None:
        if not note.member_id:
            return  # an operator's or a tool's stream: not a member's
        with self._wake:
            self._queue.append((time.monotonic(), note))
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
            self._flush()
            with self._wake:  # at most one call per flush_s; notes gather meanwhile
                self._wake.wait_for(lambda: self._closed, timeout=self._flush_s)

    def _flush(self) -> None:
        self._drop_stale()
        with self._wake:
            batch = [note for _, note in itertools.islice(self._queue, MAX_BATCH)]
        if not batch:
            return
        if self.election.is_leader():
            apply(self.evidence, batch)
        elif not self._send(batch):
            return  # kept: sent again at the next flush
        with self._wake:
            for _ in batch:
                self._queue.popleft()
        self.num_relayed += len(batch)

    def _drop_stale(self) -> None:
        horizon = time.monotonic() - self._window_s()
        with self._wake:
            dropped = 0
            while self._queue and self._queue[0][0] < horizon:
                self._queue.popleft()
                dropped += 1
        if dropped:
            self.num_dropped += dropped
            log.warning("dropped %d plan-stream notes the leader could not be told within "
                        "%.1fs (peers' evidence falls back to the liveness timeout)",
                        dropped, self._window_s())

    def _send(self, batch: list[ws.PlanStreamNote]) -> bool:
        """One ReportPlanStreams call to the leader; False (logged) if it failed."""
        try:
            leader = self.election.leader_address()
        except SpringbackError as e:
            log.debug("plan-stream notes wait for a leader: %s", e)
            return False
        if not leader:
            return False
        if self._channel is None or self._channel[0] != leader:
            if self._channel is not None:
                self._channel[1].close()
            self._channel = (leader, connect([leader], token=self._credential))
        stub = ws_grpc.WorkerServiceStub(self._channel[1])
        try:
            stub.ReportPlanStreams(ws.ReportPlanStreamsRequest(
                replica=self.election.address, notes=batch), timeout=DEFAULT_TIMEOUT_S)
        except grpc.RpcError as e:
            log.debug("relaying %d plan-stream notes to %s: %s", len(batch), leader, e.code())
            return False
        return True

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=5)
        if self._channel is not None:
            self._channel[1].close()


def apply(evidence: PeerLossEvidence, notes: list[ws.PlanStreamNote]) -> None:
    """Hands `notes` (in order) to the leader's evidence."""
    for note in notes:
        if note.opened:
            evidence.stream_opened(note.job_id, note.member_id, note.stream_id)
        else:
            evidence.stream_ended(note.job_id, note.member_id, note.stream_id,
                                  by_client=note.by_client)
