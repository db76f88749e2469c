"""Process liveness by state, not by signal 0, and ending a process group.

``kill(pid, 0)`` succeeds for a zombie, and pids are reused, so liveness reads
``/proc/PID/stat``: the state letter (Z is dead) and the start time in clock
ticks since boot, compared with the one recorded when the process started.
"""

from __future__ import annotations

import ctypes
import os


def stat_fields(pid: int) -> list[str] | None:
    """Return the fields of /proc/PID/stat after the command name, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name may hold spaces and parentheses: split after the last ')'
    return data[data.rindex(b")") + 2 :].decode().split()


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    return 0.0


def with_cwd(path: str) -> list[int]:
    """Return the pids of live processes whose working folder is path (or below it)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{name}/cwd")
        except OSError:
            continue
        if (cwd == path or cwd.startswith(path + "/")) and is_alive(int(name)):
            found.append(int(name))
    return found


def start_boot_s(fields: list[str]) -> float:
    """Return a process's start in seconds since boot (field 22 of /proc/PID/stat)."""
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def is_alive(
    pid: int, started: float | None = None, *, boot_started: float | None = None, tolerance_s: float = 1.5
) -> bool:
    """Return True if pid runs (not a zombie) and, if given, is the process that was recorded.

    ``boot_started`` is the start on the boot clock (``CLOCK_BOOTTIME``), the clock
    /proc's start ticks count on: it never steps, so a wall-clock jump (NTP, a
    resumed VM) cannot make a live agent look like someone else's process.
    ``started`` (wall clock) is only used for records made without it.
    """
    fields = stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    if boot_started is not None:
        return abs(start_boot_s(fields) - boot_started) <= tolerance_s
    if started is None:
        return True
    return abs(_boot_time() + start_boot_s(fields) - started) <= tolerance_s


def held_for_writing(paths: set[str]) -> set[str]:
    """Return those of paths that some process this one can see has open for writing.

    One walk of /proc/*/fd (and the open flags in /proc/*/fdinfo) answers for
    every path at once. It is slow with many processes, so the daemon asks it
    from its io pool, only about files that have already stopped changing.
    """
    found: set[str] = set()
    if not paths:
        return found
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
                if target not in paths or target in found:
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    flags = next((int(line.split()[1], 8) for line in f if line.startswith("flags:")), 0)
            except (OSError, ValueError):
                continue
            if flags & (os.O_WRONLY | os.O_RDWR):
                found.add(target)
    return found


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
