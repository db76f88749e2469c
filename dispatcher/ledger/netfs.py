"""Tell a network filesystem from a local one (statfs magic numbers), for the SQLite ledger.

SQLite's WAL needs shared memory and POSIX locks that network filesystems do not
give (sqlite.org/wal.html), and so do the flocks this engine uses for liveness and
slots. The SQLite ledger refuses to start on one: such a root needs the
PostgreSQL ledger.

Every FUSE mount has one magic number, local or not. A FUSE filesystem you know to be
local (a test filesystem such as tests/powercut/lazyfs.py) is let through by naming its
subtype, the part after ``fuse.`` in /proc/self/mountinfo, in ``DISPATCHER_LOCAL_FUSE``
(comma-separated).
"""

from __future__ import annotations

import ctypes
import os

FUSE_MAGIC = 0x65735546

#: f_type values of statfs(2) for filesystems shared over a network
NETWORK_MAGIC = {
    0x6969: "NFS",
    0xFE534D42: "SMB2",
    0xFF534D42: "CIFS",
    0x517B: "SMB",
    FUSE_MAGIC: "FUSE",
    0x00C36400: "Ceph",
    0x01021997: "9p",
    0x6B414653: "AFS",
    0x5346414F: "OpenAFS",
    0x47504653: "GPFS",
    0x0BD00BD0: "Lustre",
}


def filesystem_kind(path: str | os.PathLike[str]) -> str | None:
    """Return the name of the network filesystem path lives on, or None for a local one."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first field (a long)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(path), buf) != 0:
        return None
    magic = int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], "little", signed=False) & 0xFFFFFFFF
    if magic == FUSE_MAGIC and fuse_subtype(path) in _vouched_local():
        return None
    return NETWORK_MAGIC.get(magic)


def _vouched_local() -> set[str]:
    return {name.strip() for name in os.environ.get("DISPATCHER_LOCAL_FUSE", "").split(",") if name.strip()}


def fuse_subtype(path: str | os.PathLike[str]) -> str | None:
    """Return the subtype of the FUSE mount path lives on (``fuse.lazyfs`` gives ``lazyfs``), if any."""
    try:
        dev = os.stat(path).st_dev
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[2] == wanted and " - " in line:
            fstype = line.split(" - ", 1)[1].split()[0]
            return fstype.removeprefix("fuse.") if fstype.startswith("fuse.") else None
    return None
