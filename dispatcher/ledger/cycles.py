"""A walk over the ledger's recorded waits: would a new ``after`` close a cycle?"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dispatcher.ledger.base import Ledger
from dispatcher.lifecycle import Row


def find_cycle(
    ledger: Ledger, job_id: str, after: Sequence[str], pending: Mapping[str, Sequence[str]] | None = None
) -> list[str] | None:
    """Return the path of a cycle that ``job_id`` waiting for ``after`` would close, or None.

    A cycle is only possible through jobs that wait already (a running or finished
    job waits for nothing): walk their recorded waits from ``after``. ``pending``: the
    waits of orders claimed in the same batch, not recorded yet, which count as waiting.
    """
    pending = pending or {}
    seen: set[str] = set()
    frontier = [(a, [job_id, a]) for a in after]
    while frontier:
        ids = [a for a, _ in frontier if a not in seen]
        paths = {a: p for a, p in frontier}
        seen.update(ids)
        frontier = []
        unrecorded = [a for a in ids if a not in pending]
        recorded = ledger.waits(unrecorded) if unrecorded else []
        waits = [(w.job_id, w.after) for w in recorded if _waits(ledger, w.job_id)]
        for waiting, nexts in [*waits, *[(a, pending[a]) for a in ids if a in pending]]:
            for nxt in nexts:
                if nxt == job_id:
                    return [*paths[waiting], nxt]
                if nxt not in seen:
                    frontier.append((nxt, [*paths[waiting], nxt]))
    return None


def _waits(ledger: Ledger, job_id: str) -> bool:
    """Return True if job_id still waits (or is claimed to wait): only such a job can be part of a cycle."""
    entry = ledger.get(job_id)
    return entry is not None and entry.state in (Row.WAITING, Row.CLAIMED)
