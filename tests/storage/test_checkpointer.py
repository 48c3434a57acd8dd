"""Checkpointer, commit protocol, catalog and restore, with several ranks in one process
(each rank a Checkpointer with its own background thread) on real files, memory:// and
a real S3 server."""

from __future__ import annotations

import json
import os
import pickle
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from springback.storage import (
    Checkpointer,
    CheckpointNotFound,
    CommitTimeout,
    CorruptCheckpoint,
    clean_partial,
    list_checkpoints,
    prune_to_record,
    restore,
    verify,
)
from sbtest import wait_for
from springback.storage import StorageError
from springback.storage.checkpointer import WRITER_NICE
from springback.storage.commit import record_name
from springback.storage.manifest import MANIFEST_NAME
from springback.storage.store import ObjectStore, join, resolve_storage_options

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w1": torch.randn(64, 32, generator=g),
            "b1": torch.randn(64, generator=g),
            "w2": torch.randn(8, 64, generator=g, dtype=torch.float64),
            "emb": torch.randint(0, 1000, (50, 3), generator=g),
        },
        "step_count": seed,
        "meta": {"lr": 0.1 * seed, "names": ["a", "b"]},
    }


def zeros_like_state(sd: dict) -> dict:
    if isinstance(sd, dict):
        return {k: zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, list):
        return [zeros_like_state(v) for v in sd]
    return type(sd)() if not isinstance(sd, (int, float)) else 0


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_state_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def save_all_ranks(base: str, step: int, sd_per_rank: list[dict], *, generation: int = 1,
                   holders=None, **kw) -> list:  # noqa: ANN001
    """Every rank saves; returns the futures' results, rank 0 first."""
    world = len(sd_per_rank)
    ckpts = [Checkpointer(base, rank=r, world_size=world, commit_timeout_s=30, poll_interval_s=0.02, **kw) for r in range(world)]
    futs = [c.save(step, sd_per_rank[r], generation=generation, cursor=(2, 17 * step), layout={"dp": world},
                   holders=holders) for r, c in enumerate(ckpts)]
    out = [f.result(timeout=60) for f in futs]
    for c in ckpts:
        c.close()
    return out


class TestCommitProtocol:
    def test_two_ranks_commit_one_manifest_listing_every_shard(self, base_uri):
        sd = make_state(1)
        info, rec1 = save_all_ranks(base_uri, 10, [sd, sd])
        m = info.manifest
        assert (m.step, m.generation, m.world_size) == (10, 1, 2)
        assert (m.cursor.epoch, m.cursor.offset) == (2, 170)
        assert m.layout == {"dp": 2}
        paths = {f.path for f in m.files}
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", record_name(0), record_name(1)} <= paths
        assert m.versions["torch"] == torch.__version__
        assert verify(info.uri) == []
        ref = info.to_checkpoint_ref()
        assert (ref.step, ref.uri, ref.world_size, ref.size_bytes) == (10, info.uri, 2, m.size_bytes)
        assert (ref.cursor.epoch, ref.cursor.offset) == (2, 170)

    def test_replicated_tensors_are_split_between_ranks_not_duplicated(self, base_uri):
        sd = make_state(2)
        info, rec1 = save_all_ranks(base_uri, 1, [sd, sd])
        rank1_fqns = {i.index.fqn for i in rec1.items}
        rec0 = pickle.loads(ObjectStore(base_uri).get_bytes(join(info.uri, record_name(0))))
        rank0_fqns = {i.index.fqn for i in rec0.items}
        assert rank0_fqns and rank1_fqns and not (rank0_fqns & rank1_fqns)
        assert rank0_fqns | rank1_fqns == {"model.w1", "model.b1", "model.w2", "model.emb", "step_count", "meta.lr", "meta.names"}

    def test_stages_with_different_plain_entries_commit_only_when_they_name_their_holders(
            self, base_uri):
        """Two pipeline stages, two replicas each: stage 0 holds `s0`, stage 1
        `s1`. Without `holders` the world-wide assignment would give some of a
        stage's entries to the other stage's ranks, which do not have them: the
        commit is refused, naming an entry, instead of committing a checkpoint
        that lacks it; with `holders` every entry is written by one of its own."""
        from springback.storage.snapshot import plain_entries

        stages = [{"s0": {f"w{i}": torch.full((64,), float(i)) for i in range(4)}},
                  {"s1": {f"w{i}": torch.full((64,), 10.0 + i) for i in range(4)}}]
        per_rank = [stages[0], stages[0], stages[1], stages[1]]
        with pytest.raises(ValueError, match=r"no rank wrote s\d\.w\d.*must pass `holders`"):
            save_all_ranks(base_uri, 1, per_rank)
        assert [c.state for c in list_checkpoints(base_uri)] == ["partial"]
        holders = {fqn: (size, (2 * s, 2 * s + 1)) for s in (0, 1)
                   for fqn, size in plain_entries(stages[s]).items()}
        info = save_all_ranks(base_uri, 2, per_rank, holders=holders)[0]
        out = {"s0": zeros_like_state(stages[0]["s0"]), "s1": zeros_like_state(stages[1]["s1"])}
        assert restore(base_uri, out).step == info.manifest.step == 2
        assert_state_equal(out, {**stages[0], **stages[1]})

    def test_plain_dcp_load_reads_the_checkpoint(self, base_uri):
        sd = make_state(3)
        info, _ = save_all_ranks(base_uri, 3, [sd, sd])
        out = zeros_like_state(sd)
        if base_uri.startswith("file://"):
            dcp.load(out, storage_reader=dcp.FileSystemReader(info.uri.removeprefix("file://")))
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            dcp.load(out, storage_reader=FsspecReader(info.uri, **resolve_storage_options(info.uri, None)))
        assert_state_equal(out, sd)

    def test_dcp_format_utils_convert_it_back_to_the_nested_state_dict(self, tmp_path):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        sd = make_state(30)
        info, _ = save_all_ranks(str(tmp_path / "ck"), 1, [sd, sd])
        dcp_to_torch_save(info.uri, tmp_path / "full.pt")
        assert_state_equal(torch.load(tmp_path / "full.pt", weights_only=False), sd)

    def test_restore_at_any_world_size_is_bit_identical_and_returns_the_cursor(self, base_uri):
        sd = make_state(4)
        save_all_ranks(base_uri, 4, [sd, sd, sd])
        out = zeros_like_state(sd)
        result = restore(base_uri, out)
        assert_state_equal(out, sd)
        assert result.step == 4 and (result.manifest.cursor.epoch, result.manifest.cursor.offset) == (2, 68)

    def test_a_rank_that_never_writes_makes_the_commit_time_out_and_leaves_it_partial(self, base_uri):
        sd = make_state(5)
        save_all_ranks(base_uri, 1, [sd, sd])
        errors = []
        c0 = Checkpointer(base_uri, rank=0, world_size=2, commit_timeout_s=0.5, poll_interval_s=0.02, on_error=errors.append)
        fut = c0.save(2, sd, generation=1)
        with pytest.raises(CommitTimeout) as exc:
            fut.result(timeout=30)
        assert exc.value.missing_ranks == [1]
        assert len(errors) == 1 and c0.stats.failed == 1 and "ranks [1]" in c0.stats.last_error
        states = {(c.step, c.state) for c in list_checkpoints(base_uri)}
        assert states == {(1, "committed"), (2, "partial")}
        out = zeros_like_state(sd)
        assert restore(base_uri, out).step == 1
        c0.close()

    def test_an_abandoned_checkpoint_that_cannot_commit_is_counted_abandoned_not_failed(self, base_uri):
        """Its generation broke: the dead peer's shard never comes and the
        partial directory is cleaned up under the committer. That is no
        checkpoint error for the job."""
        sd = make_state(5)
        save_all_ranks(base_uri, 1, [sd, sd])
        errors = []
        c0 = Checkpointer(base_uri, rank=0, world_size=2, commit_timeout_s=0.5, poll_interval_s=0.02,
                          on_error=errors.append)
        fut = c0.save(2, sd, generation=1)
        c0.abandon()
        with pytest.raises(CommitTimeout):
            fut.result(timeout=30)
        assert (c0.stats.abandoned, c0.stats.failed, errors) == (1, 0, [])
        assert "ranks [1]" in c0.stats.last_error
        out = zeros_like_state(sd)
        assert restore(base_uri, out).step == 1
        c0.close()


    def test_a_committer_whose_directory_is_deleted_fails_at_once_instead_of_waiting(self, base_uri):
        errors = []
        c0 = Checkpointer(base_uri, rank=0, world_size=2, commit_timeout_s=300, poll_interval_s=0.02,
                          on_error=errors.append)
        fut = c0.save(3, make_state(6), generation=1)
        ckpt_uri = join(base_uri, "step-00000003-g1")
        store = ObjectStore(base_uri)
        wait_for(lambda: store.exists(join(ckpt_uri, record_name(0))), 30, "rank 0's done-record")
        store.rm_tree(ckpt_uri)  # e.g. a cleanup that wrongly took it for dead
        with pytest.raises(StorageError, match=r"ranks \[0\] disappeared"):
            fut.result(timeout=30)  # not after commit_timeout_s
        assert len(errors) == 1
        c0.close()


class TestCommitHookAndRng:
    def test_on_commit_gets_the_checkpoint_ref_and_a_failing_hook_counts_as_a_failure(self, tmp_path):
        base = str(tmp_path / "ck")
        seen = []
        c = Checkpointer(base, rank=0, world_size=1, on_commit=lambda info: seen.append(info.to_checkpoint_ref()))
        c.save(1, make_state(20), generation=4, cursor=(3, 9)).result(timeout=30)
        assert [(r.step, r.generation, r.cursor.epoch, r.cursor.offset) for r in seen] == [(1, 4, 3, 9)]

        def reject(info):
            raise RuntimeError("stale generation")

        errors = []
        c2 = Checkpointer(base, rank=0, world_size=1, on_commit=reject, on_error=errors.append)
        with pytest.raises(RuntimeError, match="stale generation"):
            c2.save(2, make_state(21), generation=4).result(timeout=30)
        assert c2.stats.failed == 1 and c2.stats.committed == 0 and len(errors) == 1
        c.close()
        c2.close()

    def test_restore_rng_resumes_the_random_stream_of_the_saving_rank(self, tmp_path):
        base = str(tmp_path / "ck")
        torch.manual_seed(7)
        c = Checkpointer(base, rank=0, world_size=1)
        sd = make_state(22)
        c.save(1, sd, generation=1).result(timeout=30)
        expected = torch.rand(5)
        torch.manual_seed(999)
        restore(base, zeros_like_state(sd), restore_rng=True)
        assert torch.equal(torch.rand(5), expected)
        c.close()


class TestOverlapPolicy:
    def _blocked_store(self, base_uri: str, release: threading.Event, entered: threading.Event) -> ObjectStore:
        class Gated(ObjectStore):
            def write_file(self, uri, produce):
                entered.set()
                assert release.wait(30)
                return super().write_file(uri, produce)

        return Gated(base_uri)

    def test_skip_policy_skips_and_counts_while_a_save_is_in_flight(self, base_uri):
        release, entered = threading.Event(), threading.Event()
        c = Checkpointer(base_uri, rank=0, world_size=1, policy="skip", store=self._blocked_store(base_uri, release, entered))
        sd = make_state(6)
        first = c.save(1, sd, generation=1)
        assert entered.wait(30)
        assert c.save(2, sd, generation=1) is None
        assert c.stats.skipped == 1
        release.set()
        assert first.result(timeout=30).manifest.step == 1
        assert [x.step for x in list_checkpoints(base_uri)] == [1]
        c.close()

    def test_block_policy_waits_for_the_previous_save_and_writes_both(self, base_uri):
        release, entered = threading.Event(), threading.Event()
        c = Checkpointer(base_uri, rank=0, world_size=1, policy="block", store=self._blocked_store(base_uri, release, entered))
        sd = make_state(7)
        c.save(1, sd, generation=1)
        assert entered.wait(30)
        threading.Timer(0.2, release.set).start()
        second = c.save(2, sd, generation=1)  # blocks until the first finished
        assert c.stats.last_stall_s >= 0.1
        assert second.result(timeout=30).manifest.step == 2
        assert [(x.step, x.state) for x in list_checkpoints(base_uri)] == [(1, "committed"), (2, "committed")]
        c.close()

    def test_snapshot_is_taken_at_save_time_and_staging_buffers_are_reused(self, base_uri):
        c = Checkpointer(base_uri, rank=0, world_size=1)
        sd = make_state(8)
        expected = {k: v.clone() for k, v in sd["model"].items()}
        c.save(1, sd, generation=1)
        for v in sd["model"].values():  # mutate right after save() returned
            v.add_(1)
        c.wait(30)
        buffers = dict(c._staging._buffers)
        c.save(2, sd, generation=1)
        c.wait(30)
        assert all(c._staging._buffers[k] is buffers[k] for k in buffers)
        out = zeros_like_state(make_state(8))
        restore(base_uri, out, step=1)
        assert_state_equal(out["model"], expected)
        c.close()


    def test_saving_the_same_step_again_returns_the_first_save_and_going_back_is_refused(self, base_uri):
        c = Checkpointer(base_uri, rank=0, world_size=1)
        sd = make_state(31)
        first = c.save(5, sd, generation=1)
        assert c.save(5, sd, generation=1) is first and c.stats.saves == 1
        with pytest.raises(ValueError, match="lower than"):
            c.save(4, sd, generation=1)
        first.result(timeout=30)
        assert c.save(4, sd, generation=2).result(timeout=30).manifest.generation == 2  # new generation: fine
        c.close()


class TestCorruption:
    def test_verify_names_the_corrupt_shard_and_restore_falls_back(self, base_uri):
        old, new = make_state(9), make_state(10)
        save_all_ranks(base_uri, 1, [old, old])
        info, _ = save_all_ranks(base_uri, 2, [new, new])
        store = ObjectStore(base_uri)
        shard = join(info.uri, "__1_0.distcp")
        data = bytearray(store.get_bytes(shard))
        data[len(data) // 2] ^= 0xFF
        store.put_bytes(shard, bytes(data))
        problems = verify(info.uri)
        assert len(problems) == 1 and "__1_0.distcp" in problems[0] and "crc32" in problems[0]
        out = zeros_like_state(old)
        result = restore(base_uri, out)
        assert result.step == 1 and [u for u, _ in result.skipped] == [info.uri]
        assert_state_equal(out, old)

    def test_a_truncated_shard_is_named_and_restore_falls_back_to_the_previous_commit(self, base_uri):
        old, new = make_state(40), make_state(41)
        save_all_ranks(base_uri, 1, [old, old])
        info, _ = save_all_ranks(base_uri, 2, [new, new])
        store = ObjectStore(base_uri)
        shard = join(info.uri, "__0_0.distcp")
        data = store.get_bytes(shard)
        store.rm(shard)
        store.put_bytes(shard, data[: len(data) // 2])
        problems = verify(info.uri)
        assert problems == [f"{shard}: size {len(data) // 2} != {len(data)} in manifest"]
        out = zeros_like_state(old)
        result = restore(base_uri, out)
        assert result.step == 1 and result.skipped == [(info.uri, problems)]
        assert_state_equal(out, old)

    def test_missing_shard_is_named_and_explicit_step_is_not_replaced(self, base_uri):
        sd = make_state(11)
        save_all_ranks(base_uri, 1, [sd, sd])
        info, _ = save_all_ranks(base_uri, 2, [sd, sd])
        ObjectStore(base_uri).rm(join(info.uri, "__0_0.distcp"))
        assert any("__0_0.distcp: missing" in p for p in verify(info.uri))
        with pytest.raises(CorruptCheckpoint, match="__0_0.distcp"):
            restore(base_uri, zeros_like_state(sd), step=2)

    def test_max_step_bounds_the_choice_and_a_damaged_one_falls_back_below_it(self, base_uri):
        states = {step: make_state(20 + step) for step in (1, 2, 3)}
        infos = {step: save_all_ranks(base_uri, step, [sd])[0] for step, sd in states.items()}
        out = zeros_like_state(states[1])
        assert restore(base_uri, out, max_step=2).step == 2  # 3 is newer than the plan's ref
        assert_state_equal(out, states[2])
        ObjectStore(base_uri).rm(join(infos[2].uri, "__0_0.distcp"))
        out = zeros_like_state(states[1])
        result = restore(base_uri, out, max_step=2)
        assert result.step == 1 and [u for u, _ in result.skipped] == [infos[2].uri]
        assert_state_equal(out, states[1])

    def test_no_committed_checkpoint_is_a_clear_not_found(self, base_uri):
        with pytest.raises(CheckpointNotFound, match="no committed checkpoint"):
            restore(base_uri, {"x": torch.zeros(1)})


class TestRetentionAndCleanup:
    @pytest.mark.parametrize(("keep_last", "keep_every", "left"),
                             [(0, 0, [1, 2, 3, 4, 5, 6]), (2, 0, [5, 6]), (2, 3, [3, 5, 6])])
    def test_storage_keeps_what_the_coordinators_retention_rule_records(self, base_uri, keep_last, keep_every, left):
        from springback.service.core.commits import retained  # the one retention rule

        sd = make_state(12)
        infos = {step: save_all_ranks(base_uri, step, [sd])[0] for step in range(1, 7)}
        record = [infos[s].uri for s in sorted(retained(list(infos), keep_last, keep_every))]
        prune_to_record(base_uri, record, current_generation=1)
        assert [c.step for c in list_checkpoints(base_uri)] == left

    def test_clean_partial_deletes_only_what_can_no_longer_commit(self, base_uri):
        sd = make_state(15)
        store = ObjectStore(base_uri)
        save_all_ranks(base_uri, 2, [sd])
        for name in ("step-00000001-g1", "step-00000003-g1", "step-00000004-g2"):
            store.put_bytes(join(base_uri, name, "__0_0.distcp"), b"partial")
        assert clean_partial(base_uri) == [join(base_uri, "step-00000001-g1")]
        assert clean_partial(base_uri, current_generation=2) == [join(base_uri, "step-00000003-g1")]
        assert [(c.step, c.state) for c in list_checkpoints(base_uri)] == [(2, "committed"), (4, "partial")]

    def test_prune_to_record_deletes_what_the_record_does_not_hold(self, base_uri):
        sd = make_state(17)
        store = ObjectStore(base_uri)
        infos = {step: save_all_ranks(base_uri, step, [sd], generation=2)[0] for step in (1, 2, 3, 4)}
        for name in ("step-00000003-g1", "step-00000006-g2"):
            store.put_bytes(join(base_uri, name, "__0_0.distcp"), b"partial")
        # recorded: 2 and 3. 1 is complete but retired (its delete failed),
        # 4 is newer than the record (its commit may be on the way), 3-g1 is a
        # fenced generation's partial, 6-g2 a save in flight.
        recorded = [infos[2].uri + "/", infos[3].uri]
        deleted = prune_to_record(base_uri, recorded, current_generation=2)
        assert sorted(deleted) == sorted([infos[1].uri, join(base_uri, "step-00000003-g1")])
        assert [(c.step, c.generation, c.state) for c in list_checkpoints(base_uri)] == [
            (2, 2, "committed"), (3, 2, "committed"), (4, 2, "committed"), (6, 2, "partial")]
        assert prune_to_record(base_uri, recorded, current_generation=2) == []  # converged

    def test_a_rewound_generations_save_in_flight_survives_cleanup_and_commits(self, base_uri):
        # generation 2 committed step 100; generation 3 rewound to step 50 and
        # is saving step 60 when rank 0's prune after its step-55 commit runs
        sd = make_state(18)
        old = save_all_ranks(base_uri, 100, [sd], generation=2)[0]
        c55 = save_all_ranks(base_uri, 55, [sd, sd], generation=3)[0]
        ranks = [Checkpointer(base_uri, rank=r, world_size=2, commit_timeout_s=5, poll_interval_s=0.02)
                 for r in range(2)]
        ranks[1].save(60, sd, generation=3).result(timeout=30)  # rank 1's shard is durable
        assert prune_to_record(base_uri, [old.uri, c55.uri], current_generation=3) == []
        assert clean_partial(base_uri, current_generation=3) == []
        info = ranks[0].save(60, sd, generation=3).result(timeout=30)
        assert info.manifest.step == 60 and verify(info.uri) == []
        # the same generation's newer commit proves an older partial of it dead
        ObjectStore(base_uri).put_bytes(join(base_uri, "step-00000058-g3", "__0_0.distcp"), b"partial")
        assert clean_partial(base_uri, current_generation=3) == [join(base_uri, "step-00000058-g3")]
        for c in ranks:
            c.close()

    def test_manifest_is_written_last_and_is_json(self, base_uri):
        sd = make_state(16)
        info, _ = save_all_ranks(base_uri, 1, [sd, sd])
        m = json.loads(ObjectStore(base_uri).get_bytes(join(info.uri, MANIFEST_NAME)))
        assert m["format"] == "springback.checkpoint/v1" and m["size_bytes"] == info.manifest.size_bytes


@pytest.mark.timeout(120)
def test_s3_round_trip_on_a_real_s3_server(s3_bucket):
    bucket, opts = s3_bucket
    base = f"{bucket}/job-a"
    sd = make_state(17)
    info, _ = save_all_ranks(base, 5, [sd, sd], storage_options=opts)
    assert verify(info.uri, storage_options=opts) == []
    out = zeros_like_state(sd)
    result = restore(base, out, storage_options=opts)
    assert result.uri == info.uri and result.step == 5
    assert_state_equal(out, sd)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    out2 = zeros_like_state(sd)
    dcp.load(out2, storage_reader=FsspecReader(info.uri, **opts))
    assert_state_equal(out2, sd)


class TestWriterPriority:
    def test_periodic_writes_run_below_the_training_loop_and_urgent_ones_at_its_priority(
            self, tmp_path):
        # nice is per thread on Linux: read in on_commit, on the thread that wrote
        base = str(tmp_path / "ck")
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        seen: list[tuple[int, int]] = []
        c = Checkpointer(base, rank=0, world_size=1, on_commit=lambda info: seen.append(
            (info.manifest.step, os.getpriority(os.PRIO_PROCESS, 0))))
        c.save(1, make_state(30), generation=1).result(timeout=30)
        c.save(2, make_state(31), generation=1, urgent=True).result(timeout=30)
        c.save(3, make_state(32), generation=1).result(timeout=30)
        c.close()
        lowered = min(mine + WRITER_NICE, 19)
        assert seen == [(1, lowered), (2, mine), (3, lowered)]
        assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # the caller's own is unchanged
