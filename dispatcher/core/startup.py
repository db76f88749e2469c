"""Start-up steps of the daemon that may meet a shortage: the open-files limit, the folders, the ledger.

A shortage of file descriptors, processes or memory is never an answer (contract
section 13), at start-up either: each step logs ``daemon.short_of`` once
(``step: start``) and is tried again with the shortage's backoff until the
resource is back or a stop comes (then the step's error is raised, and the
daemon, asked to stop, ends with exit 0).
"""

from __future__ import annotations

import asyncio
import errno
import resource
import select
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from dispatcher.errors import UsageError
from dispatcher.layout import Layout
from dispatcher.shortage import PAUSE_MIN_S, SHORT, fds_exhausted, resource_of
from dispatcher.store.results import is_disk_full

log = structlog.get_logger("dispatcher")
DISK_FULL_RETRY_S = 1.0  # a step of the start that met a full disk is tried again this often

T = TypeVar("T")


def raise_fd_limit() -> None:
    """Raise the soft limit on open files to the hard one: each running agent holds three fds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def make_folders(layout: Layout, stop_asked: Callable[[], bool]) -> None:
    """Make the root's folders; raise UsageError (one line) when they cannot be made for another reason,
    or when one of them is on another filesystem than the root."""
    while True:
        try:
            layout.create()
            other = layout.elsewhere()
            if other is not None:
                raise UsageError(
                    f"{other}: on another filesystem than the root {layout.root}; a dispatch root must be"
                    " on one filesystem (jobs move between its folders by rename)"
                )
            return
        except OSError as exc:
            if resource_of(exc) is None or stop_asked():
                raise UsageError(f"{layout.root}: cannot make the folders of the root ({exc.strerror})") from None
            await _pause(exc)


async def while_short(step: Callable[[], Awaitable[T]], stop_asked: Callable[[], bool]) -> T:
    """Await step() until it gets past a shortage; other errors (and any once a stop came) are raised.

    An error SQLite words as "unable to open" (a UsageError here) counts as a shortage
    when the process is at its open-files limit.
    """
    logged = False
    while True:
        try:
            return await step()
        except Exception as exc:
            if isinstance(exc, OSError) and is_disk_full(exc) and not stop_asked():  # a wait, not a failure
                if not logged:
                    logged = True
                    log.warning("daemon.short_of", resource="disk space", step="start", error=str(exc))
                await asyncio.sleep(DISK_FULL_RETRY_S)
                continue
            short = resource_of(exc) is not None or (isinstance(exc, UsageError) and fds_exhausted())
            if not short or stop_asked():
                raise
            await _pause(exc if resource_of(exc) else OSError(errno.EMFILE, str(exc)))


async def _pause(exc: BaseException) -> None:
    SHORT.note(exc, "start")
    await asyncio.sleep(max(SHORT.wait_s(), PAUSE_MIN_S))


LOOP_RETRY_S = 1.0  # how often a daemon short of descriptors for its event loop tries again


def new_loop(stop_noted: Callable[[], bool]) -> asyncio.AbstractEventLoop | None:
    """Make the daemon's event loop; None if a stop came while it could not be made.

    The loop needs descriptors of its own (epoll and a self-pipe): at an open-files limit too low
    for them it is a shortage like any (section 13): ``daemon.short_of`` once, step start, then
    another try every ``LOOP_RETRY_S`` until it can be made, not a traceback.
    """
    logged = False
    while True:
        try:
            _loop_room()  # a loop made half (no self-pipe) cannot be closed: its end prints a traceback
            return asyncio.new_event_loop()
        except OSError as exc:
            resource = resource_of(exc)
            if resource is None:
                raise
            if not logged:
                logged = True
                log.warning("daemon.short_of", resource=resource, step="start", error=str(exc))
        if stop_noted():
            return None
        time.sleep(LOOP_RETRY_S)


def _loop_room() -> None:
    """Raise OSError (EMFILE) unless the descriptors an event loop needs (epoll, a socket pair) can be opened."""
    poll = select.epoll()
    try:
        a, b = socket.socketpair()
        a.close()
        b.close()
    finally:
        poll.close()
