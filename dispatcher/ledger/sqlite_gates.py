"""The SQLite ledger's gates and waits (contract section 14): agents held back, jobs that wait.

A gate row says "no attempt of this agent starts before ``until``" (NULL: until
lifted by hand); one row per agent and kind, so a usage limit, a pause and a
daily cap can hold one agent at once. A wait row says that a claimed job waits
for a gate, so that `status`, `list` and `show` can say ``waiting`` and until when.
The tables came with schema version 4; an older ledger gets them when it is opened.
"""

from __future__ import annotations

import sqlite3

from dispatcher.ledger.base import now
from dispatcher.ledger.records import Gate, GateKind
from dispatcher.ledger.sqlite_db import SqliteDb
from dispatcher.lifecycle import Row


class SqliteGates(SqliteDb):
    """Gates and waits over the ``SqliteDb`` connection."""

    def set_gate(self, gate: Gate, *, at: float) -> bool:
        """Gate an agent (a later ``until`` of the same kind wins, with its reason); return True if none of that
        kind held."""

        def body(db: sqlite3.Connection) -> bool:
            row = db.execute(
                "SELECT until, reason FROM gates WHERE agent = ? AND kind = ?", (gate.agent, gate.kind)
            ).fetchone()
            held = row is not None and (row[0] is None or row[0] > at)
            until, reason = gate.until, gate.reason
            if held and gate.kind != GateKind.BUDGET and until is not None and (row[0] is None or row[0] > until):
                until, reason = row[0], row[1]  # the gate in force lasts longer: its time and text stay
            db.execute(
                "INSERT OR REPLACE INTO gates (agent, kind, until, reason, updated) VALUES (?, ?, ?, ?, ?)",
                (gate.agent, gate.kind, until, reason, now()),
            )
            return not held

        return self._tx(body)

    def lift_gates(
        self, agent: str | None = None, *, kind: str | None = None, expired_at: float | None = None
    ) -> list[Gate]:
        """Remove every gate of ``agent`` (of ``kind``), or those whose time has come at ``expired_at``; return them."""
        args: tuple[object, ...]
        if expired_at is not None:
            where, args = "until IS NOT NULL AND until <= ?", (expired_at,)
        elif kind is not None:
            where, args = "agent = ? AND kind = ?", (agent, kind)
        else:
            where, args = "agent = ?", (agent,)

        def body(db: sqlite3.Connection) -> list[Gate]:
            sql = f"SELECT agent, kind, until, reason FROM gates WHERE {where}"  # noqa: S608 - fixed text only
            rows = db.execute(sql, args).fetchall()
            db.execute(f"DELETE FROM gates WHERE {where}", args)  # noqa: S608 - fixed text only
            return [Gate(*r) for r in rows]

        return self._tx(body)

    def gates(self) -> list[Gate]:
        """Return every gate recorded, by agent."""
        rows = self._read(
            lambda db: db.execute("SELECT agent, kind, until, reason FROM gates ORDER BY agent, kind").fetchall()
        )
        return [Gate(*r) for r in rows]

    def set_gate_wait(self, job_id: str, agent: str, until: float | None) -> None:
        """Record that a claimed job waits for a gate."""
        self._tx(
            lambda db: db.execute(
                "INSERT INTO gate_waits (job_id, agent, until, since) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (job_id) DO UPDATE SET agent = excluded.agent, until = excluded.until",  # since kept
                (job_id, agent, until, now()),
            )
        )

    def clear_gate_wait(self, job_id: str) -> None:
        """Record that a job no longer waits."""
        self._tx(lambda db: db.execute("DELETE FROM gate_waits WHERE job_id = ?", (job_id,)))

    def gate_waits(self) -> dict[str, float | None]:
        """Return the waiting jobs with the time each waits for."""
        rows = self._read(lambda db: db.execute("SELECT job_id, until FROM gate_waits").fetchall())
        return {r[0]: r[1] for r in rows}

    def note_spend(self, job_id: str, token: int, cost_usd: float) -> None:
        """Record a running job's cost so far, dated now (``updated`` too: the window's index reads it)."""
        at = now()
        self._tx(
            lambda db: db.execute(
                "UPDATE jobs SET cost_usd = ?, spent = ?, updated = max(updated, ?)"
                " WHERE job_id = ? AND token = ? AND state = 'claimed'",
                (cost_usd, at, at, job_id, token),
            )
        )

    def costs_since(self, since: float) -> list[tuple[float, str, float]]:
        """Return (finished, agent, cost_usd) of the jobs that finished since ``since``, oldest first.

        A job run again (``retry``, ``revise``) is claimed again with the cost of its
        earlier attempts: that spend stays counted, from the moment it was taken back.
        """
        states = (str(Row.DONE), str(Row.FAILED), str(Row.REVIEW), str(Row.CLAIMED))
        rows = self._read(
            lambda db: db.execute(
                # spent <= updated: the index on updated narrows the rows, spent (when set) dates the cost
                "SELECT coalesce(spent, updated) AS at, coalesce(agent, '-'), cost_usd FROM jobs"
                " WHERE state IN (?, ?, ?, ?) AND updated >= ? AND cost_usd IS NOT NULL"
                " AND coalesce(spent, updated) >= ? ORDER BY at",
                (*states, since, since),
            ).fetchall()
        )
        return [(float(r[0]), str(r[1]), float(r[2])) for r in rows]
