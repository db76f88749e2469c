"""Agents being started now: work that can wait for them does (starts first).

Between an agent's exit and the next start on its slot, the daemon's threads also check
and finish the job that just ended, and claim orders ahead. Run beside the start, that
work makes it wait: for the interpreter lock (``Popen``'s Python part) and for the
journal (the fsync of ``attempts/``). So a finished job's post-exit trip waits until no
agent is being started (at most ``WAIT_MAX_S``), and the scheduler claims ahead only
then; a start waits for nothing of theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

WAIT_MAX_S = 0.05  # a finished job's checks never wait longer than this for starts


class Starts:
    """How many agents are being started now (on the loop)."""

    def __init__(self) -> None:
        self.count = 0
        self._quiet: asyncio.Future[None] | None = None
        self.on_quiet: Callable[[], None] | None = None  # called when the last start in progress is done

    def begin(self) -> None:
        """An agent's start begins (its attempt folder, its process)."""
        self.count += 1

    def end(self) -> None:
        """An agent's start is done, or given up."""
        self.count -= 1
        if self.count:
            return
        quiet, self._quiet = self._quiet, None
        if quiet is not None and not quiet.done():
            quiet.set_result(None)
        if self.on_quiet is not None:
            self.on_quiet()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not counted as starting meanwhile (a hook, a wait for room): nothing waits for that."""
        self.end()
        try:
            yield
        finally:
            self.begin()

    async def quiet(self) -> None:
        """Wait until no agent is being started, or ``WAIT_MAX_S`` at most."""
        if not self.count:
            return
        loop = asyncio.get_running_loop()
        if self._quiet is None or self._quiet.done():  # a wait cut short by its limit settled the last one
            self._quiet = loop.create_future()
        quiet = self._quiet
        timer = loop.call_later(WAIT_MAX_S, _settle, quiet)
        try:
            await asyncio.shield(quiet)
        finally:
            timer.cancel()


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
