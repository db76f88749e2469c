"""Concurrency slots: this daemon's ``max_jobs``, and each agent's ``concurrency`` over all daemons.

An agent slot is a flock on ``.state/slots/<agent>.<i>.lock`` (filelock with
``preserve_lock_file=True``: never deleted, never a silent soft lock). The
kernel drops it when its holder dies, so a crashed daemon frees its slots.
"""

from __future__ import annotations

from pathlib import Path

from filelock import FileLock, Timeout


def make_lock(path: Path) -> FileLock:
    """Return a non-blocking, cross-thread flock on path that keeps its file."""
    return FileLock(path, timeout=0, blocking=False, thread_local=False, preserve_lock_file=True)


class Slots:
    """Hand out agent slots; remember which are ours.

    A released slot stays locked as *idle* until ``flush`` (the end of the
    daemon's tick), so that a daemon going from one job of an agent to the next
    does not give the lock up and take it again.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._locks: dict[str, FileLock] = {}
        self._held: set[str] = set()
        self._idle: set[str] = set()

    def acquire(self, agent: str, concurrency: int) -> str | None:
        """Take a free slot of agent; return its key, or None if all are busy."""
        for key in sorted(self._idle):
            if key.rsplit(".", 1)[0] == agent and int(key.rsplit(".", 1)[1]) < concurrency:
                self._idle.discard(key)
                self._held.add(key)
                return key
        for i in range(concurrency):
            key = f"{agent}.{i}"
            if key in self._held or key in self._idle:
                continue
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = make_lock(self.folder / f"{key}.lock")
            try:
                lock.acquire()
            except Timeout:
                continue
            self._held.add(key)
            return key
        return None

    def held(self, agent: str) -> int:
        """Return how many slots of agent this daemon holds."""
        return sum(1 for key in self._held if key.rsplit(".", 1)[0] == agent)

    def release(self, key: str) -> None:
        """Give a slot back (it stays locked, idle, until ``flush``)."""
        if key in self._held:
            self._held.discard(key)
            self._idle.add(key)

    def flush(self) -> None:
        """Unlock the idle slots, so that other daemons may take them."""
        for key in self._idle:
            self._locks[key].release()
        self._idle.clear()


def owner_alive(folder: Path, owner: str) -> bool:
    """Return True while the daemon ``owner`` holds its liveness lock in folder."""
    path = folder / f"{owner}.lock"
    if not path.exists():
        return False
    lock = make_lock(path)
    try:
        lock.acquire()
    except Timeout:
        return True
    lock.release()
    return False
