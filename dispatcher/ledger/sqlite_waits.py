"""Joins of the SQLite ledger: a claim turned into a wait, the waits, and the take when they are over.

A waiting job's row is in state ``waiting`` with no owner (no daemon holds it,
so no daemon's death touches it); the ids it waits for are rows of ``waits``,
kept after the job runs (recovery tells a wait never recorded from a job taken
but not yet moved by them). ``take_waiting`` is one conditional UPDATE: of two
daemons that find a join ready at once, exactly one gets it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence

from dispatcher.ledger.base import now
from dispatcher.ledger.records import Wait, fold_waits
from dispatcher.ledger.sqlite_db import SqliteDb
from dispatcher.lifecycle import Row


class SqliteWaits(SqliteDb):
    """The ``Ledger`` join methods for SQLite (mixed into ``SqliteLedger``)."""

    owner: str

    def wait(self, job_id: str, token: int, after: Sequence[str], rule: str) -> bool:
        """Turn this daemon's claim into a wait for ``after``; False if the token moved on."""
        stamp = now()

        def body(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "UPDATE jobs SET state = 'waiting', owner = NULL, updated = ?"
                " WHERE job_id = ? AND state = 'claimed' AND owner = ? AND token = ?",
                (stamp, job_id, self.owner, token),
            )
            if cur.rowcount != 1:
                return False
            db.executemany(
                "INSERT OR IGNORE INTO waits (job_id, parent, rule, since) VALUES (?, ?, ?, ?)",
                [(job_id, parent, rule, stamp) for parent in after],
            )
            return True

        return self._tx(body)

    def waits(self, job_ids: Iterable[str] | None = None) -> list[Wait]:
        """Return the waits recorded for these ids (None: of every job in state waiting)."""
        if job_ids is None:
            sql = (
                "SELECT w.job_id, w.parent, w.rule, w.since FROM waits w JOIN jobs j ON j.job_id = w.job_id"
                " WHERE j.state = 'waiting' ORDER BY w.since, w.job_id"
            )
            rows = self._read(lambda db: db.execute(sql).fetchall())
        else:
            ids = list(job_ids)

            def body(db: sqlite3.Connection) -> list[tuple[str, str, str, float]]:
                out = []
                for job_id in ids:
                    out += db.execute(
                        "SELECT job_id, parent, rule, since FROM waits WHERE job_id = ?", (job_id,)
                    ).fetchall()
                return out

            rows = self._read(body)
        return fold_waits(rows)

    def waiting_on(self, parents: Iterable[str], *, any_state: bool = False) -> list[str]:
        """Return the ids of waiting jobs that name any of ``parents`` (``any_state``: whatever their state)."""
        ids = list(parents)

        def body(db: sqlite3.Connection) -> list[str]:
            found: set[str] = set()
            for parent in ids:
                found.update(
                    r[0]
                    for r in db.execute(
                        "SELECT w.job_id FROM waits w JOIN jobs j ON j.job_id = w.job_id"
                        " WHERE w.parent = ? AND (? OR j.state = 'waiting')",
                        (parent, any_state),
                    )
                )
            return sorted(found)

        return self._read(body) if ids else []

    def take_waiting(self, job_id: str) -> int | None:
        """Turn a waiting job into a claim by this daemon; return the new token, None if another won."""

        def body(db: sqlite3.Connection) -> int | None:
            entry = self._row(db, job_id)
            if entry is None or entry.state != Row.WAITING:
                return None
            db.execute(
                "UPDATE jobs SET state = 'claimed', owner = ?, token = ?, updated = ? WHERE job_id = ?",
                (self.owner, entry.token + 1, now(), job_id),
            )
            return entry.token + 1

        return self._tx(body)
