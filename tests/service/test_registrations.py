"""Plan streams' registration checks share their etcd reads, and no answer is older than its question."""

from __future__ import annotations

import asyncio
import threading

import pytest

from springback.client.errors import StoreUnavailable
from springback.service.transport.planstreams import Registrations


class _Store:
    """Just what `Registrations` reads: the job key's existence and the members' keys."""

    def __init__(self) -> None:
        self.members: set[str] = set()
        self.job = True
        self.reads = 0
        self.fail = False
        self.release = threading.Event()
        self.release.set()

    def exists(self, key: str) -> bool:
        return self.job

    def leases(self, prefix: str) -> dict[str, int]:
        seen = set(self.members)  # as etcd answers: what is registered when the read begins
        self.release.wait(10)
        self.reads += 1
        if self.fail:
            raise StoreUnavailable("etcd unavailable")
        return {prefix + m: 1 for m in seen}


@pytest.mark.timeout(30)
def test_a_thousand_checks_at_once_cost_a_read_or_two():
    store = _Store()
    store.members = {f"m-{i}" for i in range(1000)}

    async def main() -> list:
        registrations = Registrations(store, gap_s=0.0)  # type: ignore[arg-type]
        return await asyncio.gather(*(registrations.members("j") for _ in range(1000)))

    answers = asyncio.run(main())
    assert all(a == frozenset(store.members) for a in answers)
    assert store.reads <= 2


@pytest.mark.timeout(30)
def test_a_check_asked_during_a_read_waits_for_the_next_one():
    store = _Store()

    async def main() -> tuple:
        registrations = Registrations(store, gap_s=0.01)  # type: ignore[arg-type]
        store.release.clear()  # the first read is under way, not answered
        first = asyncio.ensure_future(registrations.members("j"))
        await asyncio.sleep(0.05)
        store.members.add("m-late")  # registered after the first read began
        second = asyncio.ensure_future(registrations.members("j"))
        await asyncio.sleep(0.05)
        store.release.set()
        return await first, await second

    first, second = asyncio.run(main())
    assert "m-late" not in first  # (what the first read saw)
    assert second == {"m-late"}  # asked after the first read began: a fresh one


@pytest.mark.timeout(30)
def test_a_failed_read_fails_its_callers_and_a_missing_job_is_none():
    store = _Store()

    async def main() -> tuple:
        registrations = Registrations(store, gap_s=0.0)  # type: ignore[arg-type]
        store.fail = True
        failed = await asyncio.gather(*(registrations.members("j") for _ in range(3)),
                                      return_exceptions=True)
        store.fail, store.job = False, False
        await asyncio.sleep(0.01)
        return failed, await registrations.members("j")

    failed, missing = asyncio.run(main())
    assert all(isinstance(e, StoreUnavailable) for e in failed)
    assert missing is None
