"""A command's log lines handed to the running daemon, which writes them on its stdout (the journal).

`hold`, `release`, `approve`, `reject` and the other operator actions log their
events (``job.held``, ``job.approved`` ...) into ``log_file`` themselves. Under
systemd the daemon's stdout is the journal, and the command's is the operator's
terminal: so each line is also dropped, one file per line, into
``.state/control/`` as ``log-<ns>-<pid>-<n>``, written aside and renamed in whole.
The daemon wakes on it, reads the file, writes the line on its stdout in its own format
(never into ``log_file``, which has it already), and only then removes the file
(``pass_on``): a crash in between leaves it for the next start, never a line lost.
A line dropped while no daemon runs is written by the next one to start.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import time
from collections.abc import Callable

from dispatcher import faults
from dispatcher.layout import Layout

PREFIX = "log-"


class Relay:
    """Drops each log line of one command into the control folder (see the module docstring)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._seq = itertools.count(1)

    def send(self, json_line: str) -> None:
        """Drop one JSON line for the daemon; raise OSError if it cannot be written (the caller ignores it)."""
        name = f"{PREFIX}{time.time_ns()}-{os.getpid()}-{next(self._seq)}"
        tmp = self.layout.state_dir / f".{name}.tmp"  # beside, not in, control/: a daemon never sees it half written
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(json_line + "\n")
        self.layout.control.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, self.layout.control / name)


def pass_on(layout: Layout, names: list[str], write: Callable[[str], None]) -> list[str]:
    """Write the lines of the relay files among hint names with ``write``, oldest first; return them.

    Each file is removed once its lines are written, in this one call (a daemon's worker
    thread runs it to its end even when a stop cancels the pass that asked): a kill before
    the write leaves the file for the next start, never a line lost. A file gone is skipped
    (another daemon on the root wrote it).
    """
    out: list[str] = []
    for name in sorted(n for n in names if n.startswith(PREFIX)):
        path = layout.control / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:  # one daemon passes a file on: another woken by the same hint leaves it (or finds it gone)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            if os.fstat(fd).st_nlink == 0:  # passed on and removed while this one waited to open it
                continue
            with os.fdopen(os.dup(fd), encoding="utf-8") as f:
                lines = [line for line in f.read().splitlines() if line]
            faults.point("relay.read")
            for line in lines:
                write(line)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            out.extend(lines)
        except (OSError, ValueError):
            continue
        finally:
            os.close(fd)
    return out


def take_relayed(layout: Layout, names: list[str]) -> list[str]:
    """Return the JSON lines of the relay files among hint names, oldest first, and remove those files.

    Taken once, as by ``pass_on``, for a caller that writes them itself.
    """
    return pass_on(layout, names, lambda _line: None)
