"""Forming one generation's process group from its plan.

Every node has a rendezvous store; the plan names the node-rank-0 agent's
store as ``master_addr:master_port``. In library mode the agent only holds the
store's listening socket and the process of its local rank 0 serves the
TCPStore on it (`host_node_store`): the agent needs no torch, and a crashed
local rank 0's replacement serves at the same address (the store's contents
die with the crashed process; every generation meets under keys of its own).
A generation's ranks meet under the key prefix
``springback/<job>/g<generation>/<secret>/`` of that store (`key_prefix`),
where the secret is the plan's `rendezvous_secret`: 128 random bits new with
every generation, sent only to the members the plan places. Stale ranks of an
older generation can never mix with the current one, and a party without the
plan, which may well reach the store (it takes any connection), can neither
find the generation's keys nor write any the generation reads
(docs/security.md).

Ranks first count themselves in with an *arrival barrier* polled on the store:
it waits up to the rendezvous timeout (slow starters: a restarted rank imports
torch) and gives up as soon as a newer plan is published (a member died before
arriving). Only when all ranks are present is ``init_process_group`` called,
with the short collective timeout, so a collective hung on a dead or stopped
peer raises within that timeout instead of torch's 30-minute default.

Once the group is connected every rank publishes the local addresses of its
sockets under the generation's prefix and reads its peers': gloo's error for
a peer whose process died ("connection closed by peer [ip]:port") then names
the peer's rank (`lost_peer_rank`), which the coordinator takes as evidence
that the peer's node is gone (service/core/evidence.py). What a peer publishes is
checked against this rank's own connections: only an address that is the far
end of one of them is taken, and one that two ranks claim is taken for
neither (`_publish_endpoints`), so a wrong entry cannot make the coordinator
fence a live peer's node.

Tearing a gloo group down has a trap: a gloo worker thread that finished a
collective on tensors Python also knows releases them under the GIL, and the
group's destructor joins those threads while the GIL is held (for instance
when the user's DDP wrapper, the group's last owner, is garbage collected). If
the thread has not released its tensors yet, the process deadlocks. So the
library registers the tensors it hands to collectives (`handed_to_gloo`) and
`leave_group` waits, with the GIL released, until gloo has let go of them.

A rank leaving a *broken* generation also shuts down its connections to the
group's peers (`shut_peer_connections`). Destroying the group is not enough:
the user's DDP wrapper still holds it until the next generation's
``DDP(...)``, so its sockets would stay open, and a peer blocked receiving
from this rank (not from the dead one) would wait out the collective timeout.
Shut, the peer fails at once, and gloo's threads here stop waiting on the
network and let go of their tensors before the old wrapper is freed (which
ended the deadlock above for DDP's own buckets: soak test in
tests/worker/test_session.py).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import re
import socket
import time
import traceback
import weakref
from collections.abc import Callable, Container

import torch
import torch.distributed as dist

from springback.client import plans
from springback.client.polling import wait_until

log = logging.getLogger(__name__)


_node_store: dist.TCPStore | None = None  # the node's store, where this process serves it


def host_node_store(fd: int) -> None:
    """Serves the node's rendezvous store on the listening socket `fd` that
    the agent holds (``SPRINGBACK_STORE_FD``), for the rest of this process's
    life; called by the process of local rank 0 once it knows it is local
    rank 0. Idempotent. Raises what TCPStore raises when `fd` is not a
    listening socket (the rank then fails, and its agent reports it)."""
    global _node_store
    if _node_store is not None:
        return
    with socket.socket(fileno=os.dup(fd)) as listening:
        host, port = listening.getsockname()[:2]
        v6_only = (listening.family == socket.AF_INET6
                   and listening.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY))
    # the server's own client connects to it through this address: the one
    # the agent bound (its advertised address), or loopback for a wildcard
    if host in ("", "0.0.0.0", "::"):
        host = "::1" if v6_only else "127.0.0.1"
    _node_store = dist.TCPStore(host, port, is_master=True,
                                master_listen_fd=fd, wait_for_workers=False)
    log.info("serving the node's rendezvous store on port %d", port)


_handed: list[weakref.ref] = []  # tensors given to collectives, maybe still held by gloo


def handed_to_gloo(*tensors: torch.Tensor) -> None:
    """Registers tensors just passed to a collective; `leave_group` waits until
    nothing but the caller's own references could keep them alive. Callers must
    not keep them beyond the generation."""
    _handed[:] = [r for r in _handed if r() is not None]
    _handed.extend(weakref.ref(t) for t in tensors)


def _await_gloo_release(timeout_s: float) -> None:
    # A short interval: each sleep releases the GIL for the gloo thread that needs it.
    if not wait_until(lambda: all(r() is None for r in _handed), timeout_s=timeout_s,
                      interval_s=0.001):
        log.warning("gloo still holds collective tensors after %.1fs; "
                    "tearing the group down anyway", timeout_s)
    _handed.clear()


class RendezvousAborted(Exception):
    """A newer plan appeared, or the deadline passed, before all ranks arrived."""


def _connect(host: str, port: int, deadline: float,
             superseded: Callable[[], bool]) -> dist.TCPStore:
    last: Exception | None = None

    def connected() -> dist.TCPStore | None:
        nonlocal last
        try:
            return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=5))
        except (RuntimeError, dist.DistError) as e:  # master unreachable (yet)
            last = e
            return None

    store = wait_until(connected, timeout_s=deadline - time.monotonic(), interval_s=0.1,
                       abandon=superseded)
    if store is not None:
        return store
    if superseded():
        raise RendezvousAborted("a newer plan was published while connecting")
    raise RendezvousAborted(f"rendezvous store {host}:{port} unreachable: {last}")


def key_prefix(job_id: str, generation: int, secret: str) -> str:
    """`plans.store_prefix`, warning when the plan carries no secret."""
    if not secret:
        log.warning("generation %d's plan carries no rendezvous secret (a coordinator older "
                    "than Plan.rendezvous_secret): its store keys are predictable", generation)
    return plans.store_prefix(job_id, generation, secret)


def form_group(*, job_id: str, generation: int, secret: str, rank: int, world_size: int,
               master_addr: str, master_port: int, backend: str,
               collective_timeout_s: float, rendezvous_timeout_s: float,
               superseded: Callable[[], bool]) -> dist.Store:
    """Initialises the default process group for one generation; returns
    the generation's own store (keys under it are this generation's only).
    Every key lies under `key_prefix` (`secret`: the plan's
    `rendezvous_secret`; ranks given different secrets never meet: each
    waits out the deadline).

    Blocks until all `world_size` ranks arrived (up to `rendezvous_timeout_s`).
    Raises RendezvousAborted when `superseded()` turns true or the deadline
    passes; the caller then waits for the next plan. Not idempotent: call
    `leave_group` before forming the next generation's group.
    """
    deadline = time.monotonic() + rendezvous_timeout_s
    namespace = key_prefix(job_id, generation, secret)
    store = _connect(master_addr, master_port, deadline, superseded)
    prefix = dist.PrefixStore(namespace, store)
    prefix.add("arrived", 1)
    if not wait_until(lambda: prefix.add("arrived", 0) >= world_size, interval_s=0.01,
                      timeout_s=deadline - time.monotonic(), abandon=superseded):
        if superseded():
            raise RendezvousAborted("a newer plan was published before all ranks arrived")
        raise RendezvousAborted(
            f"only {prefix.add('arrived', 0)}/{world_size} ranks arrived within "
            f"{rendezvous_timeout_s:.0f}s")
    _reset_group_count()
    forget_meshes()
    dist.init_process_group(backend, store=dist.PrefixStore("pg/", prefix), rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout_s))
    _exchange_endpoints(prefix, rank, world_size)
    global _watch
    if rank == 0 and secret:  # without a secret the guessable names are the real ones
        try:  # its own connection: the reporter's thread uses it
            own = dist.TCPStore(master_addr, master_port, is_master=False,
                                wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
            _watch = IntrusionWatch(own, job_id, generation, world_size)
        except Exception as e:  # noqa: BLE001 - the watch must not stop the generation
            log.warning("generation %d: no look for an intruder's keys: %s", generation, e)
    return dist.PrefixStore("sb/", prefix)


INTRUSION_CHECK_S = 1.0
"""Least time between two of rank 0's looks for an intruder's keys."""
INTRUSION_RANKS = 4
"""The first ranks whose guessable ``endpoints/<r>`` names are looked at."""


class IntrusionWatch:
    """Rank 0's look for keys under the names an outsider can guess: the
    layout before `Plan.rendezvous_secret`, ``springback/<job>/g<N>//arrived``
    and ``…//endpoints/<r>`` (the first `INTRUSION_RANKS` ranks), of this
    generation and the next (job ids and generations are no secret). No
    rank writes there (every key lies under the secret), so such a key is
    a party without the plan trying to count itself in or claim a rank's
    address. Keys under any other name cannot be seen this way (the store
    does not say who asked for what); they are read by no rank either.

    Called from the step reporter's thread only (its own connection to the
    store, a clone): `found` looks at most every `INTRUSION_CHECK_S`, one
    `check` per name (TCPStore's check is true only when every key named
    exists), and once something was found says the same from then on."""

    def __init__(self, store: dist.Store, job_id: str, generation: int,
                 world_size: int) -> None:
        self._store: dist.Store | None = store
        self.generation = generation
        self.names = [plans.store_prefix(job_id, g, "") + "/" + key
                      for g in (generation, generation + 1)
                      for key in ("arrived", *(f"endpoints/{r}"
                                               for r in range(min(world_size, INTRUSION_RANKS))))]
        self._next_at = 0.0
        self._found = ""

    def found(self) -> str:
        """What was found under the guessable names ("" while nothing)."""
        now = time.monotonic()
        if self._found or self._store is None or now < self._next_at:
            return self._found
        self._next_at = now + INTRUSION_CHECK_S
        try:
            there = [name for name in self.names if self._store.check([name])]
        except Exception as e:  # noqa: BLE001 - the store went with its generation
            log.info("generation %d: looking for keys under the store's guessable names: %s",
                     self.generation, e)
            self._store = None
            return ""
        if there:
            self._found = (f"generation {self.generation}: keys under the rendezvous store's "
                           f"guessable names (no rank writes there): {', '.join(there)}")
            log.warning("%s: a party without the plan tried to enter", self._found)
        return self._found


_watch: IntrusionWatch | None = None  # rank 0's, of the generation it is in


def store_intrusion(generation: int) -> str:
    """`IntrusionWatch.found` of `generation` ("" when this process watches
    no store of that generation: not rank 0, or the group was left)."""
    watch = _watch
    return watch.found() if watch is not None and watch.generation == generation else ""


def _reset_group_count() -> None:
    """torch names a new group after its process-wide group counter and keys
    the group's store entries with that name. A failed `init_process_group`
    (a peer vanished mid-init) leaves the counter raised with no group to
    destroy, so this rank's next default group would meet its peers under a
    different name and every rank would time out. The counter is reset (as
    `destroy_process_group` does) so the default group is group 0 everywhere."""
    if dist.get_pg_count() != 0 and not dist.is_initialized():
        # The one private torch API outside storage/compat.py (kept here so that
        # a rank's start does not import all of springback.storage); its test is
        # in tests/storage/test_compat.py with the others.
        dist.distributed_c10d._world.group_count = 0  # no public setter


def forget_meshes() -> None:
    """DTensor caches its sharding decisions by value, and a `DeviceMesh`
    equals any other of the same layout: an op on the new generation's
    DTensors that hits an entry made in an earlier generation returns a
    DTensor bound to that generation's mesh, whose groups are gone (the
    next collective fails with "Could not resolve the process group", or
    worse, meets a group of the same name and other ranks). Those caches
    (the C++ and Python sharding propagation caches and the redistribute
    planner's) are emptied before every generation's group is formed:
    `form_group` does it, and so must whatever forms a group otherwise. Private
    torch APIs, like `_reset_group_count` (tests/storage/test_compat.py)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def leave_group(release_timeout_s: float = 5.0, *, broken: bool = False,
                cause: BaseException | None = None) -> None:
    """Destroys the default process group if there is one. Never raises: a group
    broken by a dead peer is torn down as far as possible and dropped.

    With `broken` (the generation failed; this rank will not finish its
    collectives), first shuts down this rank's connections to the group's
    peers (`shut_peer_connections`): a peer blocked receiving from this rank
    then fails at once instead of after the collective timeout, even while the
    group object outlives this call (the user's DDP wrapper holds it until
    the next generation's ``DDP(...)``), and gloo's own threads here stop
    waiting on the network. Then waits up to `release_timeout_s` for gloo's
    worker threads to release the tensors registered with `handed_to_gloo`
    (see the module docstring). `cause`, the exception that broke the
    generation, has the local variables of its traceback's finished frames
    cleared first: they hold the failed collective's tensors (the vote in
    flight, a gather's buffers) and would keep that wait from ending until its
    timeout."""
    global _watch
    _watch = None
    if broken:
        shut_peer_connections()
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        traceback.clear_frames(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__
    _await_gloo_release(release_timeout_s)
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - a broken group must not stop recovery
        log.warning("destroying a broken process group: %s", e)


# What gloo's transport (and NCCL, the store) put in the errors they raise
# when a peer dies, resets or times out. torch raises most of them as plain
# RuntimeError, so the message is all there is to tell them from a user's own.
_COLLECTIVE_ERROR_MARKERS = (
    "gloo/transport", "Connection reset by peer", "Connection closed by peer",
    "Timed out waiting", "NCCL", "Socket Timeout", "Broken pipe",
)


_endpoint_ranks: dict[str, int] = {}  # "ip:port" of a peer's socket -> its rank


def _socket_fds() -> dict[int, int]:
    """Socket inode -> file descriptor, for this process's open sockets."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            fds[int(target[8:-1])] = int(fd)
    return fds


def shut_peer_connections() -> int:
    """Shuts down, both ways, this process's TCP connections to the current
    generation's peers: those whose remote address a peer published in the
    endpoint exchange (gloo's pairs; a rank hosts no store its peers use).
    The file descriptors stay open: gloo still owns and closes them. Peers see
    "connection closed by peer" naming this rank, which the coordinator takes
    as half the evidence of a lost node only; this rank's agent is alive, so
    no fence follows (service/core/evidence.py). Returns how many were shut; never
    raises."""
    peers = set(_endpoint_ranks)
    if not peers:
        return 0
    fds = _socket_fds()
    shut = 0
    for inode, _, remote in _connections(fds):
        if remote not in peers:
            continue
        try:
            dup = os.dup(fds[inode])
        except OSError:
            continue  # closed meanwhile
        try:
            if os.fstat(dup).st_ino != inode:
                continue  # the number was reused for another file meanwhile
            with socket.socket(fileno=dup) as sock:
                dup = -1  # the socket object closes it
                sock.shutdown(socket.SHUT_RDWR)
                shut += 1
        except OSError:
            pass  # already reset or shut by gloo
        finally:
            if dup >= 0:
                os.close(dup)
    log.info("shut %d connections to the broken generation's peers", shut)
    return shut


def _connections(inodes: Container[int]) -> list[tuple[int, str, str]]:
    """(socket inode, local "ip:port", remote "ip:port") of the TCP sockets of
    this network namespace whose inode is in `inodes` (Linux /proc); only
    those are decoded: the namespace may hold many more."""
    out = []
    for table, width in (("/proc/self/net/tcp", 4), ("/proc/self/net/tcp6", 16)):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and int(fields[9]) in inodes:
                out.append((int(fields[9]), _endpoint(fields[1], width),
                            _endpoint(fields[2], width)))
    return out


def _endpoint(hex_address: str, width: int) -> str:
    """/proc/net/tcp's "0100007F:1F90" as "127.0.0.1:8080" (v4-mapped v6 as v4)."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # each 32-bit word is in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw) if width == 4 else ipaddress.IPv6Address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip}:{int(port, 16)}"


def _exchange_endpoints(prefix: dist.Store, rank: int, world_size: int) -> None:
    """Every rank publishes its sockets' local addresses once the group is
    connected (gloo connects the full mesh in `init_process_group`) and reads
    its peers', so that a later "connection closed by peer [ip]:port" names the
    peer's rank (`lost_peer_rank`). One set and one multi-get on the store."""
    _endpoint_ranks.clear()
    _publish_endpoints(prefix, "endpoints", rank, world_size)


def note_subgroup_endpoints(store: dist.Store, rank: int, world_size: int) -> None:
    """`_exchange_endpoints` again, after the generation's subgroups (a
    DeviceMesh's dimensions) connected their own sockets: a reset on one of
    those then names the peer too. Every rank of the generation calls it
    once, with the generation's store; blocks until all have (store timeout)."""
    _publish_endpoints(store, "subgroup-endpoints", rank, world_size)


def _publish_endpoints(store: dist.Store, key: str, rank: int, world_size: int) -> None:
    """Publishes this rank's sockets' local addresses and records its peers':
    only those that are the far end of one of this rank's own connections
    (all a "closed by peer [ip]:port" error can name); any other is ignored.
    An address two peers claim is recorded for neither and logged at info
    level: on one host (one IP) two processes' outgoing connections may share
    a local port, so such a pair is not a forgery on its own; for the same
    reason a peer's address may equal one of this rank's own local addresses
    and still be the far end of one of its connections."""
    connections = _connections(_socket_fds())
    own = {local for _, local, _ in connections}
    known = {far for _, _, far in connections}
    store.set(f"{key}/{rank}", json.dumps(sorted(own)))
    peers = [r for r in range(world_size) if r != rank]
    if not peers:
        return
    claims: dict[str, set[int]] = {}
    for peer, raw in zip(peers, store.multi_get([f"{key}/{r}" for r in peers]),
                         strict=True):
        try:
            published = json.loads(bytes(raw).decode())
        except ValueError:
            log.error("rank %d's published %s is not JSON: refused", peer, key)
            continue
        if not isinstance(published, list):
            log.error("rank %d's published %s is not a list: refused", peer, key)
            continue
        for endpoint in published:
            if isinstance(endpoint, str) and endpoint in known:
                claims.setdefault(endpoint, set()).add(peer)
    for endpoint, claimants in claims.items():
        if len(claimants) > 1:
            log.info("refused %s %s claimed by ranks %s", key, endpoint, sorted(claimants))
            continue
        _endpoint_ranks[endpoint] = next(iter(claimants))


_PEER_GONE = re.compile(r"(?:Connection (?:closed|reset) by peer|Broken pipe).*?"
                        r"\[([0-9A-Fa-f.:]+)\]:(\d+)|\[([0-9A-Fa-f.:]+)\]:(\d+).*?"
                        r"(?:Connection (?:closed|reset) by peer|Broken pipe)", re.S)


def lost_peer_rank(exc: BaseException) -> int | None:
    """The rank of the peer whose process is gone, when `exc` is gloo's
    "connection closed/reset by peer [ip]:port" for a socket of this
    generation's group; None for anything else (a timeout: the peer may be
    alive but stopped or cut off; an address no peer published)."""
    match = next((m for e in _causes(exc) if (m := _PEER_GONE.search(str(e)))), None)
    if match is None:
        return None
    ip, text = (match.group(1), match.group(2)) if match.group(1) else (
        match.group(3), match.group(4))
    port = int(text)
    # gloo (torch 2.13) prints the port in network byte order: try both
    swapped = ((port & 0xFF) << 8) | (port >> 8)
    found = _endpoint_ranks.get(f"{ip}:{port}")
    return found if found is not None else _endpoint_ranks.get(f"{ip}:{swapped}")


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was explicitly raised from (``raise ... from
    e``: `__cause__`), outermost first. torch wraps a collective's error in
    its own: pipelining's ``stage_backward`` re-raises an FSDP reduction's
    gloo error as ``RuntimeError("Failed to run stage backward ...")``."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(chain) < 16 and all(current is not e for e in chain):
        chain.append(current)
        current = current.__cause__
    return chain


def _is_collective_error(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(marker in text for marker in _COLLECTIVE_ERROR_MARKERS)


def failure_line(exc: BaseException) -> str:
    """One line naming what broke: the first non-blank line of the collective
    error in `exc`'s chain (torch's wrappers name none and open with a blank
    line), else of `exc` or a cause, else its repr."""
    chain = _causes(exc)
    ordered = [e for e in chain if _is_collective_error(e)] + chain
    return next((line.strip() for e in ordered for line in str(e).splitlines()
                 if line.strip()), repr(exc))


def is_collective_failure(exc: BaseException) -> bool:
    """True when `exc`, or an exception it was raised from, is what a
    collective or the store raises because a peer died, hung or was cut off:
    the generation broke, not the user's code."""
    return any(_is_collective_error(e) for e in _causes(exc))
