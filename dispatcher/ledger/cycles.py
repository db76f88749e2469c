"""A walk over the ledger's recorded waits: would a new ``after`` close a cycle?"""

from __future__ import annotations

from collections.abc import Sequence

from dispatcher.ledger.base import Ledger
from dispatcher.lifecycle import Row


def find_cycle(ledger: Ledger, job_id: str, after: Sequence[str]) -> list[str] | None:
    """Return the path of a cycle that ``job_id`` waiting for ``after`` would close, or None.

    A cycle is only possible through jobs that wait already (a running or finished
    job waits for nothing): walk their recorded waits from ``after``.
    """
    seen: set[str] = set()
    frontier = [(a, [job_id, a]) for a in after]
    while frontier:
        ids = [a for a, _ in frontier if a not in seen]
        paths = {a: p for a, p in frontier}
        seen.update(ids)
        frontier = []
        for w in ledger.waits(ids):
            entry = ledger.get(w.job_id)
            if entry is None or entry.state not in (Row.WAITING, Row.CLAIMED):
                continue
            for nxt in w.after:
                if nxt == job_id:
                    return [*paths[w.job_id], nxt]
                if nxt not in seen:
                    frontier.append((nxt, [*paths[w.job_id], nxt]))
    return None
