"""A local etcd server, for `springback up`, the demo and the tests.

`EtcdServer` starts the ``etcd`` binary found on PATH (or $SPRINGBACK_ETCD)
with its data in a directory of ours, waits until it answers, and stops it.
The client and peer ports must be given: etcd cannot bind port 0 and report
it back, so callers pick free ones with `free_port` just before starting.

With `EtcdServerTls` the member serves clients on https:// only, with
``--client-cert-auth`` (a client needs a certificate signed by the CA), and,
given a password, enables etcd's auth after its first start: user ``root``
(random password, etcd needs it before ``auth enable``) and user
``springback`` whose role ``springback`` may read and write only keys under
``/springback/``. Peer URLs stay http:// (loopback members only).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import socket
import subprocess

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from springback.client import env as E
from springback.client.polling import wait_until
from springback.client.errors import StoreUnavailable
from springback.service.etcd import keys
from springback.service.etcd.store import EtcdSecurity, Store, StoreDenied


class EtcdNotFound(RuntimeError):
    pass


def etcd_binary() -> str:
    path = os.environ.get(E.ETCD) or shutil.which("etcd")
    if not path or not os.access(path, os.X_OK):
        raise EtcdNotFound(
            "no etcd binary: install one (Debian: apt-get install etcd-server) or set "
            f"{E.ETCD} to its path"
        )
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


PORT_ATTEMPTS = 3
"""Starts of an `EtcdServer` whose picked ports were taken meanwhile."""

USER = "springback"
"""The etcd user (and role) the coordinator uses, with access to `KEY_PREFIX` only."""

KEY_PREFIX = keys.PREFIX.split("v1/")[0]
"""``/springback/``: every Springback key, of every schema version."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EtcdServerTls:
    """PEM files of an etcd member behind TLS, and of the client it is checked with."""

    ca_file: str
    """The CA of the server certificate and of every client certificate."""
    cert_file: str
    """The member's certificate (its SANs must name the host clients dial)."""
    key_file: str
    client_cert_file: str
    """A client certificate signed by `ca_file` (for coordinators and checks)."""
    client_key_file: str
    password: str | None = dataclasses.field(default=None, repr=False)
    """With a password: etcd's auth enabled, user `USER` with this password."""


class EtcdServer:
    """One etcd member on loopback, for laptops and tests: alone by default, or
    one member of a loopback cluster when `initial_cluster` names its peers
    (``name=http://HOST:PEER_PORT,…``, this member included)."""

    def __init__(self, data_dir: str, *, client_port: int | None = None,
                 peer_port: int | None = None, host: str = "127.0.0.1", name: str = "springback",
                 initial_cluster: str | None = None, tls: EtcdServerTls | None = None) -> None:
        self.data_dir = data_dir
        self.tls = tls
        self.auth_enabled = False
        self.root_password = secrets.token_urlsafe(16)
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        # ports picked here may be taken by another process before etcd binds
        # them (nothing can hold a port for a child): such a start is retried
        # on fresh ones; ports the caller chose, or a cluster's, are not changed
        self._ports_ours = not client_port and not peer_port and initial_cluster is None
        self.name = name
        self.initial_cluster = initial_cluster
        self.process: subprocess.Popen | None = None
        self.log_path = os.path.join(data_dir, "etcd.log")

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    @property
    def client_security(self) -> EtcdSecurity | None:
        """What a client of this member needs: the CA, the client certificate
        and, once auth is on, user `USER` and its password."""
        if self.tls is None:
            return None
        user = USER if self.tls.password is not None else None
        return EtcdSecurity(ca_file=self.tls.ca_file, cert_file=self.tls.client_cert_file,
                            key_file=self.tls.client_key_file, user=user, password=self.tls.password)

    def coordinator_flags(self) -> list[str]:
        """``springback coordinator`` flags for `client_security` (the password
        goes in a file next to the data: flags never carry it)."""
        security = self.client_security
        if security is None:
            return []
        flags = ["--etcd-ca", security.ca_file or "", "--etcd-cert", security.cert_file or "",
                 "--etcd-key", security.key_file or ""]
        if security.password is not None:
            path = os.path.join(self.data_dir, "springback.password")
            os.makedirs(self.data_dir, exist_ok=True)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(security.password + "\n")
            flags += ["--etcd-user", USER, "--etcd-password-file", path]
        return flags

    def store(self, timeout_s: float = 5.0) -> Store:
        """A `Store` on this member with `client_security` (close it)."""
        return Store(self.endpoint, timeout_s=timeout_s, security=self._security_now())

    def _security_now(self) -> EtcdSecurity | None:
        security = self.client_security
        if security is not None and not self.auth_enabled:  # no users yet
            security = dataclasses.replace(security, user=None, password=None)
        return security

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def start(self, timeout_s: float = 20.0, *, wait: bool = True) -> None:
        """Starts etcd and (with `wait`) waits until it serves; raises on timeout
        (with its log's tail). A cluster's members must all be started before
        any serves: start them with ``wait=False``, then `wait_serving` each.
        When the ports were picked here and one was taken meanwhile (etcd
        exits: "address already in use"), starts again on fresh ports, up to
        `PORT_ATTEMPTS` times."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            mark = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
            self._spawn()
            if not wait:
                return
            try:
                self.wait_serving(timeout_s)
                if self.initial_cluster is None and self.tls and self.tls.password is not None:
                    self.enable_auth()
                return
            except RuntimeError:
                self.stop(kill=True)  # e.g. its data refuses our password: not left running
                taken = "address already in use" in self._tail(since=mark)
                if not (taken and self._ports_ours and attempt < PORT_ATTEMPTS):
                    raise
            self.client_port, self.peer_port = free_port(self.host), free_port(self.host)

    def _spawn(self) -> None:
        os.makedirs(self.data_dir, exist_ok=True)
        client = self.endpoint
        peer = f"http://{self.host}:{self.peer_port}"
        tls = [] if self.tls is None else [
            "--cert-file", self.tls.cert_file, "--key-file", self.tls.key_file,
            "--trusted-ca-file", self.tls.ca_file, "--client-cert-auth",
            # a throw-away local etcd: cheap password checks (each
            # authentication costs etcd one bcrypt hash, 2^cost rounds)
            "--bcrypt-cost", "4"]
        log = open(self.log_path, "ab")  # noqa: SIM115 (owned by the child)
        self.process = subprocess.Popen(
            [
                etcd_binary(), "--name", self.name,
                "--data-dir", os.path.join(self.data_dir, "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", self.initial_cluster or f"{self.name}={peer}", *tls,
            ],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()

    def wait_serving(self, timeout_s: float = 20.0) -> None:
        """Blocks until this member answers a (quorum) read; raises on timeout."""
        assert self.process is not None, "start() first"
        process = self.process
        store = self.store(timeout_s=1.0)

        def serving() -> bool:
            nonlocal store
            if process.poll() is not None:
                raise RuntimeError(f"etcd exited with {process.returncode}: {self._tail()}")
            try:
                store.get("/springback/v1/ping")
                return True
            except StoreDenied:  # it serves; its auth is on and we have no user yet
                return True
            except StoreUnavailable:
                # a fresh channel for the next try: this one waits out gRPC's
                # reconnect backoff (~0.9 s after a start here) before it
                # would see the etcd that came up meanwhile
                store.close()
                store = self.store(timeout_s=1.0)
                return False

        try:
            if not wait_until(serving, timeout_s=timeout_s, interval_s=0.05):
                self.stop()
                raise RuntimeError(f"etcd did not start within {timeout_s}s: {self._tail()}")
        finally:
            store.close()

    def enable_auth(self) -> None:
        """Creates users ``root`` and `USER` (role `USER`: readwrite on
        `KEY_PREFIX` only) and enables etcd's auth, once (for a cluster, on
        one member). Idempotent, also across processes on the same data: when
        etcd's auth is already on and `USER` signs in with our password,
        nothing is changed; a start interrupted half-way through is completed
        (what exists is kept, `USER` gets our password). Raises RuntimeError
        when auth is on but our password is refused (the data was made with
        other credentials), `grpc.RpcError` when etcd refuses otherwise."""
        assert self.tls is not None and self.tls.password is not None, "needs tls with a password"
        if self.auth_enabled:
            return
        security = self._security_now()
        assert security is not None
        channel = grpc.secure_channel(f"{self.host}:{self.client_port}", security.channel_credentials())
        try:
            auth = etcdrpc.AuthStub(channel)
            if self._auth_is_on(auth):
                self.auth_enabled = True
                return
            _unless_exists(auth.UserAdd, etcdrpc.AuthUserAddRequest(name="root", password=self.root_password))
            auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
            _unless_exists(auth.RoleAdd, etcdrpc.AuthRoleAddRequest(name=USER))
            prefix = KEY_PREFIX.encode()
            auth.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(
                name=USER, perm=auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=prefix,
                                                    range_end=prefix[:-1] + bytes([prefix[-1] + 1]))),
                timeout=5)
            if not _unless_exists(auth.UserAdd,
                                  etcdrpc.AuthUserAddRequest(name=USER, password=self.tls.password)):
                auth.UserChangePassword(etcdrpc.AuthUserChangePasswordRequest(
                    name=USER, password=self.tls.password), timeout=5)
            auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=USER, role=USER), timeout=5)
            auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=5)
        finally:
            channel.close()
        self.auth_enabled = True

    def _auth_is_on(self, auth: etcdrpc.AuthStub) -> bool:
        """Whether etcd's auth is on, with `USER` signing in with our password;
        RuntimeError when it is on and refuses that password."""
        assert self.tls is not None and self.tls.password is not None
        try:
            auth.Authenticate(etcdrpc.AuthenticateRequest(name=USER, password=self.tls.password),
                              timeout=5)
            return True
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and "not enabled" in (e.details() or ""):
                return False
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # wrong user or password
                raise RuntimeError(
                    f"etcd in {self.data_dir} has its auth on, and refuses user {USER!r} with the "
                    f"password given ({e.details()}): its data was made with other credentials"
                ) from None
            raise

    def _tail(self, since: int = 0) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self, kill: bool = False) -> None:
        """Stops etcd (SIGKILL when `kill`, else SIGTERM); data stays for a restart."""
        if self.process is None or self.process.poll() is not None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _unless_exists(call, request) -> bool:  # noqa: ANN001 (an etcd Auth RPC and its request)
    """``call(request)``; False, not an error, when etcd says the user or role
    already exists (a start interrupted after making it)."""
    try:
        call(request, timeout=5)
        return True
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.FAILED_PRECONDITION and "already exists" in (e.details() or ""):
            return False
        raise
