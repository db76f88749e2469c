"""The daemon loop's wake-up: set by any callback on the loop, waited for with a timeout.

``asyncio.wait_for(event.wait(), timeout)`` makes a task, a coroutine and a
timer at every wait, and the loop waits several times per job; this costs one
future and one timer. Set it only from the loop's thread (other threads go
through ``loop.call_soon_threadsafe``), as with ``asyncio.Event``.
"""

from __future__ import annotations

import asyncio


class Wakeup:
    """A flag the loop waits on: ``set`` ends the current ``wait`` at once, or makes the next one return."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        """Wake the loop's wait (now, or the next one if none is waiting)."""
        self._set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def is_set(self) -> bool:
        """Return True if a wake-up came since the last ``clear``."""
        return self._set

    def clear(self) -> None:
        """Forget the wake-ups so far."""
        self._set = False

    async def wait(self, timeout: float) -> None:
        """Return at the next wake-up, or after timeout seconds (at once if one already came)."""
        if self._set:
            return
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout, _end, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _end(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
