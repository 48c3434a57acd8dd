"""`from springback import Client, ApiError`: every failure of the client,
a spec refused before sending included, is the documented ApiError."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from springback import ApiError, Client, InvalidSpec


class TestClientErrors:
    def test_a_bad_spec_raises_api_error_naming_the_field_and_sends_nothing(
            self, coordinator_address, make_spec):
        with Client(coordinator_address) as client:
            with pytest.raises(ApiError) as e:
                client.create_job(make_spec(max_steps=0))
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_steps" in e.value.details
            assert isinstance(e.value, InvalidSpec) and e.value.field == "max_steps"
            assert client.list_jobs() == []

    def test_an_unknown_job_raises_api_error_not_found(self, coordinator_address):
        with Client(coordinator_address) as client, pytest.raises(ApiError) as e:
            client.get_job("nope")
        assert e.value.code == grpc.StatusCode.NOT_FOUND

    def test_the_cli_exits_2_for_a_bad_spec_file(self, tmp_path, coordinator_address):
        spec = tmp_path / "job.yaml"
        spec.write_text("name: x\nmin_workers: 1\nmax_workers: 1\nmax_steps: 0\n"
                        "data: {num_samples: 8, global_batch_size: 2}\n")
        out = subprocess.run([sys.executable, "-m", "springback.cli", "--coordinator",
                              coordinator_address, "job", "submit", str(spec)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert "INVALID_ARGUMENT" in out.stderr and "max_steps" in out.stderr
