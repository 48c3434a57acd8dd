"""Bearer tokens, TLS and mTLS on a real coordinator; health and reflection; wire
faults (oversized and malformed messages, a client trusting the wrong CA), each
refused with a clear status, changing nothing, the server serving on."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sbtest import OPERATOR_TOKEN, VIEWER_TOKEN, wait_for
from springback.client.api import ApiError, Client
from springback.v1 import job_service_pb2 as js
from springback.v1 import job_service_pb2_grpc as js_grpc

pytestmark = pytest.mark.timeout(60)

TOKEN = OPERATOR_TOKEN


@pytest.fixture
def secured(start_coordinator):
    server = start_coordinator(token=TOKEN)
    wait_for(server.election.is_leader, 10, "leadership")
    return server


class TestBearerToken:
    @pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x"])
    def test_calls_without_the_right_token_are_unauthenticated_and_change_nothing(
        self, secured, make_spec, token
    ):
        with Client(secured.address, token=token or "") as bad:
            with pytest.raises(ApiError) as e:
                bad.create_job(make_spec())
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(ApiError) as e:
                next(bad.watch_job("any"))
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(secured.address, token=TOKEN) as good:
            assert good.list_jobs() == []

    def test_the_right_token_is_accepted(self, secured, make_spec):
        with Client(secured.address, token=TOKEN) as client:
            job = client.create_job(make_spec())
            assert client.get_job(job.id).id == job.id

    def test_health_checks_need_no_token(self, secured):
        with grpc.insecure_channel(secured.address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(coordinator):
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"springback.v1.JobService", "springback.v1.WorkerService", "grpc.health.v1.Health"} <= names


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1 and a client certificate."""
    d = tmp_path
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"),
                 "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "1",
                 "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.pem"))
    return d


class TestTls:
    def test_mtls_accepts_a_signed_client_and_refuses_others(self, start_coordinator, pki, make_spec):
        server = start_coordinator(
            tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
            tls_client_ca=str(pki / "ca.pem"), token=TOKEN,
        )
        wait_for(server.election.is_leader, 10, "leadership")
        with Client(server.address, token=TOKEN, tls_ca=str(pki / "ca.pem"),
                    tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key")) as client:
            assert client.create_job(make_spec()).id
        with Client(server.address, token=TOKEN, tls_ca=str(pki / "ca.pem"), timeout_s=3) as anonymous:
            with pytest.raises(ApiError) as e:
                anonymous.list_jobs()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE  # handshake refused
        plaintext = js_grpc.JobServiceStub(grpc.insecure_channel(server.address))
        with pytest.raises(grpc.RpcError):
            plaintext.ListJobs(js.ListJobsRequest(), timeout=3)


CREATE_JOB = "/springback.v1.JobService/CreateJob"


def _raw_call(address: str, payload: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(CREATE_JOB, request_serializer=None,
                                   response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            call(payload, timeout=10)
    return e.value


class TestMessages:
    def test_an_oversized_message_is_refused_and_creates_nothing(self, coordinator, client,
                                                                 make_spec):
        spec = make_spec()
        request = js.CreateJobRequest()
        request.spec.name = "x" * (17 * 1024 * 1024)  # above the 16 MiB limit
        error = _raw_call(coordinator.address, request.SerializeToString())
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.list_jobs() == []
        assert client.create_job(spec).id  # still serving

    @pytest.mark.parametrize("payload", [b"\xff\xff\xff\xff\x0f", b"\x0a\x05abc", b"\x12"])
    def test_malformed_bytes_are_refused_and_create_nothing(self, coordinator, client,
                                                           make_spec, payload):
        error = _raw_call(coordinator.address, payload)
        # grpc's own deserialisation failure: never a crash of the server
        assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL)
        assert client.list_jobs() == []
        assert client.create_job(make_spec()).id


class TestWrongCa:
    def test_a_client_trusting_another_ca_is_refused(self, start_coordinator, pki, tmp_path,
                                                     make_spec):
        server = start_coordinator(tls_cert=str(pki / "server.pem"),
                                   tls_key=str(pki / "server.key"), token=TOKEN)
        wait_for(server.election.is_leader, 10, "leadership")
        other = tmp_path / "other"
        other.mkdir()
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                 "-subj", "/CN=other-ca", "-keyout", str(other / "ca.key"),
                 "-out", str(other / "ca.pem"))
        with Client(server.address, token=TOKEN, tls_ca=str(other / "ca.pem"),
                    timeout_s=3) as wrong:
            with pytest.raises(ApiError) as e:
                wrong.create_job(make_spec())
            assert e.value.code == grpc.StatusCode.UNAVAILABLE  # the handshake fails
        with Client(server.address, token=TOKEN, tls_ca=str(pki / "ca.pem")) as right:
            assert right.list_jobs() == []  # nothing was created


class TestCallCounting:
    """Only registered method names are counted, and only calls that passed
    authentication: random names cannot grow the metrics' label set."""

    def test_random_method_names_leave_the_counted_labels_unchanged(self, coordinator):
        before = set(coordinator.counter.calls)
        with grpc.insecure_channel(coordinator.address) as channel:
            for i in range(1000):
                with pytest.raises(grpc.RpcError) as e:
                    channel.unary_unary(f"/springback.v1.JobService/Nope{i}")(b"", timeout=5)
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert set(coordinator.counter.calls) == before

    def test_unauthenticated_calls_are_not_counted(self, secured):
        def api_calls():  # health checks need no token (the channel's own are counted)
            return {m: n for m, n in secured.counter.calls.items() if m.startswith("/springback.v1.")}

        before = api_calls()
        with Client(secured.address, token="wrong") as bad:
            for _ in range(5):
                with pytest.raises(ApiError):
                    bad.list_jobs()
        assert api_calls() == before


class TestSafeDefaults:
    @pytest.mark.parametrize("listen", ["0.0.0.0:0", "10.1.2.3:7070", "[::]:0", "coord.example:7070"])
    def test_a_reachable_listen_without_a_token_is_refused_naming_the_way_out(self, listen):
        from springback.service.transport.config import CoordinatorConfig

        with pytest.raises(ValueError) as e:
            CoordinatorConfig(etcd="http://127.0.0.1:2379", listen=listen)
        assert str(e.value).startswith(f"listen: {listen!r}") and "--insecure" in str(e.value)
        # a token, or saying so, is accepted
        CoordinatorConfig(etcd="http://127.0.0.1:2379", listen=listen, token=TOKEN)
        CoordinatorConfig(etcd="http://127.0.0.1:2379", listen=listen, insecure=True)

    @pytest.mark.parametrize("listen", ["127.0.0.1:0", "127.0.0.2:7070", "localhost:0", "[::1]:0"])
    def test_loopback_needs_no_token(self, listen):
        from springback.service.transport.config import CoordinatorConfig

        CoordinatorConfig(etcd="http://127.0.0.1:2379", listen=listen)

    def test_up_refuses_before_starting_etcd(self, tmp_path):
        import os
        import sys

        env = {k: v for k, v in os.environ.items() if k != "SPRINGBACK_TOKEN"}
        done = subprocess.run(
            [sys.executable, "-m", "springback.cli", "up", "--listen", "0.0.0.0:0",
             "--state-dir", str(tmp_path / "state"), "--etcd-port", "0"],
            capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert "listen: '0.0.0.0:0'" in done.stderr and "--insecure" in done.stderr
        assert not (tmp_path / "state").exists()  # no etcd was started

    @pytest.mark.parametrize("listen", ["0.0.0.0:0", "10.1.2.3:9090", "[::]:0", "metrics.example:9090"])
    def test_a_reachable_metrics_listen_without_a_token_is_refused_naming_the_way_out(self, listen):
        from springback.service.transport.config import CoordinatorConfig

        with pytest.raises(ValueError) as e:
            CoordinatorConfig(etcd="http://127.0.0.1:2379", metrics_listen=listen)
        assert str(e.value).startswith(f"metrics_listen: {listen!r}") and "--insecure" in str(e.value)
        # certificates guard the gRPC port, not the HTTP listener
        with pytest.raises(ValueError, match="^metrics_listen: "):
            CoordinatorConfig(etcd="http://127.0.0.1:2379", metrics_listen=listen,
                              tls_cert="c", tls_key="k", tls_client_ca="ca", tls_roles="r")
        CoordinatorConfig(etcd="http://127.0.0.1:2379", metrics_listen=listen, token=TOKEN)
        CoordinatorConfig(etcd="http://127.0.0.1:2379", metrics_listen=listen, insecure=True)
        CoordinatorConfig(etcd="http://127.0.0.1:2379", metrics_listen="127.0.0.1:0")

    def test_up_refuses_a_reachable_metrics_listen_before_starting_etcd(self, tmp_path):
        import os
        import sys

        env = {k: v for k, v in os.environ.items() if k != "SPRINGBACK_TOKEN"}
        done = subprocess.run(
            [sys.executable, "-m", "springback.cli", "up", "--metrics-listen", "0.0.0.0:0",
             "--state-dir", str(tmp_path / "state"), "--etcd-port", "0"],
            capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert "metrics_listen: '0.0.0.0:0'" in done.stderr and "--insecure" in done.stderr
        assert not (tmp_path / "state").exists()


VIEWER = VIEWER_TOKEN


class TestMetricsNeedACredential:
    """``/metrics`` names jobs and their generations: with a token it takes
    the operator's or the viewer's, as a scraper's bearer token."""

    @pytest.fixture
    def server(self, start_coordinator, make_spec):
        server = start_coordinator(token=TOKEN, viewer_token=VIEWER,
                                   metrics_listen="127.0.0.1:0")
        wait_for(server.election.is_leader, 10, "leadership")
        with Client(server.address, token=TOKEN) as client:
            server.job_id = client.create_job(make_spec()).id
        return server

    @pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", "Basic " + TOKEN])
    def test_a_scrape_without_a_right_credential_is_401_and_shows_nothing(self, server, token):
        import urllib.error
        import urllib.request

        headers = {"Authorization": token if token.startswith("Basic") else f"Bearer {token}"} \
            if token else {}
        request = urllib.request.Request(f"http://{server.metrics_address}/metrics",
                                         headers=headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=10)
        assert e.value.code == 401 and e.value.headers["WWW-Authenticate"] == "Bearer"
        assert server.job_id.encode() not in e.value.read()

    @pytest.mark.parametrize("token", [TOKEN, VIEWER])
    def test_the_operator_and_the_viewer_scrape(self, server, token):
        from sbtest import scrape

        samples = scrape(server.metrics_address, token=token)
        assert samples[f'springback_job_generation{{job="{server.job_id}"}}'] >= 1

    def test_without_a_token_on_loopback_metrics_are_open(self, coordinator_with_metrics):
        from sbtest import scrape

        assert scrape(coordinator_with_metrics.metrics_address)[
            "springback_coordinator_is_leader"] == 1.0


@pytest.fixture
def coordinator_with_metrics(start_coordinator):
    server = start_coordinator(metrics_listen="127.0.0.1:0")
    wait_for(server.election.is_leader, 10, "leadership")
    return server


WEAK_TOKENS = {
    "short": "s3cret-token",
    "repeated": "a" * 40,
    "sequence": "abcdefghijklmnopqrstuvwxyz0123456789",
    "hex sequence": "0123456789abcdef" * 2,
    "period": "abc1" * 10,
    "spaces": "correct horse battery staple",
}


class TestTokenStrength:
    """An operator or viewer token under 128 bits (by `credentials.token_bits`'
    estimate), or an obvious pattern, is refused at start naming its flag."""

    @pytest.mark.parametrize("name", WEAK_TOKENS)
    @pytest.mark.parametrize("field", ["token", "viewer_token"])
    def test_a_weak_token_is_refused_naming_its_flag_and_not_quoting_it(self, name, field):
        from springback.service.transport.config import CoordinatorConfig

        weak = WEAK_TOKENS[name]
        config = {"token": TOKEN, field: weak}
        with pytest.raises(ValueError) as e:
            CoordinatorConfig(etcd="http://127.0.0.1:2379", **config)
        flag = "--" + field.replace("_", "-")
        assert str(e.value).startswith(f"{field}: the {flag} given is too weak"), str(e.value)
        assert weak not in str(e.value)

    def test_random_tokens_of_128_bits_are_accepted(self):
        import base64
        import secrets

        from springback.service.transport.config import CoordinatorConfig

        for _ in range(200):
            for token in (secrets.token_urlsafe(16), secrets.token_hex(16),
                          base64.b64encode(secrets.token_bytes(16)).decode()):
                CoordinatorConfig(etcd="http://127.0.0.1:2379", token=token,
                                  viewer_token=VIEWER)

    def test_the_coordinator_command_refuses_a_weak_token_with_exit_2(self, capsys):
        from springback.cli.main import main

        assert main(["coordinator", "--etcd", "http://127.0.0.1:1", "--token", "s3cret-token"]) == 2
        err = capsys.readouterr().err
        assert "--token given is too weak" in err and "s3cret-token" not in err


class TestTokenFile:
    """The token from a file (``--token-file`` or $SPRINGBACK_TOKEN_FILE) keeps
    it out of /proc/*/cmdline; a ``--token`` there is logged as a warning."""

    @pytest.mark.parametrize("how", ["flag", "environment"])
    def test_a_coordinator_takes_its_token_from_a_file(self, spawn_coordinator, tmp_path,
                                                       monkeypatch, how):
        path = tmp_path / "token"
        path.write_text(TOKEN + "\n")
        path.chmod(0o600)
        monkeypatch.delenv("SPRINGBACK_TOKEN", raising=False)
        if how == "environment":
            monkeypatch.setenv("SPRINGBACK_TOKEN_FILE", str(path))
        replica = spawn_coordinator(*(["--token-file", str(path)] if how == "flag" else []))
        with open(f"/proc/{replica.process.pid}/cmdline", "rb") as f:
            assert TOKEN.encode() not in f.read()
        with Client(replica.address, token="wrong") as bad:
            with pytest.raises(ApiError) as e:
                bad.list_jobs()
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(replica.address, token=TOKEN) as good:
            assert good.list_jobs() == []
        assert "--token on the command line" not in open(replica.log_path).read()

    def test_a_token_on_the_command_line_is_logged_as_a_warning(self, spawn_coordinator):
        replica = spawn_coordinator("--token", TOKEN)
        log = open(replica.log_path).read()
        assert "--token on the command line is visible" in log and TOKEN not in log

    def test_an_empty_or_missing_file_or_both_ways_are_refused(self, tmp_path, capsys):
        from springback.cli.main import main

        empty = tmp_path / "empty"
        empty.write_text("\n")
        for argv, why in (
                (["--token-file", str(empty)], "its first line is empty"),
                (["--token-file", str(tmp_path / "none")], "cannot be read"),
                (["--token", TOKEN, "--token-file", str(empty)], "not both")):
            assert main([*argv, "--coordinator", "127.0.0.1:1", "job", "list"]) == 2
            err = capsys.readouterr().err
            assert "token-file" in err and why in err, err
