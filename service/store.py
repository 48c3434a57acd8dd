"""Typed access to etcd: protobuf values, fenced transactions, leases.

Every call has the client's deadline (``timeout_s``). Connection failures and
timeouts raise `StoreUnavailable` (the caller may retry: reads are idempotent,
and every write here is a compare-and-swap that either fully applied or did
not apply at all). The client reconnects by itself when etcd comes back.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlparse

import etcd3
import etcd3.exceptions
import etcd3.watch
import grpc
from google.protobuf.message import Message

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
    if not parsed.hostname or not parsed.port:
        raise InvalidArgument("etcd", f"endpoint {url!r} is not http://HOST:PORT")
    return parsed.hostname, parsed.port


def _translate(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (
            etcd3.exceptions.ConnectionFailedError,
            etcd3.exceptions.ConnectionTimeoutError,
            etcd3.exceptions.InternalServerError,
            etcd3.exceptions.NoServerAvailableError,
            grpc.RpcError,
        ) as e:
            raise StoreUnavailable(f"etcd unavailable: {type(e).__name__}: {e}") from e

    return wrapper


class Entry(NamedTuple):
    """A value with the etcd metadata the coordinator uses."""

    value: Any
    key: str
    mod_revision: int
    create_revision: int
    lease_id: int


class Store:
    """One etcd client; thread-safe (the underlying gRPC channel is)."""

    def __init__(self, endpoints: str, *, timeout_s: float = 5.0) -> None:
        urls = [u.strip() for u in endpoints.split(",") if u.strip()]
        if not urls:
            raise InvalidArgument("etcd", "no endpoint given")
        hosts = [_parse_endpoint(u) for u in urls]
        # A failed endpoint is retried after `time_retry` seconds; the etcd3
        # default (300 s) would turn a short etcd restart into a 5-minute outage.
        retry_s = 0.0 if len(hosts) == 1 else 1.0
        self._client = etcd3.MultiEndpointEtcd3Client(
            endpoints=[etcd3.Endpoint(h, p, secure=False, time_retry=retry_s) for h, p in hosts],
            timeout=timeout_s,
            failover=True,
        )
        self.endpoints = endpoints
        self.txn = self._client.transactions

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
    def fingerprint(self, prefix: str) -> tuple[int, int]:
        """(number of keys, newest mod revision) under `prefix`, in two small reads.

        Any put, create or delete under the prefix changes it, so a caller can
        skip re-reading an unchanged prefix.
        """
        count = self._client.get_prefix_response(prefix, count_only=True).count
        newest = self._client.get_prefix_response(
            prefix, sort_order="descend", sort_target="mod", keys_only=True, limit=1).kvs
        return count, newest[0].mod_revision if newest else 0

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
    def watch_prefix(self, prefix: str, callback: Callable[[Any], None]) -> Any:
        """Calls ``callback`` (on the client's watch thread) with every response
        for keys under `prefix` (``.events``: puts and deletes), or with an
        exception when the watch broke (watch again). Returns the watch id."""
        return self._client.add_watch_prefix_callback(prefix, callback)

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
