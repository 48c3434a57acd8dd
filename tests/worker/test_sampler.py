"""Unit tests: the sample stream and the exactly-once audit across reshards."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from springback.worker.train.audit import AuditLog, check_exactly_once
from springback.worker.train.sampler import SampleStream


class TestStepShards:
    def test_shards_of_a_step_partition_the_global_batch_for_any_world_size(self):
        stream = SampleStream(num_samples=50, global_batch_size=7, seed=3)
        for world in range(1, 10):
            got = np.concatenate([stream.batch(4, world, r).indices for r in range(world)])
            assert sorted(got.tolist()) == sorted(stream.batch(4, 1, 0).indices.tolist())

    def test_shard_sizes_differ_by_at_most_one(self):
        stream = SampleStream(num_samples=100, global_batch_size=10)
        sizes = [len(stream.batch(1, 3, r).indices) for r in range(3)]
        assert sizes == [4, 3, 3]

    def test_loss_scale_makes_ddp_average_the_global_mean(self):
        stream = SampleStream(num_samples=100, global_batch_size=10)
        batches = [stream.batch(1, 3, r) for r in range(3)]
        # DDP: mean over ranks of (scale * local sum) == global mean
        per_sample = {i: float(i) for i in range(100)}
        ddp = np.mean([b.loss_scale * sum(per_sample[int(i)] for i in b.indices) for b in batches])
        full = np.mean([per_sample[int(i)] for b in batches for i in b.indices])
        assert ddp == pytest.approx(full)

    def test_a_step_straddling_an_epoch_takes_the_tail_then_the_next_head(self):
        stream = SampleStream(num_samples=10, global_batch_size=4)
        b = stream.batch(3, 1, 0)  # positions 8..11
        assert b.epochs.tolist() == [0, 0, 1, 1]
        assert b.indices[:2].tolist() == stream.permutation(0)[8:].tolist()
        assert b.indices[2:].tolist() == stream.permutation(1)[:2].tolist()

    def test_epochs_are_different_permutations(self):
        stream = SampleStream(num_samples=64, global_batch_size=8, seed=1)
        assert stream.permutation(0).tolist() != stream.permutation(1).tolist()
        assert sorted(stream.permutation(1).tolist()) == list(range(64))

    def test_bad_spec_names_the_field(self):
        with pytest.raises(ValueError, match="global_batch_size"):
            SampleStream(num_samples=10, global_batch_size=0)


# A generation: (world size, steps it completes, whether it breaks mid-step with a
# partial set of ranks having taken the next batch, whether some rank finished it).
generation_st = st.tuples(st.integers(1, 6), st.integers(0, 5), st.booleans(), st.booleans())


class TestExactlyOnceAcrossReshards:
    @settings(max_examples=60, deadline=None)
    @given(num_samples=st.integers(5, 40), batch=st.integers(1, 12), seed=st.integers(0, 9),
           generations=st.lists(generation_st, min_size=1, max_size=6),
           final_world=st.integers(1, 6))
    def test_any_sequence_of_reshards_and_failures_consumes_each_index_once(
            self, tmp_path_factory, num_samples, batch, seed, generations, final_world):
        audit = str(tmp_path_factory.mktemp("audit"))
        stream = SampleStream(num_samples=num_samples, global_batch_size=batch, seed=seed)
        step, gen = 0, 0
        for world, steps, breaks, finished in generations:
            gen += 1
            for _ in range(steps):
                step += 1
                for r in range(world):
                    log = AuditLog(audit, gen, r)
                    log.record(stream.batch(step, world, r))
                    log.close()
            if breaks:  # some ranks took the next batch, then a peer died
                for r in range(0, world, 2):
                    log = AuditLog(audit, gen, r)
                    log.record(stream.batch(step + 1, world, r))
                    log.close()
                if finished and world == 1:
                    step += 1  # the only rank finished it: survivors resume after it
        gen += 1
        last = step + 3
        for s in range(step + 1, last + 1):
            for r in range(final_world):
                log = AuditLog(audit, gen, r)
                log.record(stream.batch(s, final_world, r))
                log.close()
        report = check_exactly_once(audit, num_samples=num_samples,
                                    global_batch_size=batch, last_step=last)
        assert report.ok, report
        assert report.samples == last * batch

    def test_the_audit_catches_a_step_trained_twice_with_different_samples(self, tmp_path):
        stream = SampleStream(num_samples=8, global_batch_size=4)
        log = AuditLog(str(tmp_path), 1, 0)
        log.record(stream.batch(1, 1, 0))
        log.record(stream.batch(1, 1, 0).__class__(
            step=2, indices=stream.batch(1, 1, 0).indices, epochs=stream.batch(1, 1, 0).epochs,
            global_batch_size=4, world_size=1))
        log.close()
        report = check_exactly_once(str(tmp_path), num_samples=8, global_batch_size=4,
                                    last_step=2)
        assert not report.ok
        assert report.duplicates and report.missing

    def test_the_audit_catches_a_missing_shard(self, tmp_path):
        stream = SampleStream(num_samples=8, global_batch_size=4)
        log = AuditLog(str(tmp_path), 1, 0)
        log.record(stream.batch(1, 2, 0))  # rank 1's half never recorded
        log.close()
        report = check_exactly_once(str(tmp_path), num_samples=8, global_batch_size=4,
                                    last_step=1)
        assert report.missing_steps == [1]

    def test_tp_and_pp_peers_of_a_dp_rank_count_once_unless_their_batch_differs(self, tmp_path):
        """World 8 = pp 2 x dp 2 x tp 2: every dp rank's batch is recorded by
        its four peers; the check counts it once. A peer that took another
        dp rank's batch shows as duplicates."""
        stream = SampleStream(num_samples=16, global_batch_size=4)
        dp_rank_of = [0, 0, 1, 1, 0, 0, 1, 1]  # pp outermost, then dp, then tp
        for rank, dp in enumerate(dp_rank_of):
            log = AuditLog(str(tmp_path / "same"), 1, rank, dp)
            for step in (1, 2):
                log.record(stream.batch(step, 2, dp))
            log.close()
        report = check_exactly_once(str(tmp_path / "same"), num_samples=16, global_batch_size=4,
                                    last_step=2)
        assert report.ok, report
        assert report.samples == 8
        for rank, dp in enumerate(dp_rank_of):
            log = AuditLog(str(tmp_path / "other"), 1, rank, dp)
            log.record(stream.batch(1, 2, 1 - dp if rank == 5 else dp))  # rank 5: dp 1's batch
            log.close()
        report = check_exactly_once(str(tmp_path / "other"), num_samples=16, global_batch_size=4,
                                    last_step=1)
        assert not report.ok and report.duplicates
