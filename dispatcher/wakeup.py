"""The daemon loop's wake-up: set by any callback on the loop, waited for with a timeout.

``asyncio.wait_for(event.wait(), timeout)`` makes a task, a coroutine and a
timer at every wait, and the loop waits several times per job; this costs one
future, and a timer only when the wait ends at another time than the last one
(the next rescan is the usual end, the same from one wait to the next). Set it
only from the loop's thread (other threads go through ``loop.call_soon_threadsafe``),
as with ``asyncio.Event``.
"""

from __future__ import annotations

import asyncio

_SAME_S = 0.001  # a timer this close to a wait's end serves it


class Wakeup:
    """A flag the loop waits on: ``set`` ends the current ``wait`` at once, or makes the next one return."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._set = False
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None  # the end of the waits, kept from one to the next

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

    def wait(self, timeout: float) -> asyncio.Future[None]:
        """Return a future done at the next wake-up, or after timeout seconds (done at once if one already came).

        A future to await, not a coroutine: no frame made and resumed at every wait.
        """
        loop = self._loop
        waiter = self._waiter = loop.create_future()
        if self._set:
            waiter.set_result(None)
            return waiter
        end = loop.time() + timeout
        timer = self._timer
        if timer is None or abs(timer.when() - end) > _SAME_S:
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(end, self._timed_out)
        return waiter

    def _timed_out(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
