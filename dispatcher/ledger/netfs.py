"""Tell a network filesystem from a local one (statfs magic numbers), for the SQLite ledger.

SQLite's WAL needs shared memory and POSIX locks that network filesystems do not
give (sqlite.org/wal.html), and so do the flocks this engine uses for liveness and
slots. The SQLite ledger refuses to start on one: such a root needs the
PostgreSQL ledger.
"""

from __future__ import annotations

import ctypes
import os

#: f_type values of statfs(2) for filesystems shared over a network
NETWORK_MAGIC = {
    0x6969: "NFS",
    0xFE534D42: "SMB2",
    0xFF534D42: "CIFS",
    0x517B: "SMB",
    0x65735546: "FUSE",
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
    return NETWORK_MAGIC.get(magic)
