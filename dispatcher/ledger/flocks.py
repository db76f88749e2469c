"""Liveness and concurrency slots on one host: flocks the kernel drops when their holder dies.

A daemon holds ``.state/daemons/<owner>.lock`` for its whole life; a slot of an
agent is ``.state/slots/<agent>.<i>.lock``. Both use filelock with
``preserve_lock_file=True``: lock files are never deleted (two holders of "one"
lock otherwise, tox-dev/filelock #574) and never silently become soft locks.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from filelock import FileLock, Timeout

_ALIVE_TTL_S = 1.0


def make_lock(path: Path) -> FileLock:
    """Return a non-blocking, cross-thread flock on path that keeps its file."""
    return FileLock(path, timeout=0, blocking=False, thread_local=False, preserve_lock_file=True)


def owner_alive(folder: Path, owner: str) -> bool:
    """Return True while the daemon ``owner`` holds its liveness lock in folder."""
    path = folder / f"{owner}.lock"
    try:  # read-only: a reader who may not write to the root can still ask (a flock needs no write access)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock taken just now
    return False


class Liveness:
    """Answer "is this daemon alive?" by its flock; a dead owner stays dead (ids are never reused)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._dead: set[str] = set()
        self._alive: dict[str, float] = {}

    def alive(self, owner: str) -> bool:
        """Return True while owner holds its lock (a live answer is cached for a second)."""
        if owner in self._dead:
            return False
        seen = self._alive.get(owner)
        now = time.monotonic()
        if seen is not None and now - seen < _ALIVE_TTL_S:
            return True
        if owner_alive(self.folder, owner):
            self._alive[owner] = now
            return True
        self._alive.pop(owner, None)
        self._dead.add(owner)
        return False


class FlockSlots:
    """Hand out agent slots over every daemon of one host; remember which are ours."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._locks: dict[tuple[str, int], FileLock] = {}
        self._held: dict[str, set[int]] = {}

    def take(self, agent: str, concurrency: int) -> int | None:
        """Take a free slot of agent; return its number, or None if all are busy."""
        mine = self._held.setdefault(agent, set())
        if len(mine) >= concurrency:
            return None
        for i in range(concurrency):
            if i in mine:
                continue
            lock = self._locks.get((agent, i))
            if lock is None:
                lock = self._locks[(agent, i)] = make_lock(self.folder / f"{agent}.{i}.lock")
            try:
                lock.acquire()
            except Timeout:
                continue
            mine.add(i)
            return i
        return None

    def free(self, agent: str, slot: int) -> None:
        """Give a slot back so that any daemon may take it."""
        mine = self._held.get(agent)
        if mine is not None and slot in mine:
            mine.discard(slot)
            self._locks[(agent, slot)].release()

    def release_all(self) -> None:
        """Give every slot back (at stop)."""
        for agent, mine in self._held.items():
            for slot in list(mine):
                self._locks[(agent, slot)].release()
            mine.clear()
