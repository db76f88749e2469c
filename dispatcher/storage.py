"""What the root's filesystem is: one held in memory, where an fsync costs nothing, or a disk.

A job's post-exit file work (its record, evidence, fsyncs and staged result) runs on a
worker thread so that the event loop never waits on a disk. Where the files live in
memory (tmpfs, ramfs) there is nothing to wait for, and the hand-off itself is the cost:
the worker and the loop then contend for the interpreter lock at every system call. So
the daemon asks once, at start, where its root lives (``in_memory``), and a job whose
work/ is small (``small_folder``) does that work on the loop instead.
"""

from __future__ import annotations

import os
import stat

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
MOUNTINFO = "/proc/self/mountinfo"
SMALL_FOLDER_BYTES = 1 << 20  # a job's work/ up to 1 MiB is read in well under a millisecond in memory
SMALL_FOLDER_ENTRIES = 64


def _unescape(field: str) -> str:
    """Undo mountinfo's octal escapes (``\\040`` for a space, ``\\011``, ``\\012``, ``\\134``)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def filesystem_of(path: str, mountinfo: str) -> str | None:
    """Return the type of the filesystem mounted where ``path`` (absolute, resolved) lives, per mountinfo's text.

    The mount whose point is the longest prefix of the path wins; a later line of the
    same point (mounted over it) wins over an earlier one.
    """
    best, best_len = None, -1
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) < 10 or "-" not in fields[6:]:
            continue
        point = _unescape(fields[4])
        sep = fields.index("-", 6)
        inside = path == point or point == "/" or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best_len:
            best, best_len = fields[sep + 1], len(point)
    return best


def in_memory(path: str | os.PathLike[str]) -> bool:
    """Return True if path lives on a filesystem held in memory (tmpfs, ramfs); False when unknown."""
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as fh:
            text = fh.read()
        return filesystem_of(os.path.realpath(path), text) in MEMORY_FILESYSTEMS
    except OSError:
        return False


def small_folder(path: str) -> bool:
    """Return True if path holds only regular files (no subfolder, no link) adding up to at most 1 MiB.

    Cheap on a filesystem in memory: one listing, no file opened. Anything it cannot
    tell (an error, a subfolder such as outbox/, which the ledger is asked about) is
    not small.
    """
    total = 0
    try:
        with os.scandir(path) as it:
            for n, entry in enumerate(it):
                if n >= SMALL_FOLDER_ENTRIES:
                    return False
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    return False
                total += st.st_size
                if total > SMALL_FOLDER_BYTES:
                    return False
    except OSError:
        return False
    return True
