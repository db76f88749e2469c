"""Liveness and concurrency slots on one host: flocks the kernel drops when their holder dies.

A daemon holds ``.state/daemons/<owner>.lock`` for its whole life, through filelock
with ``preserve_lock_file=True``: lock files are never deleted (two holders of "one"
lock otherwise, tox-dev/filelock #574) and never silently become soft locks. A slot of
an agent is ``.state/slots/<agent>.<i>.lock``, taken and given back for every job:
the same rules (never deleted, a real ``flock``, non-blocking) kept by ``SlotLock`` in
a few system calls, since filelock's acquire and release cost about 78 us of CPU
together against 1.3 us for open, flock and close.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from dispatcher import procs
from dispatcher.fsutil import file_id
from dispatcher.ledger.records import DaemonInfo
from dispatcher.text import is_count

_ALIVE_TTL_S = 1.0
#: a daemon's process starts before it makes its lock file; this covers /proc's boot time, kept in whole seconds
_START_SLACK_S = 1.0


def make_lock(path: Path) -> FileLock:
    """Return a non-blocking, cross-thread flock on path that keeps its file."""
    return FileLock(path, timeout=0, blocking=False, thread_local=False, preserve_lock_file=True)


def owner_alive(folder: Path, owner: str) -> bool | None:
    """Return True while the daemon ``owner`` holds its liveness lock in folder.

    A lock this user may not open (made 640 for a reader outside the daemon's group) is
    decided by the daemon's process instead (``_alive_by_process``); None when that
    cannot tell either.
    """
    path = folder / f"{owner}.lock"
    try:  # read-only: a reader who may not write to the root can still ask (a flock needs no write access)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return _alive_without_lock(folder, owner)
    except PermissionError:
        return _alive_by_process(path, owner)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        inode = os.fstat(fd).st_ino
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock taken just now
    made = _noted(folder, owner, "lock_ino")
    if made is None or made == inode:  # the lock file it made, and no one holds it: dead (a crash leaves it so)
        return False
    return _alive_without_lock(folder, owner)  # a file put in place of the one it holds: ask its process


def _owner_parts(owner: str) -> tuple[str, int] | None:
    """Return the host and pid an owner id names (``HOST-PID-RANDOM``, dots of HOST as '_'), or None."""
    parts = owner.rsplit("-", 2)
    if len(parts) != 3 or not is_count(parts[1]):
        return None
    return parts[0], int(parts[1])


def _local_host() -> str:
    """Return this host's name as an owner id spells it."""
    return socket.gethostname().replace(".", "_")


def _alive_by_process(lock: Path, owner: str) -> bool | None:
    """Tell whether ``owner`` lives by its process, for a user who may not open its lock (by state, as ``procs``).

    The owner id names the daemon's host and pid; on this host, that pid must run (not a
    zombie) and have started before the lock file was made: a process started later only
    reuses the pid. None (this user cannot tell): a daemon of another host, or a process
    this user may not see (/proc mounted with ``hidepid``).
    """
    parts = _owner_parts(owner)
    if parts is None or parts[0] != _local_host():
        return None
    pid = parts[1]
    try:
        made = os.stat(lock).st_mtime  # a stat needs no read access to the file
    except OSError:
        return None
    fields = procs.stat_fields(pid)
    if fields is None:  # gone, or hidden from this user: signal 0 tells them apart, never "alive"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return None
    if fields[0] in ("Z", "X"):
        return False
    return procs.started_at(fields) <= made + _START_SLACK_S


def _alive_without_lock(folder: Path, owner: str) -> bool:
    """Tell whether ``owner`` lives although no one holds its lock file (deleted or replaced under it: it locks
    it again at its next rescan), by the process its info file names: in this host's and this process's pid
    namespace (a pid of another one names another process here), running (not a zombie), a dispatcher, and
    started before the daemon said it started (a later process only reuses the pid). A daemon that stopped or
    died has no such process left: dead.
    """
    info = read_info(folder, owner)
    parts = _owner_parts(owner)
    if info is None or parts is None or parts[0] != _local_host() or parts[1] != info.pid:
        return False
    pidns = _noted(folder, owner, "pidns")
    if not isinstance(pidns, str) or not pidns or not procs.seen_here(None, pidns):
        return False  # noted in no pid namespace (an older daemon's file), or in another one: not looked up here
    if not procs.is_dispatcher(info.pid):
        return False
    fields = procs.stat_fields(info.pid)
    return fields is not None and procs.started_at(fields) <= info.started + _START_SLACK_S


def info_of_owner(folder: Path, owner: str) -> DaemonInfo | None:
    """Return what a user who may not open ``<owner>.json`` still knows of a daemon (``alive`` not looked up).

    The owner id names its host and pid; it started about when its lock file was made.
    """
    parts = _owner_parts(owner)
    if parts is None:
        return None
    host, pid = parts
    try:
        started = os.stat(folder / f"{owner}.lock").st_mtime
    except OSError:
        return None
    return DaemonInfo(owner, pid, socket.gethostname() if host == _local_host() else host, started)


class Liveness:
    """Answer "is this daemon alive?" by its flock; a dead owner stays dead (ids are never reused).

    An owner this process cannot tell about (``owner_alive`` None) counts as alive:
    nothing of a daemon that may run is taken over, and no one is told that none runs.
    """

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
        if owner_alive(self.folder, owner) is not False:
            self._alive[owner] = now
            return True
        self._alive.pop(owner, None)
        self._dead.add(owner)
        return False


def lock_held(path: str | Path) -> bool | None:
    """Return True while some open file holds a ``flock`` on path, False when none does, None when it cannot be
    opened (no such file). The lock is tried read-only and given back at once if taken."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # the probe's own lock goes with it
    return False


#: read-only: the agent inherits the descriptor (it holds the slot while it lives) and may not write through it
_LOCK_FLAGS = os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC


class SlotLock:
    """An exclusive, non-blocking ``flock`` on a file that is never deleted; held while its descriptor is open."""

    def __init__(self, path: Path) -> None:
        self.path = os.fspath(path)
        self._fd = -1

    def acquire(self) -> bool:
        """Take the lock; return False if another open file (any process, or this one) holds it."""
        try:
            fd = os.open(self.path, _LOCK_FLAGS, 0o644)
        except FileNotFoundError:  # its folder went (removed by hand): made again, as filelock does
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, _LOCK_FLAGS, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        """Give the lock back, whoever else holds its descriptor (an agent that inherited it), and close it."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @property
    def fd(self) -> int | None:
        """The descriptor that holds the lock, while held."""
        return self._fd if self._fd >= 0 else None

    def intact(self) -> bool:
        """Return False if the lock is held but its file is no longer at its path (deleted or replaced)."""
        return self._fd < 0 or same_file(self.path, self._fd)


class FlockSlots:
    """Hand out agent slots over every daemon of one host; remember which are ours."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._locks: dict[tuple[str, int], SlotLock] = {}
        self._held: dict[str, set[int]] = {}

    def take(self, agent: str, concurrency: int) -> int | None:
        """Take a free slot of agent; return its number, or None if all are busy."""
        mine = self._held.setdefault(agent, set())
        if len(mine) >= concurrency or self._held_beyond(agent, concurrency):
            return None
        for i in range(concurrency):
            if i in mine:
                continue
            lock = self._locks.get((agent, i))
            if lock is None:
                lock = self._locks[(agent, i)] = SlotLock(self.folder / f"{agent}.{i}.lock")
            if not lock.acquire():
                continue
            mine.add(i)
            return i
        return None

    def _held_beyond(self, agent: str, concurrency: int) -> bool:
        """Return True while a copy of agent holds a slot numbered concurrency or more (any daemon of this host).

        A reload lowered the agent's concurrency while those copies ran: no copy starts until they
        have ended (a slot below the new limit given back is not handed on beside them). Slots are
        taken lowest first, so their files exist in order: the look stops at the first missing one
        (one failed ``open`` when concurrency was never higher).
        """
        n = concurrency
        while (held := lock_held(f"{self.folder}/{agent}.{n}.lock")) is not None:
            if held:
                return True
            n += 1
        return False

    def fd(self, agent: str, slot: int) -> int | None:
        """Return the descriptor that holds one of our slots (its agent inherits it), or None."""
        if slot not in self._held.get(agent, ()):
            return None
        return self._locks[(agent, slot)].fd

    def free(self, agent: str, slot: int) -> None:
        """Give a slot back so that any daemon may take it."""
        mine = self._held.get(agent)
        if mine is not None and slot in mine:
            mine.discard(slot)
            self._locks[(agent, slot)].release()

    def take_back_lost(self) -> list[str]:
        """Lock again, at its path, each held slot whose file was deleted or replaced; return their paths.

        Another daemon could otherwise take the slot through a new file at that path. A slot
        another daemon took meanwhile stays ours until its job ends; that is said in the path
        returned, and the caller logs it.
        """
        lost = []
        for agent, mine in self._held.items():
            for slot in sorted(mine):
                lock = self._locks[(agent, slot)]
                if lock.intact():
                    continue
                lock.release()
                again = lock.acquire()
                lost.append(lock.path if again else f"{lock.path} (taken meanwhile by another daemon)")
        return lost

    def release_all(self) -> None:
        """Give every slot back (at stop)."""
        for agent, mine in self._held.items():
            for slot in list(mine):
                self._locks[(agent, slot)].release()
            mine.clear()


def same_file(path: str | Path, fd: int) -> bool:
    """Return True if path names the file open at fd (a lock file still in place)."""
    held = os.fstat(fd)
    return file_id(path) == (held.st_dev, held.st_ino)


LEDGER_XATTR = "user.dispatcher.ledger"  # on a daemon's liveness lock: a digest of the `ledger:` it runs with


def ledger_digest(ledger: str) -> str:
    """Return a short digest of a `ledger:` value (never the value itself, which may hold a password)."""
    return hashlib.sha256(ledger.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def note_ledger(folder: Path, owner: str, ledger: str, lease_s: float) -> None:
    """Note on the daemon's liveness lock what a reload may not change (its ledger, its lease), for `validate`.

    Best effort: on a filesystem without user xattrs `validate` tells the ledger's kind only.
    """
    with contextlib.suppress(OSError):
        os.setxattr(folder / f"{owner}.lock", LEDGER_XATTR, f"{ledger_digest(ledger)} {lease_s!r}".encode())


def noted_ledger(lock_path: str) -> tuple[str, float] | None:
    """Return (ledger digest, lease) as a daemon noted them on its liveness lock, or None when there is no note."""
    try:
        digest, lease = os.getxattr(lock_path, LEDGER_XATTR).decode("ascii").split()
        return digest, float(lease)
    except (OSError, ValueError):
        return None


def _noted(folder: Path, owner: str, key: str) -> object:
    """Return what a daemon's info file notes under key (its ``pidns``, its lock file's ``lock_ino``), or None."""
    try:
        return json.loads((folder / f"{owner}.json").read_bytes()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def write_info(folder: Path, info: DaemonInfo) -> None:
    """Write (or rewrite) a daemon's info file ``<owner>.json`` beside its liveness lock, atomically.

    Written by the daemon itself: ``pidns`` is its own pid namespace, which tells whether its pid
    names the same process in another's /proc, and ``lock_ino`` the lock file it holds: one not
    held is asked about by process only when it is another file (``owner_alive``).
    """
    try:
        lock_ino: int | None = os.stat(folder / f"{info.owner}.lock").st_ino
    except OSError:
        lock_ino = None
    body = {
        "pid": info.pid, "host": info.host, "started": info.started, "config_digest": info.config_digest,
        "pidns": procs.pid_namespace(), "lock_ino": lock_ino,
    }  # fmt: skip
    tmp = folder / f".{info.owner}.json.tmp"
    try:
        tmp.write_bytes(json.dumps(body).encode())
        os.rename(tmp, folder / f"{info.owner}.json")
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk: no half-written file is left behind
        raise


def read_info(folder: Path, owner: str) -> DaemonInfo | None:
    """Return one daemon's info (``alive`` not looked up: True), None when its file is missing or unreadable."""
    try:
        info = json.loads((folder / f"{owner}.json").read_bytes())
        digest = info.get("config_digest")
        return DaemonInfo(
            owner,
            int(info["pid"]),
            str(info["host"]),
            float(info["started"]),
            config_digest=digest if isinstance(digest, str) else None,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def read_infos(folder: Path, alive: Callable[[str], bool]) -> list[DaemonInfo]:
    """Return the daemons whose info files are in folder, newest first (damaged files are skipped).

    An info file this user may not open is read from its name and lock (``info_of_owner``).
    """
    out = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        owner = name[: -len(".json")]
        try:
            info = json.loads((folder / name).read_bytes())
        except PermissionError:  # a reader outside the daemon's group: what the names and the lock tell
            known = info_of_owner(folder, owner)
            if known is not None:
                out.append(dataclasses.replace(known, alive=alive(owner)))
            continue
        except (OSError, ValueError):
            continue
        try:
            digest = info.get("config_digest")
            out.append(
                DaemonInfo(
                    owner,
                    int(info["pid"]),
                    str(info["host"]),
                    float(info["started"]),
                    alive(owner),
                    digest if isinstance(digest, str) else None,
                )
            )
        except (ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda d: d.started, reverse=True)
