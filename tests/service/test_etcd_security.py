"""etcd behind TLS with client certificates and its own auth, on a real etcd."""

from __future__ import annotations

import dataclasses
import socket

import grpc
from etcd3 import etcdrpc
import pytest

from sbtest import wait_for
from springback.cli.local import EtcdServer
from springback.client.api import Client
from springback.client.errors import InvalidArgument, StoreUnavailable
from springback.service.transport.config import CoordinatorConfig
from springback.service.etcd.store import EtcdSecurity, Store, StoreDenied
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

pytestmark = pytest.mark.timeout(60)


class TestASecuredEtcdServesTheCoordinator:
    def test_a_job_is_created_joined_and_planned(self, secure_etcd, etcd_tls, tmp_path, make_spec):
        from sbtest import CoordinatorProcess

        replica = CoordinatorProcess(secure_etcd.endpoint, "--liveness-timeout-s", "2",
                                     "--leader-ttl-s", "2", "--drain-s", "0",
                                     etcd_flags=secure_etcd.coordinator_flags(),
                                     log_path=str(tmp_path / "coordinator.log"))
        try:
            with Client(replica.address) as client:
                job = wait_for(lambda: client.create_job(make_spec(max_workers=1)), 20, "a leader")
                workers = ws_grpc.WorkerServiceStub(grpc.insecure_channel(replica.address))
                joined = workers.JoinJob(ws.JoinJobRequest(job_id=job.id, host="127.0.0.1",
                                                           rendezvous_port=4000, num_local_ranks=1),
                                         timeout=10)
                assert list(client.get_job(job.id).status.members) == [joined.member.id]
                assert client.get_job(job.id).status.generation >= 1
        finally:
            replica.stop()


class TestRefusedClients:
    def test_a_client_without_a_certificate_is_refused(self, secure_etcd):
        security = dataclasses.replace(secure_etcd.client_security, cert_file=None, key_file=None)
        store = Store(secure_etcd.endpoint, timeout_s=1, security=security)
        with pytest.raises(StoreUnavailable):
            store.get("/springback/v1/jobs/x")
        store.close()

    def test_a_wrong_password_is_refused(self, secure_etcd):
        security = dataclasses.replace(secure_etcd.client_security, password="wrong")
        store = Store(secure_etcd.endpoint, security=security)
        with pytest.raises(StoreDenied, match="invalid user ID or password"):
            store.get("/springback/v1/jobs/x")
        store.close()

    def test_the_springback_user_reaches_only_keys_under_its_prefix(self, secure_etcd):
        store = secure_etcd.store()
        store.put("/springback/v1/jobs/x", b"1")
        assert store.get("/springback/v1/jobs/x").value == b"1"
        with pytest.raises(StoreDenied, match="permission denied"):
            store.put("/other/x", b"1")
        with pytest.raises(StoreDenied, match="permission denied"):
            store.get("/other/x")
        store.close()

    def test_the_certificate_alone_is_no_etcd_user(self, secure_etcd):
        security = dataclasses.replace(secure_etcd.client_security, user=None, password=None)
        store = Store(secure_etcd.endpoint, security=security)
        with pytest.raises(StoreDenied):
            store.get("/springback/v1/jobs/x")
        store.close()


class TestBadSettings:
    @pytest.mark.parametrize(("endpoints", "security", "names"), [
        ("https://127.0.0.1:1", None, "ca_file"),
        ("http://127.0.0.1:1", EtcdSecurity(ca_file="ca.pem"), "use https://"),
        ("http://127.0.0.1:1,https://127.0.0.1:2", None, "mix"),
        ("unix://127.0.0.1:1", None, "scheme 'unix'"),
        ("http://127.0.0.1:1", EtcdSecurity(user="u", password="p"), "clear text"),
        ("https://127.0.0.1:1", EtcdSecurity(ca_file="/nonexistent/ca.pem"), "/nonexistent/ca.pem"),
    ])
    def test_is_refused_naming_the_setting(self, endpoints, security, names):
        with pytest.raises(InvalidArgument, match=names) as e:
            Store(endpoints, security=security)
        assert e.value.field == "etcd"

    def test_a_user_without_a_password_is_refused(self):
        with pytest.raises(InvalidArgument, match="password"):
            EtcdSecurity(ca_file="ca.pem", user="springback")

    def test_the_coordinator_refuses_https_without_a_ca_before_writing(self, secure_etcd):
        with pytest.raises(InvalidArgument, match="ca_file"):
            CoordinatorConfig(etcd=secure_etcd.endpoint, listen="127.0.0.1:0")
        store = secure_etcd.store()
        assert store.get_prefix("/springback/") == []
        store.close()


class TestEtcdRestart:
    def test_the_client_authenticates_again_after_etcd_restarts(self, secure_etcd: EtcdServer):
        store = secure_etcd.store()
        store.put("/springback/v1/jobs/x", b"1")
        secure_etcd.stop(kill=True)
        secure_etcd.start()  # simple tokens live in etcd's memory: ours is gone
        assert store.get("/springback/v1/jobs/x").value == b"1"
        store.put("/springback/v1/jobs/y", b"2")
        store.close()

    def test_a_token_etcd_no_longer_knows_is_replaced_and_the_call_retried(self, secure_etcd):
        # etcd forgets a user's tokens when its password is set (here: to the
        # same one), as it does when a token expires unused
        store = secure_etcd.store()
        store.put("/springback/v1/jobs/x", b"1")
        first = store._token
        root_security = dataclasses.replace(secure_etcd.client_security, user="root",
                                            password=secure_etcd.root_password)
        root = Store(secure_etcd.endpoint, security=root_security)
        root.get("/springback/v1/jobs/x")  # authenticates
        root._client.authstub.UserChangePassword(
            etcdrpc.AuthUserChangePasswordRequest(name="springback",
                                                  password=secure_etcd.tls.password),
            timeout=5, metadata=root._client.metadata)
        store.put("/springback/v1/jobs/y", b"2")
        assert store._token != first and store.get("/springback/v1/jobs/y").value == b"2"
        root.close()
        store.close()


class TestFailingOver:
    def test_a_store_whose_first_endpoint_is_down_authenticates_on_the_next(self, secure_etcd):
        # The first Authenticate goes to the endpoint the client picked at
        # random; it is refused there. The next call must authenticate on the
        # live endpoint (the client's own cached auth stub stayed bound to the
        # dead one, so a replica's liveness probe never authenticated again).
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            dead = f"https://127.0.0.1:{s.getsockname()[1]}"
        endpoints = f"{dead},{secure_etcd.endpoint}"
        stores = []
        try:
            while True:  # until the client picks the dead endpoint first (1 in 2 each)
                store = Store(endpoints, timeout_s=0.5, security=secure_etcd.client_security)
                stores.append(store)
                if store._client.endpoint_in_use.netloc == dead.removeprefix("https://"):
                    break
            with pytest.raises(StoreUnavailable, match="authenticating"):
                store.get("/springback/v1/jobs/x")
            store.put("/springback/v1/jobs/x", b"1")
            assert store.get("/springback/v1/jobs/x").value == b"1"
        finally:
            for store in stores:
                store.close()
