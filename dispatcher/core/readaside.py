"""Orders read aside from the claim's trip, and refusals made on the loop's behalf.

An order too large for the claim's trip (``claiming.BIG_ORDER_BYTES``) is read in the
scan lane (a large YAML one parsed in a child process, ``spec.orderchild``), then parked
like any other, or refused in the ledger lane; a file that cannot be read now (a
shortage) is tried again a second later.
"""

from __future__ import annotations

import abc
import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from dispatcher.core.claiming import when
from dispatcher.core.watcher import Inbox
from dispatcher.core.work import Kind, Later, Parked
from dispatcher.job import intake
from dispatcher.job.context import JobContext
from dispatcher.shortage import SHORT
from dispatcher.spec.settings import Config
from dispatcher.store.refusals import Refusal, refuse

log = structlog.get_logger("dispatcher")
RETRY_LATER_S = 1.0  # a file whose claim could not be made now (a full disk) is tried again after this


@dataclass
class Stats:
    finished: dict[str, int] = field(default_factory=lambda: {"done": 0, "failed": 0, "refused": 0, "review": 0})

    def count(self, state: str) -> None:
        """Count one job or file this daemon finished in ``state`` (``run --once``'s exit code)."""
        self.finished[state] = self.finished.get(state, 0) + 1


class ReadAside(abc.ABC):
    """``core.scheduler.Scheduler``'s part that reads large orders aside and carries out refusals."""

    ctx: JobContext
    inbox: Inbox
    stats: Stats
    parked: collections.deque[Parked]
    wake: Callable[[], None]

    @property
    @abc.abstractmethod
    def config(self) -> Config:
        """The config in force."""

    @abc.abstractmethod
    def _launch_now(self, p: Parked) -> None:
        """Claim p at once, without a slot (a cancel)."""

    async def _refuse(self, refusal: Refusal) -> None:
        folder = await self.ctx.lanes.ledger(refuse, self.ctx.layout, refusal, self.ctx.ledger.owner, self.log_refused)
        self.inbox.forget(refusal.name)
        if folder is not None:
            self.stats.finished["refused"] += 1
        self.wake()

    def join_failed(self) -> None:
        """Count a waiting job that failed without a slot (``after: X failed``): `run --once` then exits 1."""
        self.stats.finished["failed"] += 1
        self.wake()

    def log_refused(self, folder: Path, refusal: Refusal) -> None:
        """Log a refusal as its folder lands (before the folder's fsync)."""
        self.ctx.finisher.finished.add("refused", refusal.agent)
        if self.ctx.metrics is not None:
            self.ctx.metrics.job_finished("refused", refusal.agent, None, None)
        log.warning(
            "job.refused",
            agent=refusal.agent,
            file=refusal.name,
            job_id=refusal.job_id,
            reason=refusal.reason,
            folder=folder.name,
        )

    async def _read_big(self, name: str, *, cancel: bool) -> None:
        """Read a large order in the scan lane, then park it (or refuse it in the ledger lane)."""
        try:
            found = await self.ctx.lanes.scan(intake.inspect, self.ctx.layout, name, self.config)
        except OSError as exc:
            if not SHORT.note(exc, "read"):
                raise
            asyncio.get_running_loop().call_later(RETRY_LATER_S, self._try_again, name)
            return
        if found is None:
            self.inbox.forget(name)
        elif isinstance(found, Refusal):
            log.info("order.received", agent=found.agent, file=name, job_id=found.job_id)
            await self._refuse(found)
        elif isinstance(timing := when(found.order, name, now=cancel), Later):
            self.inbox.defer(name, timing.due, timing.priority)
        elif timing is not None:
            await self._refuse(timing)
        else:
            log.info("order.received", agent=found.order.to, file=name, job_id=found.order.job_id)
            p = Parked(Kind.NEW, found.order.job_id, found.order.to, found, expires=found.order.expires)
            if cancel:
                self._launch_now(p)
            else:
                self.parked.append(p)
        self.wake()

    def _try_again(self, name: str) -> None:
        self.inbox.push_back(name)
        self.wake()
