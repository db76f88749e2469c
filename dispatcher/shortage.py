"""Shortages of file descriptors, processes or memory: "not now", never a job's answer.

EMFILE, ENFILE, EAGAIN (from fork) and ENOMEM say nothing about an order or an
agent: they say the daemon is short of something that comes back once agents
end. Code that meets one calls ``SHORT.note(exc)`` and leaves its order or job
where it is; the scheduler claims and starts nothing until ``SHORT.until`` and
then tries again, one job at first and twice as many after each agent that
starts (like TCP's slow start): slots and claims hold descriptors too, so a
daemon that took all it could at once would starve the agents it claimed for.
Before a new order is claimed then (and until the first agent starts),
``room`` looks whether the descriptors a start needs are free, so that no
order leaves inbox/ to wait in active/ for a start that could not happen.
``daemon.short_of`` is logged once per shortage of a resource: it is logged
again after a quiet spell without that shortage, or when an agent started
since and the resource was not short for a pause's length (a new shortage,
not the same one met again on the edge).
"""

from __future__ import annotations

import errno
import os
import resource
import time

import structlog

log = structlog.get_logger("dispatcher")

RESOURCES = {
    errno.EMFILE: "file descriptors (EMFILE)",
    errno.ENFILE: "file descriptors of the system (ENFILE)",
    errno.EAGAIN: "processes (EAGAIN)",
    errno.ENOMEM: "memory (ENOMEM)",
}
PAUSE_MIN_S = 0.2
DISK_WAIT_MAX_S = 30.0  # a full disk is waited out with backoff up to this between tries
PAUSE_MAX_S = 2.0
WINDOW_MAX = 1024
QUIET_S = 10.0  # a shortage of a resource not met again for this long is over (retries come every 2 s at most)
# descriptors a job's start holds at its peak (its slot's lock, two output pipes, the exec check's pipe), as measured
# under `ulimit -n` for a plain agent (seven to eight), and one more for the first start, which opens what stays for
# the daemon's life (agents' /dev/null): at a limit within a descriptor or two of that, orders wait in inbox/ rather
# than be claimed for a start that may not fit
START_FDS = 8
FIRST_START_FDS = START_FDS + 1
ROOM_LOOK_MAX = 4  # orders whose starts one look (``room``) makes room for; beyond them, the starts are the look


def resource_of(exc: BaseException) -> str | None:
    """Return the resource an error says the daemon is short of, or None for any other error."""
    if isinstance(exc, MemoryError):
        return RESOURCES[errno.ENOMEM]
    if isinstance(exc, OSError) and exc.errno in RESOURCES:
        return RESOURCES[exc.errno]
    if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):  # threading's EAGAIN (RLIMIT_NPROC)
        return RESOURCES[errno.EAGAIN]
    return None


def fds_exhausted() -> bool:
    """Is this process at its limit of open files (an error that hides EMFILE, such as SQLite's, is then one)?"""
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError as exc:
        return exc.errno in (errno.EMFILE, errno.ENFILE)
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft != resource.RLIM_INFINITY and used + 2 >= soft


class Shortage:
    """The daemon's view of its shortages: when to try again, what was logged."""

    def __init__(self) -> None:
        self.until = 0.0  # monotonic time before which nothing new is claimed or started
        self._pause = PAUSE_MIN_S
        self._window: int | None = None  # jobs that may be claimed or started per turn (None: no bound)
        self._last_seen: dict[str, float] = {}  # resource -> when it was last short
        self._ok_at = 0.0  # when an agent last started
        self._claims_until = 0.0  # monotonic time before which no new order is claimed (``room``)

    def note(self, exc: BaseException, step: str) -> bool:
        """Record a shortage if exc is one (log it once); return True if it was one."""
        now = time.monotonic()
        if not self._met(exc, step, now):
            return False
        if now >= self.until:  # one pause per turn, however many steps met the shortage in it
            self.until = self._paused_until(now)
        return True

    def _met(self, exc: BaseException, step: str, now: float) -> bool:
        """Log a shortage once and bound the next turns (``allowance``); return False if exc is none."""
        resource = resource_of(exc)
        if resource is None:
            return False
        seen = self._last_seen.get(resource)
        over = seen is not None and self._ok_at > seen and now - seen > PAUSE_MAX_S  # it ended, this is new
        if seen is None or now - seen > QUIET_S or over:
            log.warning("daemon.short_of", resource=resource, step=step, error=str(exc))
        self._last_seen[resource] = now
        self._window = 1
        return True

    def _paused_until(self, now: float) -> float:
        """Return the end of a pause that begins now; the next one is twice as long (up to PAUSE_MAX_S)."""
        until = now + self._pause
        self._pause = min(self._pause * 2, PAUSE_MAX_S)
        return until

    def short(self) -> bool:
        """Return True while claims and starts pause."""
        return time.monotonic() < self.until

    def room(self, want: int = 1) -> int:
        """Return how many of ``want`` new orders may be claimed now: as many as the descriptors free let start.

        A claim takes fewer descriptors than a start: without this look, a turn would claim
        orders into active/ that could not start there (a limit lowered under a running
        daemon with ``prlimit`` included). So each turn that would claim opens START_FDS
        descriptors (FIRST_START_FDS before the first start) for each of its first
        ROOM_LOOK_MAX new orders, and closes them again: a few dozen system calls a turn. A
        shortage met so, before one order fits, is logged as one and holds new claims for a
        pause (``claims_wait_s``); jobs claimed before go on starting, since their agents
        need no more than the look asked for. Processes and memory cannot be looked at so
        cheaply: for them the first start after a pause is the look.
        """
        now = time.monotonic()
        if now < self._claims_until:
            return 0
        fds: list[int] = []
        fit = 0
        need = START_FDS if self._ok_at else FIRST_START_FDS
        try:
            while fit < min(want, ROOM_LOOK_MAX):
                for _ in range(need // 2):
                    fds.extend(os.pipe())
                if need % 2:
                    fds.append(os.dup(fds[0]))
                fit += 1
        except OSError as exc:
            if resource_of(exc) is None:
                raise
            if fit:  # fewer than asked fit: as many are claimed, quietly
                return fit
            self._met(exc, "claim", now)
            self._claims_until = self._paused_until(now)
            return 0
        finally:
            for fd in fds:
                os.close(fd)
        return want  # as many as the look asked for fit: the starts themselves find a shortage beyond them

    def claims_wait_s(self) -> float:
        """Return the seconds left before new orders may be claimed again (0 when they may)."""
        return max(0.0, self._claims_until - time.monotonic())

    def wait_s(self) -> float:
        """Return the seconds left in the pause (0 when none)."""
        return max(0.0, self.until - time.monotonic())

    def allowance(self, free: int, starting: int = 0) -> int:
        """Return how many of ``free`` slots a turn may fill (all of them unless a shortage was met).

        ``starting``: jobs launched by earlier turns whose agents have not started yet. They
        count against the window, so that after a shortage one start is tried at a time, not
        one per turn: two starts that cannot both fit would otherwise fail together again
        after every pause.
        """
        return free if self._window is None else min(free, max(0, self._window - starting))

    def ok(self) -> None:
        """Note that an agent started: the next turn may start twice as many."""
        self._ok_at = time.monotonic()
        self._pause = PAUSE_MIN_S
        if self._window is not None:
            self._window *= 2
            if self._window > WINDOW_MAX:
                self._window = None


SHORT = Shortage()
