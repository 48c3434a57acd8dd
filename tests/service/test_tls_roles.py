"""Client certificates mapped to roles (``--tls-roles``) on real TLS
coordinators and a real etcd: the role is the certificate subject's, an
unmapped certificate has none, and a follower relays a certificate caller's
role to the leader without letting a caller claim one."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sbtest import wait_for
from springback.client.api import ApiError, Client
from springback.client.channel import connect
from springback.client.env import TLS_CA, TLS_CERT, TLS_KEY
from springback.service.transport import credentials
from springback.service.transport.auth import FORWARDED, ROLE_HEADER
from springback.v1 import job_service_pb2 as js
from springback.v1 import job_service_pb2_grpc as js_grpc
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

pytestmark = pytest.mark.timeout(60)

ROLES = "# subject -> role\nCN=ops:operator\nCN=dash:viewer\nSAN=spiffe://sb/replica:replica\n"


def _issue(d: Path, name: str, ca: tuple | None, *, server: bool = False,
           uri: str | None = None) -> tuple:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_key, issuer = (key, subject) if ca is None else ca
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
    elif ca is not None:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
        if uri:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return key, subject


@pytest.fixture
def pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1, client certificates for CN
    ops, dash, stranger, and one (CN node-7) whose URI SAN is the replicas'."""
    ca = _issue(tmp_path, "ca", None)
    _issue(tmp_path, "server", ca, server=True)
    for name in ("ops", "dash", "stranger"):
        _issue(tmp_path, name, ca)
    _issue(tmp_path, "node-7", ca, uri="spiffe://sb/replica")
    (tmp_path / "roles.txt").write_text(ROLES)
    return tmp_path


def _tls(pki: Path, **extra) -> dict:
    return dict(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                tls_client_ca=str(pki / "ca.pem"), tls_roles=str(pki / "roles.txt"), **extra)


def _client(address: str, pki: Path, name: str) -> Client:
    return Client(address, token="", tls_ca=str(pki / "ca.pem"),
                  tls_cert=str(pki / f"{name}.pem"), tls_key=str(pki / f"{name}.key"))


def _channel(address: str, pki: Path, name: str) -> grpc.Channel:
    return connect([address], token="", tls_ca=str(pki / "ca.pem"),
                   tls_cert=str(pki / f"{name}.pem"), tls_key=str(pki / f"{name}.key"))


def test_a_certificate_has_the_role_its_subject_maps_to(start_coordinator, pki, make_spec):
    server = start_coordinator(**_tls(pki))  # no token: certificates alone
    wait_for(server.election.is_leader, 10, "leadership")
    with _client(server.address, pki, "ops") as ops, _client(server.address, pki, "dash") as dash:
        job = ops.create_job(make_spec())
        assert dash.get_job(job.id).id == job.id
        with pytest.raises(ApiError) as e:
            dash.cancel_job(job.id)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "needs the operator role" in str(e.value) and "CN=dash" in str(e.value)
        assert "viewer" in str(e.value)
        with _client(server.address, pki, "stranger") as stranger:
            with pytest.raises(ApiError) as e:
                stranger.get_job(job.id)
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert "CN=stranger" in str(e.value) and "maps to no role" in str(e.value)
        notes = ws.ReportPlanStreamsRequest(replica="x", notes=[])
        with _channel(server.address, pki, "ops") as channel:  # the operator is no replica
            with pytest.raises(grpc.RpcError) as e:
                ws_grpc.WorkerServiceStub(channel).ReportPlanStreams(notes, timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "needs the replica role" in e.value.details()
        with _channel(server.address, pki, "node-7") as channel:  # mapped by its SAN
            ws_grpc.WorkerServiceStub(channel).ReportPlanStreams(notes, timeout=5)
        assert ops.get_job(job.id).status.state != pb.JOB_STATE_CANCELLED


def test_a_follower_relays_a_certificate_callers_role_and_a_caller_cannot_claim_one(
        start_coordinator, pki, make_spec, monkeypatch):
    # the replicas' own client certificate (forwarding, plan-stream notes)
    monkeypatch.setenv(TLS_CA, str(pki / "ca.pem"))
    monkeypatch.setenv(TLS_CERT, str(pki / "node-7.pem"))
    monkeypatch.setenv(TLS_KEY, str(pki / "node-7.key"))
    leader = start_coordinator(**_tls(pki))
    wait_for(leader.election.is_leader, 10, "leadership")
    follower = start_coordinator(**_tls(pki))
    with _client(follower.address, pki, "ops") as ops, \
            _client(follower.address, pki, "dash") as dash:
        job = ops.create_job(make_spec())  # forwarded: the leader believes "operator"
        assert dash.get_job(job.id).id == job.id
        with pytest.raises(ApiError) as e:
            dash.cancel_job(job.id)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "operator" in str(e.value)
    assert follower._forwarding.num_forwarded >= 2  # noqa: SLF001 (the calls did go through it)
    # a viewer's certificate saying it was forwarded, as an operator: still a viewer
    with _channel(leader.address, pki, "dash") as channel:
        with pytest.raises(grpc.RpcError) as e:
            js_grpc.JobServiceStub(channel).CancelJob(
                js.CancelJobRequest(job_id=job.id), timeout=5,
                metadata=[(FORWARDED, follower.address), (ROLE_HEADER, "operator")])
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with _client(leader.address, pki, "ops") as ops:
        assert ops.get_job(job.id).status.state != pb.JOB_STATE_CANCELLED  # nothing changed


def test_a_roles_file_names_the_line_at_fault():
    assert credentials.parse_tls_roles(ROLES) == {
        ("CN", "ops"): "operator", ("CN", "dash"): "viewer",
        ("SAN", "spiffe://sb/replica"): "replica"}
    for text, fault in (("CN=ops:admin", "role 'admin'"), ("OU=ops:viewer", "line 1"),
                        ("CN=a:viewer\nCN=a:operator", "line 2")):
        with pytest.raises(ValueError) as e:
            credentials.parse_tls_roles(text)
        assert fault in str(e.value), str(e.value)
