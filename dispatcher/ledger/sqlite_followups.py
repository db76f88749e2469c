"""Follow-ups in the SQLite ledger: reserved with their parent's finish, released into inbox/ later.

A follow-up's id is reserved (row ``reserved``) in the transaction that finishes its
parent, so a duplicate id is refused before any file exists; its digest is recorded
before its file is written, and the release (``released``, or ``held``) is recorded
once the file is in inbox/ (or held/) under a name that replaces nothing.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence

from dispatcher.ledger.base import now
from dispatcher.ledger.records import Child, Entry
from dispatcher.ledger.releasers import holder_gone
from dispatcher.ledger.sqlite_db import SqliteDb, _entry
from dispatcher.lifecycle import Row


class SqliteFollowups(SqliteDb):
    """The ``Ledger`` follow-up methods for SQLite (mixed into ``SqliteLedger``)."""

    def reserve(self, parent: str, token: int, hops: int, children: Sequence[Child]) -> list[str] | None:
        """Reserve follow-ups of parent; return the ids already taken, or None if fenced."""
        stamp = now()

        def body(db: sqlite3.Connection) -> list[str] | None:
            row = db.execute("SELECT token FROM jobs WHERE job_id = ?", (parent,)).fetchone()
            if row is None or row[0] != token:
                return None
            taken, fresh = [], []
            for child in children:
                entry = self._row(db, child.job_id)
                if entry is None:
                    fresh.append(child)
                elif entry.parent != parent or entry.state not in (Row.RESERVED, Row.RELEASED, Row.HELD):
                    taken.append(child.job_id)
            if taken:
                return taken
            db.executemany(
                "INSERT INTO jobs (job_id, state, agent, source, parent, hops, updated)"
                " VALUES (?, 'reserved', ?, ?, ?, ?, ?)",
                [(c.job_id, c.agent, c.source, parent, hops, stamp) for c in fresh],
            )
            return []

        return self._tx(body)

    def pending_releases(self, parent: str | None = None) -> list[Entry]:
        """Return reserved follow-ups whose parent is done; ``owner`` is the parent's owner."""
        cols = (
            "c.job_id, c.state, c.agent, p.owner, c.token, c.source, c.digest, c.parent, c.hops, c.cost_usd,"
            " p.chain_cost_usd, c.updated"
        )
        sql = (
            f"SELECT {cols} FROM jobs c JOIN jobs p ON p.job_id = c.parent"  # noqa: S608 - fixed text only
            " WHERE c.state = 'reserved' AND p.state = 'done'"
        )
        if parent is None:
            rows = self._read(lambda db: db.execute(sql).fetchall())
        else:
            rows = self._read(lambda db: db.execute(sql + " AND c.parent = ? ORDER BY c.job_id", (parent,)).fetchall())
        return [_entry(r) for r in rows]

    def set_digest(self, job_id: str, digest: str) -> None:
        """Record the digest a reserved follow-up will be released with (before its file exists)."""
        self._tx(
            lambda db: db.execute(
                "UPDATE jobs SET digest = ? WHERE job_id = ? AND state = 'reserved'", (digest, job_id)
            )
        )

    def take_release(self, job_id: str, digest: str, releaser: str) -> bool:
        """Take the turn to release a reserved follow-up (see ``Ledger.take_release``)."""

        def body(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT owner, updated FROM jobs WHERE job_id = ? AND state = 'reserved'", (job_id,))
            found = row.fetchone()
            if found is None:
                return False
            holder, since = found
            alive = self._liveness.alive
            if holder not in (None, releaser) and not holder_gone(holder, alive, since, time.time()):
                return False
            db.execute(
                "UPDATE jobs SET digest = ?, owner = ?, updated = ? WHERE job_id = ? AND state = 'reserved'",
                (digest, releaser, now(), job_id),
            )
            return True

        return self._tx(body)

    def mark_released(self, job_id: str, source: str, digest: str, *, held: bool = False) -> bool:
        """Record that a reserved follow-up's file is in inbox/ (or held/) under source."""
        state = Row.HELD if held else Row.RELEASED

        def body(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "UPDATE jobs SET state = ?, source = ?, digest = ?, updated = ?"
                " WHERE job_id = ? AND state = 'reserved'",
                (str(state), source, digest, now(), job_id),
            )
            return cur.rowcount == 1

        return self._tx(body, durable=False)
