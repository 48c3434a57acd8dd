"""A rank restores only a checkpoint in its own job's directory.

The coordinator refuses to record a commit outside
``<checkpoint.uri>/<job id>/<name>``; a record written straight into etcd
never passed that check, so the rank checks the plan's checkpoint URI again
before its restore hook reads anything (`agreement.outside_job`). No cluster:
the agreement's restore decision with a recording hook and reporter."""

from __future__ import annotations

import types

import pytest
from springback.v1 import types_pb2 as pb
from springback.worker.rank.heldstate import HeldState
from springback.worker.train.agreement import StateAgreement, StateUnrecoverable

BASE = "s3://shared/ckpt"


class Reporter:
    def __init__(self) -> None:
        self.fatal: list[str] = []

    def report_fatal(self, plan: pb.Plan, reason: str) -> bool:
        self.fatal.append(reason)
        return True


def agreement(job_id: str = "j-mine") -> tuple[StateAgreement, list[str], Reporter]:
    read: list[str] = []

    def hook(ref: pb.CheckpointRef, state: dict) -> int:
        read.append(ref.uri)  # the real hook reads (and unpickles) from here on
        return int(ref.step)

    reporter = Reporter()
    ctx = types.SimpleNamespace(env=types.SimpleNamespace(job_id=job_id), state={},
                                reporter=reporter, held=HeldState(clean=True))
    return StateAgreement(ctx, hook, None), read, reporter  # type: ignore[arg-type]


def plan(uri: str, kind: int = pb.RESTORE_KIND_CHECKPOINT, base: str = BASE) -> pb.Plan:
    return pb.Plan(job_id="j-mine", generation=3,
                   spec=pb.JobSpec(checkpoint=pb.CheckpointSpec(uri=base)),
                   restore=pb.RestoreSource(kind=kind, checkpoint=pb.CheckpointRef(
                       step=20, uri=uri)))


@pytest.mark.parametrize("uri", [
    f"{BASE}/j-other/step-20-g1",            # another job sharing the checkpoint.uri
    f"{BASE}/j-mine/../j-other/step-20-g1",  # a way out through '..'
    f"{BASE}/j-mine/logs/m-1",               # below the job's directory, not one name in it
    "file:///etc/step-20-g1",                # anywhere else
])
@pytest.mark.parametrize("kind", [pb.RESTORE_KIND_CHECKPOINT, pb.RESTORE_KIND_PEERS])
def test_a_restore_outside_the_job_s_directory_is_refused_before_reading(uri, kind):
    agree, read, reporter = agreement()
    with pytest.raises(StateUnrecoverable) as refused:
        agree.restore_if_newer(plan(uri, kind), best=-1)  # no rank holds state
    assert read == []  # nothing was read
    message = str(refused.value)
    assert repr(uri) in message and repr(f"{BASE}/j-mine") in message
    assert reporter.fatal == [message]  # the job fails at once, saying why
    assert agree.ctx.held.state_step == -1


def test_a_checkpoint_in_the_job_s_directory_is_restored():
    agree, read, reporter = agreement()
    assert agree.restore_if_newer(plan(f"{BASE}/j-mine/step-20-g1"), best=-1)
    assert read == [f"{BASE}/j-mine/step-20-g1"] and reporter.fatal == []
    assert agree.ctx.held.state_step == 20


def test_without_a_checkpoint_uri_in_the_spec_nothing_is_checked():
    agree, read, _ = agreement()  # as the coordinator: no base, no rule
    assert agree.restore_if_newer(plan("file:///elsewhere/step-20-g1", base=""), best=-1)
    assert read == ["file:///elsewhere/step-20-g1"]


def test_the_job_id_comes_from_the_environment_when_the_plan_has_none():
    agree, read, _ = agreement("j-env")
    p = plan(f"{BASE}/j-env/step-20-g1")
    p.job_id = ""
    assert agree.restore_if_newer(p, best=-1) and read == [f"{BASE}/j-env/step-20-g1"]
