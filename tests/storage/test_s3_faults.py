"""Transient S3 errors are retried with backoff and never corrupt a checkpoint;
persistent ones fail the save (reported, counted) and leave the previous one valid.
Faults come from a real HTTP proxy in front of a real moto S3 server."""

from __future__ import annotations

import logging
import pickle
import threading
import time

import botocore.exceptions
import pytest
import torch

from netproxy import NetProxy
from sbtest import wait_for
from springback.storage import Checkpointer, RetryPolicy, TransientStorageError, list_checkpoints, restore, verify
from springback.storage.retry import LOWER_RETRIES_OFF, is_transient
from springback.storage.store import ObjectStore

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FAST_RETRY = RetryPolicy(max_attempts=6, initial_backoff_s=0.01, max_backoff_s=0.1, deadline_s=60)
PATIENT_RETRY = RetryPolicy(max_attempts=40, initial_backoff_s=0.02, max_backoff_s=0.2, deadline_s=60)


def _client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
    )


class TestTransientClassification:
    @pytest.mark.parametrize(
        "exc",
        [ConnectionResetError(), TimeoutError(), _client_error("SlowDown", 503), _client_error("InternalError", 500)],
    )
    def test_retryable_errors_are_transient(self, exc):
        assert is_transient(exc)

    def test_a_wrapped_5xx_is_transient(self):
        try:
            try:
                raise _client_error("ServiceUnavailable", 503)
            except botocore.exceptions.ClientError as inner:
                raise OSError("wrapped") from inner
        except OSError as outer:
            assert is_transient(outer)

    @pytest.mark.parametrize(
        "exc", [FileNotFoundError("x"), PermissionError("x"), ValueError("x"), _client_error("AccessDenied", 403)]
    )
    def test_other_errors_are_not(self, exc):
        assert not is_transient(exc)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g), "step": 3}


def _no_lower_retries(endpoint: str, make_s3_options) -> dict:
    # Turn off botocore's and s3fs's own retries so every injected fault reaches our layer.
    # (s3fs's own retry count is a class attribute: see _store below.)
    return make_s3_options(endpoint, config_kwargs=dict(LOWER_RETRIES_OFF))


def _store(bucket: str, opts: dict, retry: RetryPolicy) -> ObjectStore:
    store = ObjectStore(bucket, storage_options=opts, retry=retry)
    store.fs.retries = 1
    return store


def _save(base: str, store: ObjectStore, step: int, sd: dict, world: int = 2):
    ckpts = [Checkpointer(base, rank=r, world_size=world, store=store, commit_timeout_s=30, poll_interval_s=0.05) for r in range(world)]
    futs = [c.save(step, sd, generation=1) for c in ckpts]
    for c in ckpts:
        c.close()
    return futs


@pytest.mark.timeout(60)
def test_a_failed_request_reaches_the_stores_policy_with_no_retry_below_it(
        s3_bucket, faulty_s3, make_s3_options):
    """The store's options (no retry setting of the caller's) make botocore and
    s3fs try once: one injected 503 is one retry of the store's own, counted.
    (A reset is another matter: aiohttp sends an idempotent request cut on a
    reused connection once more at once, per RFC 9112, below every policy.)"""
    bucket, opts = s3_bucket
    endpoint, injector = faulty_s3
    ObjectStore(bucket, storage_options=opts).put_bytes(f"{bucket}/one", b"payload")
    store = ObjectStore(bucket, storage_options=make_s3_options(endpoint), retry=FAST_RETRY)
    injector.fail(1, "503", method="GET", path="/one")
    assert store.get_bytes(f"{bucket}/one") == b"payload"
    assert len(injector.injected) == 1
    assert store.stats.retries == 1


@pytest.mark.timeout(120)
def test_injected_503s_throttling_and_resets_are_retried_and_the_checkpoint_is_intact(s3_bucket, faulty_s3, make_s3_options):
    bucket, _ = s3_bucket
    endpoint, injector = faulty_s3
    opts = _no_lower_retries(endpoint, make_s3_options)
    store = _store(bucket, opts, FAST_RETRY)
    injector.fail(2, "503", method="PUT").fail(1, "throttle", method="PUT").fail(1, "reset", method="PUT").fail(1, "503", method="GET")
    sd = _state()
    futs = _save(f"{bucket}/job", store, 7, sd)
    info = futs[0].result(timeout=60)
    # every fault was injected (in request order, which the commit protocol decides)
    assert sorted((m, method) for m, method, _ in injector.injected) == [
        ("503", "GET"), ("503", "PUT"), ("503", "PUT"), ("reset", "PUT"), ("throttle", "PUT")]
    # s3fs/botocore absorb some faults themselves (e.g. on reads); ours retries the rest.
    assert 1 <= store.stats.retries <= len(injector.injected) and store.stats.gave_up == 0
    assert verify(info.uri, storage_options=opts) == []
    out = {"w": torch.zeros(256, 256), "b": torch.zeros(256), "step": 0}
    restore(f"{bucket}/job", out, storage_options=opts)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"]) and out["step"] == 3


@pytest.mark.timeout(120)
def test_persistent_failure_fails_the_save_naming_the_uri_and_keeps_the_previous_checkpoint(s3_bucket, faulty_s3, make_s3_options):
    bucket, _ = s3_bucket
    endpoint, injector = faulty_s3
    opts = _no_lower_retries(endpoint, make_s3_options)
    base = f"{bucket}/job"
    good = _state()
    _save(base, _store(bucket, opts, FAST_RETRY), 1, good)[0].result(timeout=60)

    store = _store(bucket, opts, RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05))
    injector.fail(1000, "503", method="PUT")
    errors: list[BaseException] = []
    c = Checkpointer(base, rank=0, world_size=1, store=store, on_error=errors.append)
    fut = c.save(2, {"w": torch.ones(256, 256), "b": torch.ones(256), "step": 9}, generation=1)
    with pytest.raises(TransientStorageError, match=r"step-00000002-g1/_springback/rank-00000\.claim"):
        fut.result(timeout=60)
    c.close()
    assert c.stats.failed == 1 and len(errors) == 1 and store.stats.gave_up == 1
    injector.clear()
    states = {(x.step, x.state) for x in list_checkpoints(base, storage_options=opts)}
    assert (1, "committed") in states and (2, "committed") not in states
    out = {"w": torch.zeros(256, 256), "b": torch.zeros(256), "step": 0}
    assert restore(base, out, storage_options=opts).step == 1
    assert torch.equal(out["w"], good["w"])


@pytest.mark.timeout(120)
def test_truncated_bodies_while_verifying_and_restoring_are_read_again_and_the_checkpoint_is_intact(
        s3_bucket, faulty_s3, make_s3_options, monkeypatch):
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # DCP's reader has its own instance
    bucket, _ = s3_bucket
    endpoint, injector = faulty_s3
    opts = _no_lower_retries(endpoint, make_s3_options)
    base = f"{bucket}/job"
    old, new = _state(), {"w": torch.ones(256, 256), "b": torch.ones(256), "step": 4}
    store = _store(bucket, opts, FAST_RETRY)
    _save(base, store, 1, old)[0].result(timeout=60)
    info = _save(base, store, 2, new)[0].result(timeout=60)
    injector.fail(2, "truncate", method="GET", path=".distcp")
    assert verify(info.uri, store=store) == []  # reread, not reported as damaged
    injector.fail(2, "truncate", method="GET", path=".distcp")
    out = {"w": torch.zeros(256, 256), "b": torch.zeros(256), "step": 0}
    result = restore(base, out, store=store, verify_checksums=False)
    assert [m for m, _, _ in injector.injected] == ["truncate"] * 4
    assert store.stats.retries >= 4  # verify's rereads and the whole-load retries
    assert result.step == 2 and not result.skipped  # the newest, not a fallback
    assert torch.equal(out["w"], new["w"]) and torch.equal(out["b"], new["b"]) and out["step"] == 4


class TestRestoreThroughAFlakyStore:
    """A restore whose reads meet resets, 503s and truncated bodies for a while reads
    the checkpoint again, whole, and ends with the saved state; a permanent error
    (a missing shard file) fails at once."""

    @staticmethod
    def _saved(s3_bucket, make_s3_options, moto_endpoint, faulty_s3):
        bucket, _ = s3_bucket
        endpoint, injector = faulty_s3
        base = f"{bucket}/job"
        direct = _store(bucket, _no_lower_retries(moto_endpoint, make_s3_options), FAST_RETRY)
        sd = _state()
        info = _save(base, direct, 5, sd)[0].result(timeout=60)
        flaky = _store(bucket, _no_lower_retries(endpoint, make_s3_options), PATIENT_RETRY)
        return base, info, sd, flaky, injector

    @pytest.mark.timeout(120)
    @pytest.mark.parametrize("mode", ["reset", "503", "truncate"])
    def test_a_restore_through_a_store_failing_its_reads_for_a_while_succeeds_with_the_saved_state(
            self, mode, s3_bucket, make_s3_options, moto_endpoint, faulty_s3, monkeypatch):
        import s3fs

        monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # DCP's reader has its own instance
        base, _, sd, flaky, injector = self._saved(s3_bucket, make_s3_options, moto_endpoint, faulty_s3)
        injector.fail(6, mode, method="GET", path=".distcp").fail(2, mode, method="GET", path=".metadata")
        out = {"w": torch.zeros(256, 256), "b": torch.zeros(256), "step": 0}
        result = restore(base, out, store=flaky, verify_checksums=False)
        assert len(injector.injected) == 8 and {m for m, _, _ in injector.injected} == {mode}
        assert flaky.stats.retries >= 1 and flaky.stats.gave_up == 0
        assert result.step == 5 and not result.skipped
        assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"]) and out["step"] == 3

    @pytest.mark.timeout(120)
    def test_a_store_that_stays_down_fails_the_restore_within_the_deadline_naming_the_uri(
            self, s3_bucket, make_s3_options, moto_endpoint, faulty_s3, monkeypatch):
        import s3fs

        monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
        base, info, _, _, injector = self._saved(s3_bucket, make_s3_options, moto_endpoint, faulty_s3)
        bucket, _ = s3_bucket
        policy = RetryPolicy(max_attempts=1000, initial_backoff_s=0.05, max_backoff_s=0.2, deadline_s=2.0)
        flaky = _store(bucket, _no_lower_retries(faulty_s3[0], make_s3_options), policy)
        injector.fail(10**6, "reset", method="GET", path=".distcp")
        out = {"w": torch.zeros(256, 256), "b": torch.zeros(256), "step": 0}
        t0 = time.monotonic()
        with pytest.raises(TransientStorageError, match=info.uri.split("/")[-1]):
            restore(base, out, store=flaky, verify_checksums=False)
        assert time.monotonic() - t0 < 15
        assert torch.equal(out["w"], torch.zeros(256, 256))  # nothing half-applied to the caller's copy... in place, see load()

    @pytest.mark.timeout(120)
    def test_a_missing_shard_file_fails_the_restore_at_once_without_retries(
            self, s3_bucket, make_s3_options, moto_endpoint, faulty_s3):
        base, info, _, flaky, _ = self._saved(s3_bucket, make_s3_options, moto_endpoint, faulty_s3)
        flaky.fs.rm(info.uri.removeprefix("s3://") + "/__1_0.distcp")
        out = {"w": torch.zeros(256, 256), "b": torch.zeros(256), "step": 0}
        with pytest.raises(BaseException) as caught:
            restore(base, out, store=flaky, verify_checksums=False)
        assert not isinstance(caught.value, TransientStorageError), caught.value
        assert flaky.stats.retries == 0

    @pytest.mark.timeout(120)
    def test_connections_reset_and_refused_while_the_shards_are_read_are_retried_and_the_state_is_right(
            self, s3_bucket, make_s3_options, moto_endpoint, faulty_s3, monkeypatch, caplog):
        """The issue's case: aiobotocore raises EndpointConnectionError for a reset or
        refused connection, DCP wraps it in its CheckpointException."""
        import s3fs

        monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
        base, _, sd, _, injector = self._saved(s3_bucket, make_s3_options, moto_endpoint, faulty_s3)
        bucket, _ = s3_bucket
        # a shard read held in flight until it has been cut (a fixed delay
        # could end before a loaded machine ran the cutter: nothing to cut)
        released = threading.Event()
        injector.slow(30.0, method="GET", count=1, path=".distcp", until=released)
        with NetProxy(faulty_s3[0]) as link:
            flaky = _store(bucket, _no_lower_retries(link.url, make_s3_options), PATIENT_RETRY)

            def cut() -> None:
                wait_for(lambda: injector.injected, 30, "a shard read in flight")
                # refused before the cut: aiohttp (3.10 and newer) sends an
                # idempotent request cut on its connection once more at once,
                # and a reconnect accepted between the cut and the refusal
                # would read the shard with no error reaching the restore
                link.refuse().reset()
                time.sleep(1.0)  # the outage lasts a second: connections refused meanwhile
                link.heal()
                released.set()

            cutter = threading.Thread(target=cut, daemon=True)
            cutter.start()
            out = {"w": torch.zeros(256, 256), "b": torch.zeros(256), "step": 0}
            with caplog.at_level(logging.WARNING, logger="springback.storage.dcpread"):
                result = restore(base, out, store=flaky, verify_checksums=False)
            cutter.join(10)
        assert link.num_refused >= 1 and flaky.stats.retries >= 1 and flaky.stats.gave_up == 0
        assert "EndpointConnectionError" in caplog.text  # the error of the issue was met, and retried
        assert result.step == 5 and not result.skipped
        assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"]) and out["step"] == 3


class TestLoadFailureClassification:
    """What DCP hands the restore: every rank's failure, pickled across ranks."""

    @staticmethod
    def _gathered(exc: BaseException) -> BaseException:
        from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

        try:
            raise exc
        except BaseException as e:
            wrapped = _wrap_exception(e)
        # what DCP's all_gather_object does to another rank's failure: the cause chain is gone
        return pickle.loads(pickle.dumps(CheckpointException("read", {0: wrapped, 1: wrapped})))

    def test_an_endpoint_connection_error_inside_a_checkpoint_exception_is_transient(self):
        err = botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1/b/k")
        assert is_transient(err) and is_transient(self._gathered(err))

    def test_a_read_classified_transient_on_its_rank_stays_transient_once_gathered(self):
        from springback.storage.dcpread import _classified

        def s3fs_503():
            try:
                raise _client_error("ServiceUnavailable", 503)
            except botocore.exceptions.ClientError as inner:
                raise OSError(5, "Service Unavailable") from inner  # what s3fs raises

        with pytest.raises(Exception) as caught:
            _classified("s3://b/k", "reading", s3fs_503)
        assert is_transient(self._gathered(caught.value))
        assert not is_transient(pickle.loads(pickle.dumps(OSError(5, "x"))))  # the chain alone would not survive

    def test_one_rank_missing_a_file_makes_the_whole_load_permanent(self):
        from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

        mixed = CheckpointException("read", {0: _wrap_exception(ConnectionResetError()),
                                             1: _wrap_exception(FileNotFoundError("b/__1_0.distcp"))})
        assert not is_transient(mixed)
        assert not is_transient(CheckpointException("read", {}))
