"""The PostgreSQL ledger's gates and waits (contract section 14), shared by every host.

Same rows as the SQLite engine's (``sqlite_gates``): a gate per agent and kind
("no attempt of this agent starts before ``until``", NULL: until lifted by
hand) and a wait per job that waits for one. Schema version 2 added the tables
(``pg_schema.GATE_TABLES``); ``pg_schema.ensure`` adds them to a version 1 ledger.
"""

from __future__ import annotations

from typing import Any

from dispatcher.ledger.pg_conn import Cur
from dispatcher.ledger.pg_runner import Runner
from dispatcher.ledger.records import Gate, GateKind
from dispatcher.lifecycle import Row

_NOW = "extract(epoch from now())::float8"


class Gates:
    """Gates and waits over the engine's ``Runner``."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._spent: bool | None = None  # the jobs table has `spent` (a read-only reader may meet an older one)

    def set_gate(self, gate: Gate, *, at: float) -> bool:
        """Gate an agent (a later ``until`` of the same kind wins, with its reason); return True if none of that
        kind held."""

        def body(cur: Cur) -> bool:
            row = cur.execute(
                "SELECT until, reason FROM gates WHERE agent = %s AND kind = %s FOR UPDATE", (gate.agent, gate.kind)
            ).fetchone()
            held = row is not None and (row[0] is None or row[0] > at)
            until, reason = gate.until, gate.reason
            longer = row is not None and until is not None and (row[0] is None or float(row[0]) > until)
            if held and longer and row is not None and gate.kind != GateKind.BUDGET:
                until, reason = row[0], row[1]  # the gate in force lasts longer: its time and text stay
            cur.execute(
                f"INSERT INTO gates (agent, kind, until, reason, updated) VALUES (%s, %s, %s, %s, {_NOW})"  # noqa: S608
                " ON CONFLICT (agent, kind) DO UPDATE SET until = EXCLUDED.until, reason = EXCLUDED.reason,"
                " updated = EXCLUDED.updated",
                (gate.agent, gate.kind, until, reason),
            )
            return not held

        return self.runner.run("set_gate", body, write=True)

    def lift_gates(
        self, agent: str | None = None, *, kind: str | None = None, expired_at: float | None = None
    ) -> list[Gate]:
        """Remove every gate of ``agent`` (of ``kind``), or those whose time has come at ``expired_at``; return them."""
        args: tuple[object, ...]
        if expired_at is not None:
            sql, args = "DELETE FROM gates WHERE until IS NOT NULL AND until <= %s", (expired_at,)
        elif kind is not None:
            sql, args = "DELETE FROM gates WHERE agent = %s AND kind = %s", (agent, kind)
        else:
            sql, args = "DELETE FROM gates WHERE agent = %s", (agent,)

        def body(cur: Cur) -> list[Gate]:
            rows = cur.execute(sql + " RETURNING agent, kind, until, reason", args).fetchall()
            return [Gate(*r) for r in rows]

        return self.runner.run("lift_gates", body, write=True)

    def gates(self) -> list[Gate]:
        """Return every gate recorded, by agent."""
        rows = self.runner.run(
            "gates",
            lambda cur: cur.execute("SELECT agent, kind, until, reason FROM gates ORDER BY agent, kind").fetchall(),
        )
        return [Gate(*r) for r in rows]

    def set_gate_wait(self, job_id: str, agent: str, until: float | None) -> None:
        """Record that a claimed job waits for a gate."""
        self.runner.run(
            "set_gate_wait",
            lambda cur: cur.execute(
                f"INSERT INTO gate_waits (job_id, agent, until, since) VALUES (%s, %s, %s, {_NOW})"  # noqa: S608
                " ON CONFLICT (job_id) DO UPDATE SET agent = EXCLUDED.agent, until = EXCLUDED.until",
                (job_id, agent, until),
            ),
            write=True,
        )

    def clear_gate_wait(self, job_id: str) -> None:
        """Record that a job no longer waits."""
        self.runner.run(
            "clear_gate_wait",
            lambda cur: cur.execute("DELETE FROM gate_waits WHERE job_id = %s", (job_id,)),
            write=True,
        )

    def gate_waits(self) -> dict[str, float | None]:
        """Return the waiting jobs with the time each waits for."""
        rows = self.runner.run("gate_waits", lambda cur: cur.execute("SELECT job_id, until FROM gate_waits").fetchall())
        return {r[0]: r[1] for r in rows}

    def note_spend(self, job_id: str, token: int, cost_usd: float) -> None:
        """Record a running job's cost so far, dated now (``updated`` too: the window's index reads it)."""
        self.runner.run(
            "note_spend",
            lambda cur: cur.execute(
                f"UPDATE jobs SET cost_usd = %s, spent = {_NOW}, updated = greatest(updated, {_NOW})"  # noqa: S608
                " WHERE job_id = %s AND token = %s AND state = 'claimed'",
                (cost_usd, job_id, token),
            ),
            write=True,
        )

    def costs_since(self, since: float) -> list[tuple[float, str, float]]:
        """Return (finished, agent, cost_usd) of the jobs that finished since ``since``, oldest first.

        A job run again (``retry``, ``revise``) is claimed again with the cost of its
        earlier attempts: that spend stays counted, from the moment it was taken back.
        """
        states = [str(Row.DONE), str(Row.FAILED), str(Row.REVIEW), str(Row.CLAIMED)]

        def body(cur: Cur) -> list[tuple[Any, ...]]:
            if not self._spent:  # a reader may not add the column: a ledger no daemon of this version opened
                # (asked again until found: a reader kept open, the web view, sees the column a daemon adds)
                found = cur.execute(
                    "SELECT 1 FROM information_schema.columns WHERE table_name = 'jobs' AND column_name = 'spent'"
                    " AND table_schema = current_schema()"
                ).fetchone()
                self._spent = found is not None
            at = "coalesce(spent, updated)" if self._spent else "updated"
            return cur.execute(
                # spent <= updated: the index on updated narrows the rows, spent (when set) dates the cost
                f"SELECT {at} AS at, coalesce(agent, '-'), cost_usd FROM jobs WHERE state = ANY(%s)"  # noqa: S608
                f" AND updated >= %s AND cost_usd IS NOT NULL AND {at} >= %s ORDER BY at",
                (states, since, since),
            ).fetchall()

        rows = self.runner.run("costs_since", body)
        return [(float(r[0]), str(r[1]), float(r[2])) for r in rows]
