"""Process liveness by state, not by signal 0, and ending a process group.

``kill(pid, 0)`` succeeds for a zombie, and pids are reused, so liveness reads
``/proc/PID/stat``: the state letter (Z is dead) and the start time in clock
ticks since boot, compared with the one recorded when the process started.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import os
import signal
import socket
from collections.abc import Callable, Mapping

_GROUP_POLL_S = 0.02  # how often a group being ended is looked at
_KILL_WAIT_S = 5.0  # how long the SIGKILL of a group is waited for


def stat_fields(pid: int) -> list[str] | None:
    """Return the fields of /proc/PID/stat after the command name, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name may hold spaces and parentheses: split after the last ')'
    return data[data.rindex(b")") + 2 :].decode().split()


def pid_namespace() -> str:
    """Return this process's pid namespace as its inode number ("" where /proc does not say)."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # pid:[4026531836]
    except OSError:
        return ""
    return link.rpartition("[")[2].rstrip("]")


_HOST = socket.gethostname()
_PIDNS = pid_namespace()


def seen_here(host: object, pidns: object) -> bool:
    """Return True if a pid noted on host in pid namespace pidns is one of this /proc's (None: not noted).

    A pid from another host, or from another pid namespace under this host's name (a container),
    names another process here, if any: it is never looked up nor signalled as the noted one.
    """
    return (host is None or host == _HOST) and (pidns is None or not _PIDNS or pidns == _PIDNS)


def this_host() -> str:
    """Return this host's name, as agent notes and daemon entries record it."""
    return _HOST


def boot_time() -> float:
    """Return this host's last boot as Unix time (``btime`` of /proc/stat)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    return 0.0


def start_boot_s(fields: list[str]) -> float:
    """Return a process's start in seconds since boot (field 22 of /proc/PID/stat)."""
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def started_at(fields: list[str]) -> float:
    """Return a process's start as Unix time, from its /proc/PID/stat fields (good to about a second: btime)."""
    return boot_time() + start_boot_s(fields)


def age_s() -> float:
    """Return how long this process has run, from its start in /proc (0.0 where that cannot be read)."""
    fields = stat_fields(os.getpid())
    try:
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_boot_s(fields)) if fields else 0.0
    except (OSError, ValueError, IndexError):
        return 0.0


def is_alive(
    pid: int, started: float | None = None, *, boot_started: float | None = None, tolerance_s: float = 1.5
) -> bool:
    """Return True if pid runs (not a zombie) and, if given, is the process that was recorded (``is_recorded``)."""
    fields = stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return is_recorded(fields, started, boot_started=boot_started, tolerance_s=tolerance_s)


def is_recorded(
    fields: list[str], started: float | None, *, boot_started: float | None = None, tolerance_s: float = 1.5
) -> bool:
    """Return True if the process of these /proc/PID/stat fields (alive or a zombie) started when recorded.

    ``boot_started`` is the start on the boot clock (``CLOCK_BOOTTIME``), the clock
    /proc's start ticks count on, noted just after the spawn returned: it never steps,
    so a wall-clock jump (NTP, a resumed VM) cannot make a live agent look like someone
    else's process. The process forked before its note was made, so one that started
    after the note (by more than a clock tick) took the pid since, however soon; one
    that started more than ``tolerance_s`` before it is not the one either.
    ``started`` (wall clock, good to about a second) is only used for records made without it.
    """
    if boot_started is not None:
        start = start_boot_s(fields)
        return boot_started - tolerance_s <= start <= boot_started + 1 / os.sysconf("SC_CLK_TCK")
    if started is None:
        return True
    return abs(started_at(fields) - started) <= tolerance_s


def open_for_writing(path: str) -> bool | None:
    """Return True if some process holds path open for writing, False if none does, None if it cannot be told.

    Asks the kernel, not /proc: a read lease is refused (EAGAIN) while the file is open for
    writing anywhere, and is given back at once. Only the file's owner (or a process with
    CAP_LEASE) may take one: for others, and where leases are off, the answer is None. A
    writer opening the file in the microseconds the lease is held waits for its release;
    the lease's break is signalled with SIGURG, which is ignored unless handled, never with
    SIGIO, whose default would end the daemon.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        return True if exc.errno == errno.EAGAIN else None
    else:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)


def held_for_writing(paths: set[str]) -> set[str]:
    """Return those of paths that some process has open for writing.

    The kernel is asked first (``open_for_writing``): it knows every writer of the file,
    whatever name, link or mount it was opened by (a draft hard-linked into inbox/ and
    still written under its own name). Only paths it cannot tell about (a file of
    another user, leases off) are looked for in /proc (``_held_in_proc``).
    """
    found: set[str] = set()
    unsure: set[str] = set()
    for path in paths:
        answer = open_for_writing(path)
        if answer:
            found.add(path)
        elif answer is None:
            unsure.add(path)
    return found | _held_in_proc(unsure) if unsure else found


def _held_in_proc(paths: set[str]) -> set[str]:
    """Return those of paths that some process this one can see has open for writing, by /proc.

    One walk of /proc/*/fd (and the open flags in /proc/*/fdinfo) answers for
    every path at once. It is slow with many processes, so the daemon asks it
    from its io pool, only about files that have already stopped changing. A path
    is also known by its real path, as /proc shows an open file: a writer that
    opened it through a symlinked folder holds it all the same. A writer that reached
    the file by another path altogether (a bind mount, a container's volume, its own
    mount namespace) shows that path: a descriptor whose file name is one of ours is
    matched by the inode and device its fdinfo gives (``_same_file``). The walk reads
    links and /proc's own files only, never the files behind them: a descriptor on a
    hung network mount cannot stop it.
    """
    found: set[str] = set()
    names: dict[str, list[str]] = {}
    by_base: dict[str, list[tuple[str, int, int]]] = {}  # a file name -> (path, device, inode) of ours
    for path in paths:
        names.setdefault(path, []).append(path)
        real = os.path.realpath(path)
        if real != path:
            names.setdefault(real, []).append(path)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        by_base.setdefault(os.path.basename(path), []).append((path, st.st_dev, st.st_ino))
    if not names:
        return found
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        devices: dict[int, int | None] = {}  # this process's mount ids -> their devices, read once if needed
        for fd in fds:
            try:
                link = os.readlink(f"{fd_dir}/{fd}")
                held = names.get(link)
                alike = None
                if held is None:
                    alike = by_base.get(link.rpartition("/")[2])
                    if alike is None:
                        continue
                elif held[0] in found:
                    continue
                info = _fdinfo(f"/proc/{pid}/fdinfo/{fd}")
            except (OSError, ValueError):
                continue
            if not info.get("flags", 0) & (os.O_WRONLY | os.O_RDWR):
                continue
            if held is not None:
                found.update(held)
            elif alike is not None:
                found.update(p for p, dev, ino in alike if _same_file(pid, info, dev, ino, devices))
    return found


def _fdinfo(path: str) -> dict[str, int]:
    """Return the flags (octal), mount id and inode an fdinfo file of /proc gives (those it has)."""
    out: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "flags":
                out[key] = int(value.split()[0], 8)
            elif key in ("mnt_id", "ino"):
                out[key] = int(value.split()[0])
    return out


def _same_file(pid: str, info: dict[str, int], dev: int, ino: int, devices: dict[int, int | None]) -> bool:
    """Return True when a descriptor (its fdinfo) is the file with that device and inode.

    The inode comes from fdinfo (Linux 5.14 and later); the device from the mount id, through
    the process's own mountinfo (a bind mount has its source's device). Anything unknown is no match.
    """
    mnt_id = info.get("mnt_id")
    if info.get("ino") != ino or mnt_id is None:
        return False
    if mnt_id not in devices:
        devices[mnt_id] = _mount_device(pid, mnt_id)
    return devices[mnt_id] == dev


def _mount_device(pid: str, mnt_id: int) -> int | None:
    """Return the device of mount mnt_id as process pid sees its mounts (its mountinfo), or None."""
    want = f"{mnt_id} "
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            for line in f:
                if line.startswith(want):
                    major, _, minor = line.split()[2].partition(":")
                    return os.makedev(int(major), int(minor))
    except (OSError, ValueError, IndexError):
        return None
    return None


def group_members(pgid: int) -> list[tuple[int, str, int]]:
    """Return (pid, state, ppid) of every process in the process group pgid."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = stat_fields(int(name))
        if fields is not None and int(fields[2]) == pgid:
            members.append((int(name), fields[0], int(fields[1])))
    return members


def holds_open(pid: int, path: str, *, unreadable: bool = False) -> bool:
    """Return True if pid has the file at path open, as /proc shows its descriptors.

    The file is matched by its device and inode, so a process that opened it under another
    path (a bind mount of the root, a symlink) holds it too. False when path is gone.
    ``unreadable``: the answer for a process whose descriptors this user may not read (another user's).
    """
    wanted = _file_id(path)
    if wanted is None:
        return False
    return _any_open(pid, lambda fd: _file_id(fd) == wanted, unreadable)


def holds_open_under(pid: int, folder: str, *, unreadable: bool = False) -> bool:
    """Return True if pid has a file under folder open (its descriptors as /proc shows them).

    ``unreadable``: the answer for a process whose descriptors this user may not read (another user's).
    """
    prefix = folder.rstrip("/") + "/"
    return _any_open(pid, lambda fd: os.readlink(fd).startswith(prefix), unreadable)


def _any_open(pid: int, wanted: Callable[[str], bool], unreadable: bool) -> bool:
    """Return True if ``wanted`` says yes to one of pid's descriptors (given as its ``/proc/PID/fd/N`` path)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except PermissionError:
        return unreadable
    except OSError:
        return False
    for fd in fds:
        try:
            if wanted(f"/proc/{pid}/fd/{fd}"):
                return True
        except OSError:
            continue
    return False


def job_id_of(pid: int) -> str | None:
    """Return the DISPATCH_JOB_ID of pid's environment, or None (none, or unreadable)."""
    env = _dispatch_env(pid)
    return env[b"DISPATCH_JOB_ID"].decode(errors="replace") if env is not None else None


def _dispatch_env(pid: int) -> dict[bytes, bytes] | None:
    """Return the DISPATCH_* variables of pid's environment, or None when it has no DISPATCH_JOB_ID (or is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    if b"DISPATCH_JOB_ID=" not in data:
        return None
    env = dict(e.split(b"=", 1) for e in data.split(b"\0") if e.startswith(b"DISPATCH_") and b"=" in e)
    return env if b"DISPATCH_JOB_ID" in env else None


def job_groups(jobs: Mapping[str, str]) -> dict[str, list[int]]:
    """Return the process groups still running for jobs, in one walk of /proc.

    ``jobs`` maps a job id to its work/ folder. A live process belongs to a job when its
    environment says so: ``DISPATCH_JOB_ID`` and ``DISPATCH_ORDER`` in that work/ folder,
    which every agent, probe and hook of the job gets (whatever its attempt) and its
    children inherit. No pid, start time or working folder is compared: a reused pid, a
    clock step or a person's shell in work/ never passes for one of the job's processes.
    (An agent that cleared its environment is found by the pid noted at its start:
    ``store.orphans``.)
    """
    found: dict[str, set[int]] = {job_id: set() for job_id in jobs}
    works = {job_id: os.path.realpath(work) for job_id, work in jobs.items()}
    real_of: dict[bytes, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        job_id = _job_of(pid, works, real_of)
        if job_id is None or not is_alive(pid):
            continue
        try:
            found[job_id].add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    return {job_id: sorted(groups) for job_id, groups in found.items()}


def _job_of(pid: int, works: Mapping[str, str], real_of: dict[bytes, str]) -> str | None:
    """Return the job (of works) whose DISPATCH_* variables pid's environment holds, or None."""
    env = _dispatch_env(pid)
    if env is None:
        return None
    job_id = env[b"DISPATCH_JOB_ID"].decode(errors="replace")
    order = env.get(b"DISPATCH_ORDER", b"")
    if job_id not in works or not order.endswith(b"/order.json"):
        return None
    work = real_of.get(order)
    if work is None:
        work = real_of[order] = os.path.realpath(os.fsdecode(order[: -len(b"/order.json")]))
    if work == works[job_id]:
        return job_id
    # the same folder under another path: the root bind-mounted elsewhere in the process's container, whose
    # own root (/proc/PID/root) resolves the path as the process does; the folder's device and inode decide
    there = _file_id(f"/proc/{pid}/root{os.fsdecode(order[: -len(b'/order.json')])}")
    return job_id if there is not None and there == _file_id(works[job_id]) else None


def _file_id(path: str) -> tuple[int, int] | None:
    """Return (st_dev, st_ino) of the file at path, or None (``fsutil.file_id``; procs imports nothing of ours)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return None
    return (st.st_dev, st.st_ino)


def one_malloc_arena() -> None:
    """Ask glibc's malloc for one arena shared by every thread (``M_ARENA_MAX`` 1), before threads start.

    By default each thread that allocates gets an arena of its own, which an idle
    daemon's lane threads keep touched: about 1 MB of resident memory for no gain,
    since the interpreter lock already keeps the threads from allocating at once.
    A libc without ``mallopt`` (musl) is left as it is.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(ctypes.c_int(_M_ARENA_MAX), ctypes.c_int(1))


_M_ARENA_MAX = -8  # malloc.h


def flock_holder(path: str | os.PathLike[str]) -> int | None:
    """Return the pid that took the ``flock`` held on path's file (/proc/locks), or None if none is seen.

    The pid stays the locker's after it died while a child that inherited the descriptor
    keeps the lock: a live lock whose locker is gone is held by what that process left running.
    """
    try:
        st = os.stat(path)
        with open("/proc/locks", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != b"FLOCK":
            continue
        try:
            major, minor, ino = parts[5].split(b":")
            if (int(major, 16), int(minor, 16), int(ino)) == want:
                return int(parts[4])
        except ValueError:
            continue
    return None


def locked_unseen(path: str | os.PathLike[str]) -> bool:
    """Return True if path's file is ``flock``-ed by a process this /proc does not show (another pid namespace).

    The lock is tried (and given back at once if taken). `/proc/locks` lists only the locks whose
    taker this namespace can name, so a held lock missing from it is held out of sight, unless a
    process this /proc shows has the file open: one that inherited it from a taker that died (in
    a namespace below the kernel's first, a dead taker cannot be named either).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if flock_holder(path) is not None:
            return False
        st = os.fstat(fd)
        me = os.getpid()
        seen = (int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me)
        # under whatever path (a bind mount's included): the file's device and inode
        return not any(_any_open(pid, lambda f: _file_id(f) == (st.st_dev, st.st_ino), False) for pid in seen)
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def is_dispatcher(pid: int) -> bool:
    """Return True if pid runs (not a zombie) and its command line names dispatcher."""
    fields = stat_fields(pid) if pid > 0 else None
    if fields is None or fields[0] in ("Z", "X"):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"dispatcher" in f.read()
    except OSError:
        return False


def signal_group(pgid: int, sig: int) -> bool:
    """Send sig to the group; return False if no process is left in it."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def group_gone(pgid: int) -> bool:
    """Reap our own zombies in the group, then return True if no process is left in it (signal 0).

    A group's first look, which most agents' groups pass: ``end_group`` looks this way
    at each of its polls, and an agent's exit once before a task is made to end its group.
    """
    try:
        while os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG) is not None:
            pass  # reap our own zombies in the group
    except OSError:  # ChildProcessError: none of ours is left in it
        pass
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return True
    return False


async def end_group(
    pgid: int, grace_s: float, *, already_termed: bool = False, hurry: Callable[[], bool] | None = None
) -> None:
    """End a process group without blocking the loop: SIGTERM, wait up to grace_s, SIGKILL.

    Group members that are our own zombies are reaped on the way; members that are
    someone else's zombies count as gone after the SIGKILL wait. ``hurry`` (a stop came)
    cuts the grace short: SIGKILL then, not at its end.
    """
    if not already_termed and not signal_group(pgid, signal.SIGTERM):
        return
    loop = asyncio.get_running_loop()
    if await _emptied(pgid, loop.time() + grace_s, hurry):
        return
    signal_group(pgid, signal.SIGKILL)
    await _emptied(pgid, loop.time() + _KILL_WAIT_S)


async def _emptied(pgid: int, deadline: float, hurry: Callable[[], bool] | None = None) -> bool:
    """Wait until no live process is left in the group (True), or the deadline passes or ``hurry()`` (False)."""
    loop = asyncio.get_running_loop()
    polls = 0
    while True:
        if group_gone(pgid):
            return True
        polls += 1
        if polls % 5 == 0 and not any(state not in ("Z", "X") for _pid, state, _ppid in group_members(pgid)):
            return True  # only zombies left, waiting for their parent (or init) to reap them
        if loop.time() >= deadline or (hurry is not None and hurry()):
            return False
        await asyncio.sleep(_GROUP_POLL_S)
