"""Jobs finished since this daemon started, counted whether or not a metrics file is kept (contract section 10).

``dispatcher_jobs_finished_total`` counts since the daemon started, also when a reload
sets ``metrics_file`` later: the new metrics start from these counts.
"""

from __future__ import annotations

import collections
import threading


class FinishedCounts:
    """Jobs done or failed and files refused, by (state, agent); thread-safe (the ledger lane and the loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def add(self, state: str, agent: str | None) -> None:
        """Count one finish (agent None: a refused file whose order named none, label "")."""
        with self._lock:
            self._counts[(state, agent or "")] += 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        """Return the counts so far."""
        with self._lock:
            return dict(self._counts)
