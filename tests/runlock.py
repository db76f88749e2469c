"""Ownership locks for test resources that outlive a crashed test run.

A test run that creates system-wide things (network namespaces, a PostgreSQL data folder
with a running server) holds an exclusive ``flock`` on an owner file for as long as it
lives. The kernel drops the lock when the process dies, however it dies, so a later run can
tell a leftover of a dead run (lock free) from the live resource of a parallel run (lock
held) without trusting pids, which are reused.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

from dispatcher.ledger.flocks import lock_held


def lock_dir() -> Path:
    """Return the folder for owner files shared by every test run on this machine."""
    # /run is a tmpfs, so leftovers of a machine reboot vanish with the namespaces they name
    for base in (Path("/run"), Path(tempfile.gettempdir())):
        folder = base / "dispatcher-tests"
        try:
            folder.mkdir(mode=0o755, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    raise RuntimeError("no writable folder for test ownership locks in /run or the temp folder")


class OwnerLock:
    """An exclusive lock on ``path`` held by this process until :meth:`release`."""

    def __init__(self, path: Path) -> None:
        """Create ``path`` already locked (temp name, lock, rename), so no one sees it unlocked."""
        self.path = path
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        # O_CLOEXEC: a child (a server, an agent) must not inherit the lock and keep it
        # alive after this process died
        self._fd: int | None = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(self._fd, f"{os.getpid()}\n".encode())
        os.rename(tmp, path)

    def release(self) -> None:
        """Remove the owner file and drop the lock."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None


def owner_is_dead(path: Path) -> bool:
    """Return True when no live process holds the lock on ``path`` (or it does not exist)."""
    return lock_held(path) is not True
