"""The loop's reading of the lease (contract section 12): no agent starts before `lease.renewed`.

The lease thread may renew between two turns of the loop. Until the loop has seen
that renewal and logged `lease.renewed`, a job that asks whether the daemon is fenced
must still hear yes; otherwise its agent would start before the line that says
agents may start again (a race once seen in the PostgreSQL outage test).
"""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace
from typing import Any

from dispatcher.core.fencing import Fencing
from dispatcher.lifecycle import Stop


class _Lease:
    fenced = False
    lost = False


class _Sched:
    def __init__(self) -> None:
        self.running: dict[str, object] = {}
        self.left_new = False
        self.aborted: list[Stop] = []

    def abort_all(self, reason: Stop, mute: bool = False) -> None:
        self.aborted.append(reason)


class _House:
    def __init__(self) -> None:
        self.started: list[str] = []

    async def recover(self, startup: bool) -> None:
        return None

    def start(self, coro: Any, name: str) -> None:
        coro.close()
        self.started.append(name)


class _Daemon(Fencing):
    def __init__(self) -> None:
        self.config = SimpleNamespace(lease_s=3.0)  # type: ignore[assignment]
        self.lease = _Lease()  # type: ignore[assignment]
        self.stopping = False
        self.lost = False
        self._was_fenced = False
        self.sched = _Sched()  # type: ignore[assignment]
        self.house = _House()  # type: ignore[assignment]
        self.loop = asyncio.new_event_loop()

    def _signal(self, signum: int) -> None:
        assert signum == signal.SIGTERM


def test_a_renewal_the_loop_has_not_seen_yet_still_reads_as_fenced() -> None:
    d = _Daemon()
    try:
        lease: Any = d.lease
        assert not d._fenced()
        lease.fenced = True
        assert d._fenced()
        assert d._fence() is True  # logs lease.fenced, ends every agent
        assert d.sched.aborted == [Stop.STOPPED]  # type: ignore[attr-defined]
        lease.fenced = False  # the lease thread renewed; the loop has not looked yet
        assert d._fenced(), "a job asking now must not start its agent before lease.renewed"
        assert d._fence() is False  # logs lease.renewed, takes the stopped jobs back
        assert not d._fenced()
        assert d.house.started == ["recover"]  # type: ignore[attr-defined]
    finally:
        d.loop.close()


def test_a_job_stopped_after_the_renewal_is_taken_back_without_waiting_for_the_rescan() -> None:
    """A job that saw the fence an instant before the renewal stops after the renewal's recovery began:
    the next turn starts another recovery for it, and only one."""
    d = _Daemon()
    try:
        sched: Any = d.sched
        assert d._fence() is False
        assert d.house.started == []  # type: ignore[attr-defined]
        sched.left_new = True  # the scheduler added a job to `left`
        assert d._fence() is False
        assert d._fence() is False
        assert d.house.started == ["recover"]  # type: ignore[attr-defined]
        assert sched.left_new is False
    finally:
        d.loop.close()
