"""Typed access to etcd: protobuf values, fenced transactions, leases.

Every call has the client's deadline (``timeout_s``). Connection failures and
timeouts raise `StoreUnavailable` (the caller may retry: reads are idempotent,
and every write here is a compare-and-swap that either fully applied or did
not apply at all). The client reconnects by itself when etcd comes back.

etcd behind TLS and its own auth (`EtcdSecurity`): ``https://`` endpoints
are verified against a CA and may present a client certificate; with a user,
the client authenticates for a token, lazily (a Store made while etcd is down
works once it is back) and again whenever etcd rejects the token (a simple
token dies with an etcd restart, or after ``--auth-token-ttl`` unused): such a
call was refused before it applied anything, so it is retried once with the
new token. A refused password or a denied key raises `StoreDenied` (a
`StoreUnavailable`: nothing was applied; retrying will not help until the
operator fixes the user or its role). Bad settings raise `InvalidArgument`
("etcd") before any connection is made.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import types
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlparse

import etcd3
import etcd3.exceptions
import etcd3.watch
import grpc
from google.protobuf.message import Message

from etcd3 import etcdrpc

from springback.client.errors import InvalidArgument, StoreUnavailable

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

# python3-etcd3 0.13 dropped `six` but its watcher still calls six.itervalues
# when a watch stream ends: the watch thread died with a NameError before any
# callback heard that its watch broke (watchers then saw nothing until a
# resync noticed). Give the module the one name it uses.
if not hasattr(etcd3.watch, "six"):
    etcd3.watch.six = types.SimpleNamespace(itervalues=lambda d: iter(d.values()))


def _parse_endpoint(url: str) -> tuple[str, int]:
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if parsed.scheme not in ("http", "https"):
        raise InvalidArgument("etcd", f"endpoint {url!r}: scheme {parsed.scheme!r} is not "
                              "http or https")
    if not parsed.hostname or parsed.port is None:
        raise InvalidArgument("etcd", f"endpoint {url!r} is not http(s)://HOST:PORT")
    return parsed.hostname, parsed.port


class StoreDenied(StoreUnavailable):
    """etcd refused this client: its password, or its role's access to a key.
    Nothing was applied; a retry fails the same way until the operator fixes
    the etcd user or role."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EtcdSecurity:
    """How to reach an etcd behind TLS and its own auth (all optional)."""

    ca_file: str | None = None
    """PEM CA bundle that signed etcd's server certificate (required with https://)."""
    cert_file: str | None = None
    """PEM client certificate, for an etcd started with ``--client-cert-auth``."""
    key_file: str | None = None
    """PEM private key of `cert_file` (both or neither)."""
    user: str | None = None
    """etcd user to authenticate as (its role decides which keys it may use)."""
    password: str | None = dataclasses.field(default=None, repr=False)
    """That user's password (required with `user`; never logged)."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise InvalidArgument("etcd", "cert_file and key_file (--etcd-cert, --etcd-key) "
                                  "go together: give both or neither")
        if (self.user is None) != (self.password is None):
            raise InvalidArgument("etcd", "user and password (--etcd-user, --etcd-password-file) "
                                  "go together: give both or neither")
        if self.user == "":
            raise InvalidArgument("etcd", "user (--etcd-user) is empty")

    @property
    def uses_tls(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials from the files; `InvalidArgument` naming a file that
        cannot be read."""
        def read(name: str, path: str | None) -> bytes | None:
            if path is None:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise InvalidArgument("etcd", f"{name} {path!r} cannot be read: "
                                      f"{e.strerror or e}") from None

        return grpc.ssl_channel_credentials(read("ca_file", self.ca_file),
                                            read("key_file", self.key_file),
                                            read("cert_file", self.cert_file))


def parse_endpoints(endpoints: str, security: EtcdSecurity | None) -> tuple[list[tuple[str, int]], bool]:
    """(host, port) of each comma-separated endpoint, and whether they use TLS.
    `InvalidArgument` ("etcd") for no endpoint, a scheme other than http/https,
    a mix of both, https without a CA, TLS files or a password over http."""
    urls = [u.strip() for u in endpoints.split(",") if u.strip()]
    if not urls:
        raise InvalidArgument("etcd", "no endpoint given")
    hosts = [_parse_endpoint(u) for u in urls]
    schemes = {urlparse(u).scheme if "://" in u else "http" for u in urls}
    if len(schemes) > 1:
        raise InvalidArgument("etcd", f"endpoints {endpoints!r} mix http:// and https://")
    secure = schemes == {"https"}
    security = security or EtcdSecurity()
    if secure and security.ca_file is None:
        raise InvalidArgument("etcd", "https:// endpoints need ca_file (--etcd-ca), the CA "
                              "that signed etcd's certificate")
    if not secure and security.uses_tls:
        raise InvalidArgument("etcd", "ca_file/cert_file/key_file (--etcd-ca, --etcd-cert, "
                              "--etcd-key) are given but the endpoints are http://: use https://")
    if not secure and security.user is not None:
        raise InvalidArgument("etcd", "user (--etcd-user) over http:// would send the password "
                              "in clear text: use https:// endpoints")
    return hosts, secure


RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                     ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)]
"""gRPC's reconnect backoff towards etcd, capped at 1 s. Its default grows to
120 s (1 s × 1.6 per failed attempt): after an outage of 15 s the channel
could wait another 6 s before it tries a returned etcd, longer than a
member's liveness timeout, so members whose leases etcd just renewed would
expire unheartbeated. Attempts stay cheap (one TCP connect and TLS handshake
a second per endpoint)."""


AUTH_TIMEOUT_S = 5.0
"""The least deadline of an Authenticate call, whatever the store's own (the
liveness probe's is 0.5 s): etcd checks the password with bcrypt and agrees
the token through raft, which on a loaded machine takes longer than 0.5 s;
with the short deadline a store could stay unauthenticated for as long as
the load lasted."""


def _token_rejected(error: grpc.RpcError) -> bool:
    """etcd no longer knows this client's token (it restarted, the token
    expired, or the auth store changed): the call was refused unapplied."""
    code = error.code() if callable(getattr(error, "code", None)) else None
    details = (error.details() if callable(getattr(error, "details", None)) else "") or ""
    return code == grpc.StatusCode.UNAUTHENTICATED or "auth store is old" in details


def _store_error(error: grpc.RpcError) -> StoreUnavailable:
    code = error.code() if callable(getattr(error, "code", None)) else None
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        return StoreDenied(f"etcd refused this client ({code.name}): {error.details()}")
    return StoreUnavailable(f"etcd unavailable: {type(error).__name__}: {error}")


def _translate(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(self: Store, *args: Any, **kwargs: Any) -> Any:
        for attempt in (1, 2):
            token = self._token
            try:
                if self._security.user is not None and token is None:
                    token = self._authenticate(None)
                return fn(self, *args, **kwargs)
            except grpc.RpcError as e:
                if attempt == 1 and self._security.user is not None and _token_rejected(e):
                    self._authenticate(token)  # and retry: nothing was applied
                    continue
                raise _store_error(e) from e
            except (
                etcd3.exceptions.ConnectionFailedError,
                etcd3.exceptions.ConnectionTimeoutError,
                etcd3.exceptions.InternalServerError,
                etcd3.exceptions.NoServerAvailableError,
            ) as e:
                raise StoreUnavailable(f"etcd unavailable: {type(e).__name__}: {e}") from e
        raise AssertionError("unreachable")

    return wrapper


class Entry(NamedTuple):
    """A value with the etcd metadata the coordinator uses."""

    value: Any
    key: str
    mod_revision: int
    create_revision: int
    lease_id: int


class Store:
    """One etcd client; thread-safe (the underlying gRPC channel is).

    `InvalidArgument` ("etcd") for bad endpoints or `security` (see
    `parse_endpoints`, `EtcdSecurity`); nothing connects before the first call.
    """

    def __init__(self, endpoints: str, *, timeout_s: float = 5.0,
                 security: EtcdSecurity | None = None) -> None:
        hosts, secure = parse_endpoints(endpoints, security)
        self._security = security or EtcdSecurity()
        creds = self._security.channel_credentials() if secure else None
        # A failed endpoint is retried after `time_retry` seconds; the etcd3
        # default (300 s) would turn a short etcd restart into a 5-minute outage.
        retry_s = 0.0 if len(hosts) == 1 else 1.0
        # user/password are not handed to the etcd3 client: it would
        # authenticate once, in its constructor (failing while etcd is down),
        # and never again once etcd forgot the token.
        self._client = etcd3.MultiEndpointEtcd3Client(
            endpoints=[etcd3.Endpoint(h, p, secure=secure, creds=creds, time_retry=retry_s,
                                      opts=RECONNECT_OPTIONS)
                       for h, p in hosts],
            timeout=timeout_s,
            failover=True,
        )
        self._timeout_s = timeout_s
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self.endpoints = endpoints
        self.security = security
        self.txn = self._client.transactions

    def _authenticate(self, stale: str | None) -> str:
        """A fresh token (unless another thread already replaced `stale`),
        used by every later call and watch stream. `StoreDenied` when etcd
        refuses the user or password, `StoreUnavailable` when unreachable."""
        with self._auth_lock:
            if self._token is not None and self._token != stale:
                return self._token
            request = etcdrpc.AuthenticateRequest(name=self._security.user,
                                                  password=self._security.password)
            try:
                # a stub of its own on the endpoint in use, or the next one not
                # failed: the client's cached authstub stays bound to the
                # endpoint it was made on, even after that endpoint failed
                stub = etcdrpc.AuthStub(self._client.channel)
                token = stub.Authenticate(request, max(self._timeout_s, AUTH_TIMEOUT_S)).token
            except etcd3.exceptions.NoServerAvailableError as e:
                raise StoreUnavailable(f"etcd unavailable: authenticating: {e}") from e
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                    raise StoreDenied(f"etcd refused user {self._security.user!r}: "
                                      f"{e.details()}") from e
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self._client.endpoint_in_use.fail()  # as the client does: try the next one
                raise StoreUnavailable(f"etcd unavailable: authenticating: {e.details()}") from e
            self._client.metadata = (("token", token),)
            watcher = self._client._stubs.get("watcher")
            if watcher is not None:  # its next stream (a broken one is reopened) uses it
                watcher._metadata = self._client.metadata
            self._token = token
            return token

    def close(self) -> None:
        self._client.close()

    # -- reads -------------------------------------------------------------

    @staticmethod
    def _entries(kvs: Any, message_type: type[M] | None) -> list[Entry]:
        # Straight from the RangeResponse: at 10,000 keys the client library's
        # per-key metadata objects cost more than the read itself.
        parse = message_type.FromString if message_type is not None else bytes
        return [
            Entry(parse(kv.value), kv.key.decode(), kv.mod_revision, kv.create_revision, kv.lease)
            for kv in kvs
        ]

    @_translate
    def get(self, key: str, message_type: type[M] | None = None) -> Entry | None:
        entries = self._entries(self._client.get_response(key).kvs, message_type)
        return entries[0] if entries else None

    @_translate
    def get_prefix(self, prefix: str, message_type: type[M] | None = None) -> list[Entry]:
        response = self._client.get_prefix_response(prefix, sort_order="ascend")
        return self._entries(response.kvs, message_type)

    @_translate
    def count(self, prefix: str, revision: int | None = None) -> int:
        """The number of keys under `prefix` (at `revision`; None: now), in one
        count-only read (etcd sends no key: the cost of a join's check
        against the members cap)."""
        return int(self._client.get_prefix_response(prefix, count_only=True,
                                                    revision=revision).count)

    def fingerprint(self, prefix: str) -> tuple[int, int]:
        """(number of keys, newest mod revision) under `prefix`, in two small reads.

        Any put, create or delete under the prefix changes it, so a caller can
        skip re-reading an unchanged prefix. The newest revision costs etcd a
        read and a sort of every key under the prefix (etcd 3.4): not for a
        prefix that grows with the members on a hot path (`memberwatch`).
        """
        count, newest, _ = self.fingerprint_at(prefix)
        return count, newest

    @_translate
    def fingerprint_at(self, prefix: str) -> tuple[int, int, int]:
        """`fingerprint` and the revision that both of its reads read at:
        (number of keys, newest mod revision, revision)."""
        response = self._client.get_prefix_response(
            prefix, sort_order="descend", sort_target="mod", keys_only=True, limit=1)
        revision = int(response.header.revision)
        newest = response.kvs[0].mod_revision if response.kvs else 0
        return self.count(prefix, revision), newest, revision

    @_translate
    def revisions(self, prefix: str) -> tuple[dict[str, int], int]:
        """Key -> mod revision of every key under `prefix`, and the revision
        read at, in one read of keys only (no values)."""
        response = self._client.get_prefix_response(prefix, keys_only=True)
        return ({kv.key.decode(): kv.mod_revision for kv in response.kvs},
                int(response.header.revision))

    @_translate
    def leases(self, prefix: str) -> dict[str, int]:
        """Key -> lease id of every key under `prefix`, in one read of keys
        only (no values: at 10,000 members a fraction of `get_prefix`)."""
        response = self._client.get_prefix_response(prefix, keys_only=True)
        return {kv.key.decode(): kv.lease for kv in response.kvs}

    @_translate
    def exists(self, key: str) -> bool:
        """Whether `key` exists, read without its value."""
        return bool(self._client.get_response(key, count_only=True).count)

    # -- writes ------------------------------------------------------------

    @_translate
    def transaction(self, compare: list[Any], success: list[Any]) -> bool:
        """Applies `success` atomically iff every comparison holds."""
        ok, _ = self._client.transaction(compare=compare, success=success, failure=[])
        return bool(ok)

    @_translate
    def put(self, key: str, value: Message | bytes, lease: Any = None) -> None:
        data = value if isinstance(value, bytes) else value.SerializeToString()
        self._client.put(key, data, lease=lease)

    @_translate
    def delete(self, key: str) -> bool:
        return bool(self._client.delete(key))

    # -- watches -----------------------------------------------------------

    @_translate
    def watch_prefix(self, prefix: str, callback: Callable[[Any], None],
                     start_revision: int | None = None) -> Any:
        """Calls ``callback`` (on the client's watch thread) with every response
        for keys under `prefix` (``.events``: puts and deletes, from
        `start_revision` on when given, else from now), or with an exception
        (or None) when the watch broke (watch again). Returns the watch id."""
        return self._client.add_watch_prefix_callback(prefix, callback,
                                                      start_revision=start_revision)

    def cancel_watch(self, watch_id: Any) -> None:
        """Stops a watch; best effort (a broken connection already ended it)."""
        try:
            self._client.cancel_watch(watch_id)
        except Exception as e:  # noqa: BLE001 (closing: nothing to do about it)
            log.debug("cancel_watch: %s", e)

    # -- leases ------------------------------------------------------------

    @_translate
    def grant_lease(self, ttl_s: int) -> Any:
        return self._client.lease(ttl_s)

    @_translate
    def refresh_lease(self, lease_id: int) -> int:
        """Renews a lease; returns its TTL in seconds, <= 0 when it expired."""
        for response in self._client.refresh_lease(lease_id):
            return int(response.TTL)
        return 0

    @_translate
    def lease_time_left(self, lease_id: int) -> tuple[int, int]:
        """(seconds left, seconds granted) of a lease, whole seconds as etcd
        keeps them; left <= 0 when it expired. Reads only (renews nothing)."""
        response = self._client.get_lease_info(lease_id)
        return int(response.TTL), int(response.grantedTTL)

    @_translate
    def revoke_lease(self, lease_id: int) -> None:
        self._client.revoke_lease(lease_id)
