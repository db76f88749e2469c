"""Process liveness by state, not by signal 0, and ending a process group.

``kill(pid, 0)`` succeeds for a zombie, and pids are reused, so liveness reads
``/proc/PID/stat``: the state letter (Z is dead) and the start time in clock
ticks since boot, compared with the one recorded when the process started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

_SLEEP_S = 0.02


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


def is_alive(pid: int, started: float | None = None, *, tolerance_s: float = 1.5) -> bool:
    """Return True if pid runs (not a zombie) and, if given, started at ``started`` (epoch seconds).

    The start time tells a reused pid from the process that was recorded: the
    daemon records the wall-clock time just after the spawn, and the kernel's
    start time (boot time + start ticks) must agree within ``tolerance_s``.
    """
    fields = stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    if started is None:
        return True
    began = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return abs(began - started) <= tolerance_s


def open_for_writing(path: str) -> bool:
    """Return True if a process this one can see has path open for writing.

    Reads /proc/*/fd and the open flags in /proc/*/fdinfo: costly, so it is only
    asked about a file that has already stopped changing for ``settle`` seconds.
    """
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
                if os.readlink(f"{fd_dir}/{fd}") != path:
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    flags = next((int(line.split()[1], 8) for line in f if line.startswith("flags:")), 0)
            except (OSError, ValueError):
                continue
            if flags & (os.O_WRONLY | os.O_RDWR):
                return True
    return False


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


def _living(pgid: int) -> bool:
    """Reap our own zombies in the group; return True while a live member remains."""
    alive = False
    me = os.getpid()
    for pid, state, ppid in group_members(pgid):
        if state in ("Z", "X"):
            if ppid == me:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
        else:
            alive = True
    return alive


def signal_group(pgid: int, sig: int) -> bool:
    """Send sig to the group; return False if the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def end_group(pgid: int, grace_s: float) -> None:
    """SIGTERM the group, wait up to grace_s for it to empty, then SIGKILL what is left."""
    if not signal_group(pgid, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace_s
    while _living(pgid):
        if time.monotonic() >= deadline:
            signal_group(pgid, signal.SIGKILL)
            kill_deadline = time.monotonic() + 5.0
            while _living(pgid) and time.monotonic() < kill_deadline:
                time.sleep(_SLEEP_S)
            return
        time.sleep(_SLEEP_S)
