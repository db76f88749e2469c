"""At a stop, cut ledger calls that hang on a silent server, so that the stop is answered in time.

A PostgreSQL server whose processes are stopped (SIGSTOP, a frozen VM, a hung disk) is
silent, not gone: its kernel still answers TCP, so neither keepalives nor
``tcp_user_timeout`` end a read, and its ``statement_timeout`` never runs. A ledger
call blocked in such a read never gets back to its wait's ``give_up``, and the stop
would wait with it (contract section 13: a stop is answered within ``stop_timeout``
whatever the ledger's state). From the moment the ledger's waits give up, this thread
cuts, every ``EVERY_S``, the connections of calls hung for ``STUCK_S`` or more; each
such call then fails as a lost connection and gives up. Healthy calls take
milliseconds and are never cut. What could not be recorded is recovered at the next start.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from dispatcher.ledger.base import Ledger

log = structlog.get_logger("dispatcher")

STUCK_S = 1.0  # a call this old while a stop waits for it is hung, not slow
EVERY_S = 0.25


def watch(ledger: Callable[[], Ledger | None], start_at: float, stop_timeout_s: float = 60.0) -> None:
    """Start the thread: from ``start_at`` (monotonic seconds) until the process exits, cut hung calls.

    A small ``stop_timeout`` cuts sooner (a quarter of it, 0.1 s at least): a call made after a
    cut, hung again, must not hold the stop for a whole ``STUCK_S`` past its deadline.
    """
    stuck_s = min(STUCK_S, max(0.1, stop_timeout_s / 4))
    args = (ledger, start_at, stuck_s, min(EVERY_S, stuck_s / 2))
    threading.Thread(target=_run, args=args, name="stopwatch", daemon=True).start()


def _run(ledger: Callable[[], Ledger | None], start_at: float, stuck_s: float, every_s: float) -> None:
    while (left := start_at - time.monotonic()) > 0:
        time.sleep(min(left, 3600.0))  # in steps: time.sleep refuses a stop_timeout of 1e300 (OverflowError)
    said = False
    while True:
        found = ledger()
        cut = found.sever_stuck(stuck_s) if found is not None else 0
        if cut and not said:
            why = "the ledger did not answer during the stop: what it could not record is recovered at the next start"
            log.warning("ledger.cut", calls=cut, reason=why)
            said = True
        time.sleep(every_s)
