"""Unit tests: the agent -> rank plan channel, standby activation, notices."""

from __future__ import annotations

import os

import pytest

from springback.v1 import types_pb2 as pb
from springback.worker.agent.config import AgentConfig
from springback.worker.control import (
    PlanChannel,
    PlanPublisher,
    activate_standby,
    await_activation,
    ready_path,
)
from metadata_server import MetadataServer
from sbtest import wait_for
from springback.worker.agent.preemption import CloudNotice, FileNotice
from springback.worker.rankstats import RankStats
from springback.worker.rankstats import read_all as read_rank_stats


class TestPlanChannel:
    def test_a_rank_sees_each_newer_plan_and_never_an_older_one(self, tmp_path):
        pub, chan = PlanPublisher(str(tmp_path)), PlanChannel(str(tmp_path))
        assert chan.latest() is None
        pub.publish(pb.Plan(generation=3))
        assert chan.latest().generation == 3
        pub.publish(pb.Plan(generation=2))  # a late, older plan is ignored
        assert chan.latest().generation == 3
        pub.publish(pb.Plan(generation=4, world_size=2))
        assert chan.latest().world_size == 2

    def test_a_new_publisher_clears_the_previous_members_plan_and_drain(self, tmp_path):
        pub = PlanPublisher(str(tmp_path))
        pub.publish(pb.Plan(generation=5))
        pub.request_drain()
        assert PlanChannel(str(tmp_path)).draining()
        PlanPublisher(str(tmp_path))
        chan = PlanChannel(str(tmp_path))
        assert chan.latest() is None and not chan.draining()


class TestStandby:
    def test_activation_hands_over_identity_after_the_ready_marker(self, tmp_path):
        path = str(tmp_path / "standby-1.json")
        activate_standby(path, local_rank=2, member_id="m-1", control_dir="/c",
                         collective_timeout_s=2.0, credential="sbm1.j.m-1.ab")
        identity = await_activation(path)
        assert identity == {"local_rank": 2, "member_id": "m-1", "control_dir": "/c",
                            "collective_timeout_s": 2.0, "credential": "sbm1.j.m-1.ab"}
        assert os.stat(path).st_mode & 0o077 == 0  # it holds a credential: the owner's only
        assert (tmp_path / "standby-1.json.ready").exists() and ready_path(path).endswith(".ready")


class TestPreemptionNotices:
    def test_a_file_notice_fires_once_the_file_exists_and_names_it(self, tmp_path):
        notice = FileNotice(str(tmp_path / "notice"))
        assert notice.poll() is None
        (tmp_path / "notice").write_text("terminating in 120s")
        assert "terminating in 120s" in notice.poll()


class TestAgentConfig:
    @pytest.mark.parametrize("kwargs, field", [
        ({"command": []}, "after --"),
        ({"nproc_per_node": 0}, "--nproc-per-node"),
        ({"on_fenced": "panic"}, "--on-fenced"),
        ({"drain_timeout_s": 0}, "--drain-timeout-s"),
        ({"metrics_listen": "9100"}, "--metrics-listen"),
        ({"metrics_listen": "host:port"}, "--metrics-listen"),
        ({"metrics_listen": "127.0.0.1:70000"}, "--metrics-listen"),
    ])
    def test_bad_settings_are_rejected_naming_the_option(self, kwargs, field):
        config = {"job_id": "j", "command": ["python", "train.py"], **kwargs}
        with pytest.raises(ValueError, match=field):
            AgentConfig(**config)


class TestRankStats:
    def test_the_agent_reads_what_each_rank_wrote_and_skips_foreign_files(self, tmp_path):
        stats = RankStats(str(tmp_path), local_rank=1)
        stats.generation_started(generation=3, world_size=4, rank=2, step=7)
        for step in (8, 9, 10):
            stats.step_done(step, checkpoint_stall_s=0.004)
        stats.flush(force=True)
        (tmp_path / "stats-x.json").write_text("{}")
        (tmp_path / "stats-0.json").write_text("{torn")
        seen = read_rank_stats(str(tmp_path))
        assert list(seen) == [1]
        v = seen[1]
        assert (v["generation"], v["world_size"], v["rank"], v["step"]) == (3, 4, 2, 10)
        # the first step of a generation is not timed (it includes warm-up)
        assert v["steps_total"] == 3 and v["step_seconds_total"] > 0
        assert v["checkpoint_stall_seconds"] == 0.004 and v["recovery_seconds"] == 0
        stats.generation_started(generation=4, world_size=3, rank=1, step=10)
        assert read_rank_stats(str(tmp_path))[1]["recovery_seconds"] > 0

    @pytest.mark.timeout(30)
    @pytest.mark.parametrize(("cloud", "said"), [
        ("aws", "aws preemption notice: spot instance-action terminate at 2026-12-03T12:00:00Z"),
        ("gcp", "gcp preemption notice: instance preempted"),
        ("azure", "azure preemption notice: scheduled event Preempt not before Thu, 03 Dec"),
    ])
    def test_a_cloud_notice_fires_on_the_metadata_services_notice_only(self, cloud, said):
        server = MetadataServer(cloud)
        notice = CloudNotice(cloud, server.url)
        try:
            wait_for(lambda: len(server.requests) >= 2, 10, "the notice to ask twice")
            assert notice.poll() is None  # asked, and no notice yet (Azure: only a Freeze)
            server.preempt()
            reason = wait_for(notice.poll, 10, "the notice to fire")
            assert reason.startswith(said), reason
        finally:
            notice.close()
            server.close()

    @pytest.mark.timeout(30)
    def test_a_failing_metadata_service_is_no_notice_and_is_asked_again(self):
        server = MetadataServer("gcp")
        server.broken = True
        notice = CloudNotice("gcp", server.url)
        try:
            wait_for(lambda: len(server.requests) >= 2, 10, "the notice to ask again")
            assert notice.poll() is None
            server.broken = False
            server.preempt()
            assert "instance preempted" in wait_for(notice.poll, 10, "the notice to fire")
        finally:
            notice.close()
            server.close()

    def test_an_unknown_cloud_is_named(self):
        with pytest.raises(ValueError, match="--preemption-cloud must be one of aws, gcp, azure"):
            CloudNotice("ibm")
