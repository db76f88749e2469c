"""What the SQLite ledger holds beside its rows, read in one go for `ledger migrate`.

``rows()`` gives the job rows; ``extras()`` gives the rest that a PostgreSQL
ledger also keeps: open requests, every join's recorded wait, the gates and the
jobs that wait for one. Liveness and slots are flocks on this host (nothing to
copy), and ``meta`` holds only the schema version.
"""

from __future__ import annotations

import sqlite3

from dispatcher.ledger.records import Extras, Gate, GateWait, Request, fold_waits
from dispatcher.ledger.sqlite_db import SqliteDb


class SqliteBulk(SqliteDb):
    """The ``Ledger.extras`` read for SQLite (mixed into ``SqliteLedger``)."""

    def extras(self) -> Extras:
        """Return every open request, join wait, gate and gate wait."""

        def body(db: sqlite3.Connection) -> Extras:
            requests = db.execute("SELECT job_id, kind, at FROM requests ORDER BY at, job_id").fetchall()
            # the waits of joins still in waiting/: a join that went on keeps its rows, but waits no more
            waits = db.execute(
                "SELECT w.job_id, w.parent, w.rule, w.since FROM waits w JOIN jobs j ON j.job_id = w.job_id"
                " WHERE j.state = 'waiting' ORDER BY w.since, w.job_id, w.parent"
            )
            gates = db.execute("SELECT agent, kind, until, reason FROM gates ORDER BY agent, kind").fetchall()
            held = db.execute("SELECT job_id, agent, until, since FROM gate_waits ORDER BY since, job_id").fetchall()
            return Extras(
                requests=tuple((str(j), Request(k), float(at)) for j, k, at in requests),
                waits=tuple(fold_waits(waits.fetchall())),
                gates=tuple(Gate(*g) for g in gates),
                gate_waits=tuple(GateWait(*w) for w in held),
            )

        return self._read(body)
