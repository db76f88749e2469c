"""The one channel that stops a job: a cancel or a stop, whatever the job is doing.

uvicorn has ``should_exit``; rq has one stop flag and ``kill_horse``. A job here
has its ``Control``: an abort reaches the agent process it runs (or its probe),
or ends its wait before a retry, and the first reason is the one recorded.
"""

from __future__ import annotations

import asyncio

from dispatcher.job.runner import AgentProcess
from dispatcher.lifecycle import Stop


class Left(Exception):
    """A stop came while the job waited: it stays in active/ for the next start."""


class Control:
    """The one channel that stops a job: a cancel or a stop, whatever the job is doing."""

    def __init__(self) -> None:
        self.reason: Stop | None = None
        self._proc: AgentProcess | None = None
        self._sleep: asyncio.Future[None] | None = None
        self._now = False

    def abort(self, reason: Stop, *, mute: bool = False, now: bool = False) -> None:
        """Stop the job now (the first reason wins); ``mute`` also stops its agent's log writes.

        ``now`` (a second stop signal): its agent's group is killed at once, not after ``kill_grace``.
        """
        if mute and self._proc is not None:
            self._proc.mute()
        first = self.reason is None
        if not first and not now:
            return
        self.reason = self.reason or reason
        self._now = self._now or now
        if self._proc is not None:
            self._proc.abort(self.reason, now=self._now)
        if first and self._sleep is not None and not self._sleep.done():
            self._sleep.set_result(None)

    def attach(self, proc: AgentProcess | None) -> None:
        """Route aborts to this agent process (None when it ended)."""
        self._proc = proc
        if proc is not None and self.reason is not None:
            proc.abort(self.reason, now=self._now)

    @property
    def waiting(self) -> bool:
        """Return True while the job sleeps before a retry (a stop ends such a job at once)."""
        return self._sleep is not None and not self._sleep.done()

    async def sleep(self, delay: float) -> bool:
        """Sleep for delay unless stopped first; return True if stopped."""
        if self.reason is not None:
            return True
        loop = asyncio.get_running_loop()
        self._sleep = loop.create_future()
        timer = loop.call_later(delay, _wake, self._sleep)
        try:
            await self._sleep
        finally:
            timer.cancel()
            self._sleep = None
        return self.reason is not None


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
