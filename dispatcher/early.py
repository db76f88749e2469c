"""Signals that come while ``dispatcher run`` is still starting, before its loop can take them.

The daemon's loop installs its own handlers once it runs; the imports, the config and
the ledger before it take a good part of a second. A SIGTERM or SIGINT in that time would
end the process by the signal (exit -15, or 130 with a traceback) instead of the
graceful stop with exit 0 that section 9 promises. ``catch`` notes them from the first
line of ``dispatcher run``; the daemon takes the noted ones over when its handlers are in.
"""

from __future__ import annotations

import signal
from types import FrameType

CAUGHT = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_noted: list[int] = []


def _note(signum: int, frame: FrameType | None) -> None:
    _noted.append(signum)


def catch() -> None:
    """Note SIGTERM, SIGINT and SIGHUP from now on, until the daemon's loop handles them."""
    for sig in CAUGHT:
        signal.signal(sig, _note)


def stop_noted() -> bool:
    """Return True if SIGTERM or SIGINT was noted (and keep every noted signal for ``taken``)."""
    return any(sig != signal.SIGHUP for sig in _noted)


def taken() -> list[int]:
    """Return the signals noted so far and forget them (the daemon's handlers are in place)."""
    out = list(_noted)
    del _noted[: len(out)]
    return out
