"""The readers of agents' descriptors (two pipes and a pidfd each), on one epoll that the loop watches.

``loop.add_reader`` and ``remove_reader`` cost some twenty Python calls each (a transport
check, a handle, the selector's key), and every agent needs three readers, added at its
start and removed at its end. Here a reader is one ``epoll.register`` and one
``unregister``; the loop has a single reader, the epoll, whose callback runs the readers
of the descriptors that are ready, each in the context it was added in, as the loop runs
its own. Level-triggered like the loop's selector: a reader that leaves data unread is
called again. A descriptor is removed before it is closed, as with ``remove_reader``.
"""

from __future__ import annotations

import asyncio
import contextvars
import select
import weakref
from collections.abc import Callable
from typing import Any

_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Readers] = weakref.WeakKeyDictionary()


def readers() -> Readers:
    """Return the readers of the running loop (made at its first agent)."""
    loop = asyncio.get_running_loop()
    found = _BY_LOOP.get(loop)
    if found is None:
        found = _BY_LOOP[loop] = Readers(loop)
    return found


class Readers:
    """Descriptors watched for reading, and what to call when one is ready."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._epoll = select.epoll()  # close-on-exec; closed with this object, after its loop
        self._calls: dict[int, tuple[contextvars.Context, Callable[..., Any], tuple[Any, ...]]] = {}
        # the loop's one reader runs in a context of its own: the readers run in theirs
        contextvars.Context().run(loop.add_reader, self._epoll.fileno(), self._ready)

    def add(self, fd: int, callback: Callable[..., Any], *args: Any) -> None:
        """Call callback(*args) whenever fd is ready to read (or at its end of file), until ``remove``."""
        self._epoll.register(fd, select.EPOLLIN)
        self._calls[fd] = (contextvars.copy_context(), callback, args)

    def remove(self, fd: int) -> None:
        """Stop watching fd (before it is closed)."""
        if self._calls.pop(fd, None) is not None:
            self._epoll.unregister(fd)

    def _ready(self) -> None:
        for fd, _events in self._epoll.poll(0):
            call = self._calls.get(fd)
            if call is None:  # removed by a reader that ran before it in this batch
                continue
            context, callback, args = call
            try:
                context.run(callback, *args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:  # noqa: BLE001 - reported as the loop reports a failed callback
                asyncio.get_running_loop().call_exception_handler(
                    {"message": f"Exception in callback {callback!r}", "exception": exc}
                )
