"""The daemon's part in the lease's rules (contract section 12), read on its loop at each turn.

``core.lease.LeaseKeeper`` renews the lease in its own thread; here the loop acts on
what it found: fenced (no renewal for lease / 2), every agent is ended and nothing is
claimed until a renewal; declared lost by another daemon, this one stops for good.
Daemons whose lease ran out have their jobs recovered here.
"""

from __future__ import annotations

import abc
import asyncio
import signal
from typing import Any

import structlog

from dispatcher.core.housekeeping import Housekeeping
from dispatcher.core.lease import LeaseKeeper
from dispatcher.core.requests import Requests
from dispatcher.job import hooks
from dispatcher.lifecycle import Stop
from dispatcher.spec.settings import Config

log = structlog.get_logger("dispatcher")


class Fencing(abc.ABC):
    """``core.daemon.Daemon``'s part that keeps the lease's rules."""

    config: Config
    lease: LeaseKeeper | None
    stopping: bool
    lost: bool
    _was_fenced: bool
    sched: Requests[Any]  # the scheduler: its running jobs and abort_all
    house: Housekeeping
    loop: asyncio.AbstractEventLoop

    @abc.abstractmethod
    def _signal(self, signum: int, reason: str | None = None) -> None:
        """Act on a signal as its handler would (here: SIGTERM, a stop); ``reason``: a stop of its own, said so."""

    def _fence(self) -> bool:
        """Keep the lease's rules: fenced, end every agent and claim nothing; lost, stop for good."""
        assert self.lease is not None  # noqa: S101
        if self.lease.lost and not self.stopping:
            self.lost = True
            self._signal(signal.SIGTERM, reason="this daemon was declared lost by another; it stops")
            self.sched.abort_all(Stop.STOPPED, mute=True)
            hooks.RUNNING.stop_all()  # its hooks end with its agents: another daemon owns its work now
            return True
        if self.lease.fenced:
            if not self._was_fenced:
                log.error("lease.fenced", running=len(self.sched.running), lease_s=self.config.lease_s)
            self._was_fenced = True
            self.sched.abort_all(Stop.STOPPED, mute=True)
            return True
        renewed = self._was_fenced
        if renewed:
            log.info("lease.renewed")
            self._was_fenced = False
        # take our own stopped jobs back: at the renewal, and for a job that stopped after it (one that saw
        # the fence an instant before the renewal and dropped its attempt while this recovery began)
        if renewed or self.sched.left_new:
            self.sched.left_new = False
            self.house.start(self.house.recover(startup=False), "recover")
        return False

    def _hosts_lost(self, owners: list[str]) -> None:
        """Daemons whose lease ran out (from the lease thread): log each once, recover their jobs."""
        for owner in owners:
            found = self.lease.leases.lost_daemon(owner) if self.lease is not None else None
            host, pid = found if found is not None else (None, None)
            log.warning("host.lost", owner=owner, host=host, pid=pid)
        self.loop.call_soon_threadsafe(self._recover_lost)

    def _recover_lost(self) -> None:
        if not self.stopping:
            self.house.start(self.house.recover(startup=False), "recover")

    def _fenced(self) -> bool:
        """No lease renewal for lease / 2: write nothing more into job folders.

        It stays fenced until the loop has seen the renewal and logged ``lease.renewed``
        (``_fence``): a job that looked between the two would start its agent before that line.
        """
        return self.lease is not None and (self._was_fenced or self.lease.fenced or self.lease.lost)
