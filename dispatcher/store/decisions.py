"""The root's review lock: one operator decision on a job in review/ (or its revision) at a time on this host.

`approve`, `reject` and `revise` take it for the whole of their step, so that a revision
asked for while a decision lands finds the folder where the decision put it; a daemon's
rescan that lands decisions cut short tries it without waiting (``review_lock(layout, 0)``).
Other hosts are kept apart by the ledger's claim token, not by this lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from filelock import FileLock, Timeout

from dispatcher.errors import WrongState
from dispatcher.layout import Layout

DECISION_WAIT_S = 30


def review_lock(layout: Layout, timeout: float) -> FileLock:
    """Return the root's review lock (``.state/review.lock``), held by each decision and by ``settle_reviews``."""
    return FileLock(layout.state_dir / "review.lock", timeout=timeout, thread_local=False, preserve_lock_file=True)


@contextlib.contextmanager
def one_decision(layout: Layout) -> Iterator[None]:
    """Hold the root's review lock: one decision at a time on this host (other hosts: the ledger's token)."""
    layout.state_dir.mkdir(parents=True, exist_ok=True)
    lock = review_lock(layout, DECISION_WAIT_S)
    try:
        lock.acquire()
    except Timeout:
        raise WrongState(f"another decision on {layout.root} has held its lock for {DECISION_WAIT_S} s") from None
    try:
        yield
    finally:
        lock.release()
