"""Fault points for crash tests: kill this process at a named step, as a power cut would.

``point("review.decided")`` does nothing unless ``$DISPATCHER_FAULT`` names that
point, in which case the process sends itself SIGKILL there. The crash tests
use it to stop a short command (approve, reject) between two of its steps, which
a test cannot hit from outside by timing.
"""

from __future__ import annotations

import os
import signal

_WANTED = os.environ.get("DISPATCHER_FAULT")


def point(name: str) -> None:
    """Die here, at once and without cleanup, if $DISPATCHER_FAULT names this point."""
    if name == _WANTED:
        os.kill(os.getpid(), signal.SIGKILL)


def armed(name: str) -> bool:
    """Return True if $DISPATCHER_FAULT names this point (for a step that must set up its own crash)."""
    return name == _WANTED
