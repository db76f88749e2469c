"""Who releases a follow-up: one process at a time per reserved row, whatever host it runs on.

A follow-up becomes releasable when its parent is done, and more than one process may try
at once: the daemon that finished the parent, the command that approved it, and the
housekeeping of every other daemon (which releases what a dead or absent releaser left).
Each takes the row's turn in the ledger before it links the file into inbox/; the turn is
the row's ``owner``, set in one conditional write.

A daemon takes it under its owner id; a command under an id of its own made from its host,
pid and start time. A turn is taken over only from a holder that is gone: a daemon the
ledger no longer sees alive, a command on this host whose process ended, or a command on
another host that has held it for ``RELEASE_GRACE_S`` (its process cannot be seen from here).
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable

from dispatcher import procs
from dispatcher.text import is_count

COMMAND = "cmd:"
#: how long a command on another host keeps a turn it took (a release takes milliseconds)
RELEASE_GRACE_S = 60.0


@functools.cache
def _command_id() -> str:
    fields = procs.stat_fields(os.getpid())
    ticks = fields[19] if fields else "0"
    return f"{COMMAND}{socket.gethostname()}:{os.getpid()}:{ticks}"


def releaser(owner: str) -> str:
    """Return the id a release is taken under: the daemon's owner id, or this command's own."""
    return owner or _command_id()


def holder_gone(holder: str, alive: Callable[[str], bool], held_since: float, now: float) -> bool:
    """Return True if the process holding a release turn is gone (pure but for /proc of this host)."""
    if not holder.startswith(COMMAND):
        return not alive(holder)
    host, pid, ticks = holder[len(COMMAND) :].rsplit(":", 2)
    if host != socket.gethostname():
        return now - held_since > RELEASE_GRACE_S
    fields = procs.stat_fields(int(pid)) if is_count(pid) else None
    return fields is None or fields[0] in ("Z", "X") or fields[19] != ticks
