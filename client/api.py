"""`springback.Client`: the job-control API for Python programs.

Every call has a deadline (``timeout_s``, default 10 s). Reads and idempotent
writes are retried on UNAVAILABLE by the channel (e.g. during a leader
failover); `create_job` is not, since a retry after a lost reply could create
the job twice. Failures raise `ApiError` carrying the gRPC status code and
the server's message (which names the bad field for INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc

from springback.client import spec as specs
from springback.client.channel import DEFAULT_TIMEOUT_S, connect
from springback.client.errors import InvalidArgument
from springback.v1 import job_service_pb2 as js
from springback.v1 import job_service_pb2_grpc as js_grpc
from springback.v1 import types_pb2 as pb


class ApiError(Exception):
    """A call failed; `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidSpec(ApiError, ValueError):
    """A spec refused before sending (INVALID_ARGUMENT); `field` names the bad field."""

    def __init__(self, field: str, details: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, details)
        self.field = field


def _call(fn: Any, request: Any, timeout_s: float) -> Any:
    try:
        return fn(request, timeout=timeout_s)
    except grpc.RpcError as e:
        raise ApiError(e.code(), e.details() or "") from None


class Client:
    """A connection to the coordinator replicas (`addresses` or $SPRINGBACK_COORDINATOR)."""

    def __init__(
        self,
        addresses: str | Sequence[str] | None = None,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._channel = connect(addresses, token=token, tls_ca=tls_ca, tls_cert=tls_cert,
                                tls_key=tls_key)
        self._stub = js_grpc.JobServiceStub(self._channel)
        self.timeout_s = timeout_s

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_job(self, spec: pb.JobSpec | Mapping[str, Any] | str) -> pb.Job:
        """Submits a job: a `JobSpec`, a spec mapping, or a YAML/JSON file path.

        A local spec is validated before sending: a bad one raises `InvalidSpec`
        (an `ApiError` with code INVALID_ARGUMENT, the message naming the field)
        and sends nothing.
        """
        try:
            if isinstance(spec, str):
                spec = specs.load_spec_file(spec)
            elif not isinstance(spec, pb.JobSpec):
                spec = specs.spec_from_dict(spec)
        except InvalidArgument as e:
            raise InvalidSpec(e.field, str(e)) from None
        return _call(self._stub.CreateJob, js.CreateJobRequest(spec=spec), self.timeout_s).job

    def get_job(self, job_id: str) -> pb.Job:
        return _call(self._stub.GetJob, js.GetJobRequest(job_id=job_id), self.timeout_s).job

    def list_jobs(self) -> list[pb.Job]:
        return list(_call(self._stub.ListJobs, js.ListJobsRequest(), self.timeout_s).jobs)

    def scale_job(self, job_id: str, min_workers: int, max_workers: int) -> pb.Job:
        request = js.ScaleJobRequest(job_id=job_id, min_workers=min_workers, max_workers=max_workers)
        return _call(self._stub.ScaleJob, request, self.timeout_s).job

    def pause_job(self, job_id: str) -> pb.Job:
        return _call(self._stub.PauseJob, js.PauseJobRequest(job_id=job_id), self.timeout_s).job

    def resume_job(self, job_id: str) -> pb.Job:
        return _call(self._stub.ResumeJob, js.ResumeJobRequest(job_id=job_id), self.timeout_s).job

    def cancel_job(self, job_id: str) -> pb.Job:
        return _call(self._stub.CancelJob, js.CancelJobRequest(job_id=job_id), self.timeout_s).job

    def list_checkpoints(self, job_id: str) -> list[pb.CheckpointRef]:
        request = js.ListCheckpointsRequest(job_id=job_id)
        return list(_call(self._stub.ListCheckpoints, request, self.timeout_s).checkpoints)

    def restore_job(self, job_id: str, step: int = 0) -> pb.Job:
        """Next generation restores the committed checkpoint at `step` (0: newest)."""
        request = js.RestoreJobRequest(job_id=job_id, step=step)
        return _call(self._stub.RestoreJob, request, self.timeout_s).job

    def list_job_events(self, job_id: str) -> tuple[pb.Job, list[js.GenerationEvent]]:
        """The job and its generations, oldest first (finished jobs too)."""
        response = _call(self._stub.ListJobEvents, js.ListJobEventsRequest(job_id=job_id),
                         self.timeout_s)
        return response.job, list(response.generations)

    def issue_join_credential(self, job_id: str) -> str:
        """The job's join credential for its agents (``springback run --token``):
        it joins and reads that job only. Operators only; NOT_FOUND for an
        unknown job, FAILED_PRECONDITION when the coordinator has no token."""
        request = js.IssueJoinCredentialRequest(job_id=job_id)
        return _call(self._stub.IssueJoinCredential, request, self.timeout_s).credential

    def delete_job(self, job_id: str) -> pb.Job:
        """Forgets a finished job (not its checkpoint files); returns its last record.
        FAILED_PRECONDITION while it is live; NOT_FOUND once deleted."""
        request = js.DeleteJobRequest(job_id=job_id)
        return _call(self._stub.DeleteJob, request, self.timeout_s).job

    def watch_job(self, job_id: str, timeout_s: float | None = None) -> Iterator[tuple[pb.Job, str]]:
        """(job, event) now and after each change, until the job ends or `timeout_s`."""
        stream = self._stub.WatchJob(js.WatchJobRequest(job_id=job_id), timeout=timeout_s)
        try:
            for response in stream:
                yield response.job, response.event
        except grpc.RpcError as e:
            raise ApiError(e.code(), e.details() or "") from None
        finally:
            stream.cancel()
