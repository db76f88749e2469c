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


_OCTAL = frozenset("01234567")


def _unescape(field: str) -> str:
    """Undo mountinfo's octal escapes (``\\040`` for a space, ``\\011``, ``\\012``, ``\\134``)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and set(code) <= _OCTAL:
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts(mountinfo: str) -> list[tuple[str, str, str]]:
    """Return (major:minor, mount point, filesystem type) for each well-formed line, in order."""
    out = []
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            out.append((fields[2], _unescape(fields[4]), fields[sep + 1]))
        except (ValueError, IndexError):
            continue
    return out


def filesystem_of(path: str, mountinfo: str, dev: str | None = None) -> str | None:
    """Return the type of the filesystem that holds ``path`` (absolute, resolved), per mountinfo's text.

    ``dev`` is the path's own device (``major:minor`` of its ``st_dev``): the mount of
    that device is the one that holds it, whatever is mounted over or under it. Where
    no line has it (a btrfs subvolume reports a device of its own), the mount whose
    point is the longest prefix of the path wins, a later line of the same point (one
    mounted over it) over an earlier one.
    """
    mounts = _mounts(mountinfo)
    kinds = {kind for device, _, kind in mounts if device == dev}
    if len(kinds) == 1:
        return kinds.pop()
    best, best_len = None, -1
    for _, point, kind in mounts:
        inside = path == point or point == "/" or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best_len:
            best, best_len = kind, len(point)
    return best


def mount_point_of(path: str, mountinfo: str) -> str | None:
    """Return the mount point (of mountinfo's text) that holds ``path`` (absolute, resolved). A bind mount of a
    folder of the same disk has a point of its own, though its device is the same: a rename across it fails (EXDEV).

    Mounts are listed in the order they were made: of the points that hold the path, the last one made is the
    one seen there, deeper or not (a mount on a parent folder hides the ones made under it before). Only ``/``
    listed late (a container's root) is taken for the base it is, never over a deeper point.
    """
    best: str | None = None
    for _, point, _ in _mounts(mountinfo):
        if point == "/":
            best = best or point
        elif path == point or path.startswith(point.rstrip("/") + "/"):
            best = point
    return best


def in_memory(path: str | os.PathLike[str]) -> bool:
    """Return True if path lives on a filesystem held in memory (tmpfs, ramfs); False when unknown."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as fh:
            text = fh.read()
    except OSError:
        return False
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    return filesystem_of(real, text, dev) in MEMORY_FILESYSTEMS


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
