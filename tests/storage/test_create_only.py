"""Checkpoints are namespaced per job and commits are create-only: a committed
directory is never written again, and of two writers of one checkpoint exactly
one commits while the other fails naming the directory (issue 7, bug 2)."""

from __future__ import annotations

import threading
import uuid
from types import SimpleNamespace

import pytest
import torch

from springback.storage import (
    Checkpointer,
    CheckpointExists,
    committed_checkpoints,
    job_checkpoint_uri,
    restore,
    verify,
)
from springback.storage.store import ObjectStore
from springback.v1 import types_pb2 as pb
from springback.worker.train.checkpointing import GenerationCheckpoints

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _weights(seed: float) -> dict:
    return {"w": torch.full((64, 8), float(seed)), "b": torch.full((8,), float(seed))}


class TestTwoJobsOnOneUri:
    @pytest.mark.parametrize("scheme", ["file", "memory"])
    def test_the_same_spec_submitted_twice_keeps_each_jobs_commits_apart(self, scheme, tmp_path):
        uri = f"file://{tmp_path}/ck" if scheme == "file" else f"memory://ck-{uuid.uuid4().hex[:8]}"
        models = {}
        for job_id, seed in (("job-one", 1.0), ("job-two", 2.0)):
            model = torch.nn.Linear(8, 4)
            torch.nn.init.constant_(model.weight, seed)
            plan = pb.Plan(job_id=job_id, generation=2, world_size=1)
            plan.spec.checkpoint.uri = uri
            plan.spec.checkpoint.every_steps = 10
            session = SimpleNamespace(state={"model": model}, reporter=None,
                                      env=SimpleNamespace(job_id=job_id))
            gc = GenerationCheckpoints(ctx=session, plan=plan, rank=0)
            assert gc.save(10, (0, 120), wait=True)  # same step, same generation
            gc.close(wait_for_commit=True)
            models[job_id] = model
        for job_id, model in models.items():
            (ckpt,) = committed_checkpoints(job_checkpoint_uri(uri, job_id))
            assert ckpt.uri == f"{uri}/{job_id}/step-00000010-g2"
            assert verify(ckpt.uri) == []
            out = {"model": {"weight": torch.zeros(4, 8), "bias": torch.zeros(4)}}
            restore(job_checkpoint_uri(uri, job_id), out)
            assert torch.equal(out["model"]["weight"], model.weight.detach())

    def test_a_job_id_that_is_not_one_path_segment_is_refused(self):
        for bad in ("", "a/b", ".."):
            with pytest.raises(ValueError, match="job id"):
                job_checkpoint_uri("file:///ck", bad)


class TestCreateOnly:
    def test_a_committed_checkpoint_is_never_written_again(self, base_uri):
        first = Checkpointer(base_uri, rank=0, world_size=1)
        info = first.save(5, _weights(1), generation=1).result(timeout=60)
        first.close()
        before = {f.path: f.crc32 for f in info.manifest.files}
        errors: list[BaseException] = []
        second = Checkpointer(base_uri, rank=0, world_size=1, on_error=errors.append)
        with pytest.raises(CheckpointExists, match=r"step-00000005-g1 is already committed"):
            second.save(5, _weights(2), generation=1).result(timeout=60)
        second.close()
        assert len(errors) == 1 and second.stats.failed == 1
        assert verify(info.uri) == []
        (again,) = committed_checkpoints(base_uri)
        assert {f.path: f.crc32 for f in again.manifest.files} == before
        out = _weights(0)
        restore(base_uri, out)
        assert torch.equal(out["w"], _weights(1)["w"])

    def test_of_two_concurrent_writers_of_one_step_exactly_one_commits(self, base_uri):
        # both pass the "not committed yet" check before either claims its rank
        both_checked = threading.Barrier(2, timeout=30)

        class Racing(ObjectStore):
            def put_bytes(self, uri, data, **kw):
                if uri.endswith(".claim"):
                    both_checked.wait()
                return super().put_bytes(uri, data, **kw)

        writers = [Checkpointer(base_uri, rank=0, world_size=1, store=Racing(base_uri)) for _ in range(2)]
        futures = [w.save(7, _weights(10 + i), generation=3) for i, w in enumerate(writers)]
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result(timeout=60))
            except CheckpointExists as exc:
                outcomes.append(exc)
        for w in writers:
            w.close()
        won = [o for o in outcomes if not isinstance(o, BaseException)]
        lost = [o for o in outcomes if isinstance(o, CheckpointExists)]
        assert len(won) == 1 and len(lost) == 1, outcomes
        assert "already claimed by another writer" in str(lost[0]) and "step-00000007-g3" in str(lost[0])
        assert verify(won[0].uri) == []
        winner = outcomes.index(won[0])
        out = _weights(0)
        restore(base_uri, out)
        assert torch.equal(out["w"], _weights(10 + winner)["w"])
