"""Joins of the PostgreSQL ledger (SQLite's rules, ``sqlite_waits.py``), safe across hosts.

``wait`` and ``take_waiting`` are conditional UPDATEs, so of two daemons on two
hosts that find one join ready, exactly one takes it; taking needs this
daemon's lease to run (as a claim does). Each write is read back after an
unknown commit outcome (``pg_conn``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dispatcher.ledger.pg_conn import Cur, Fence
from dispatcher.ledger.pg_runner import Runner
from dispatcher.ledger.pg_settle import Found
from dispatcher.ledger.records import Wait, fold_waits
from dispatcher.lifecycle import Row

_WAITING = (
    "SELECT w.job_id, w.parent, w.rule, w.since FROM waits w JOIN jobs j ON j.job_id = w.job_id"
    " WHERE j.state = 'waiting' ORDER BY w.since, w.job_id"
)


class Waits:
    """wait, waits, waiting_on, take_waiting."""

    def __init__(self, runner: Runner, leases: Fence) -> None:
        self.runner = runner
        self.leases = leases

    def wait(self, job_id: str, token: int, after: Sequence[str], rule: str) -> bool:
        """Turn this daemon's claim into a wait for ``after``; False if the token moved on."""
        owner = self.leases.owner
        wrote: list[bool] = []

        def body(cur: Cur) -> bool:
            wrote.clear()
            if not self.leases.check(cur, lease=False):
                return False
            row = cur.execute(
                "UPDATE jobs SET state = 'waiting', owner = NULL, updated = extract(epoch from now())::float8"
                " WHERE job_id = %s AND state = 'claimed' AND owner = %s AND token = %s RETURNING updated",
                (job_id, owner, token),
            ).fetchone()
            if row is None:
                return False
            cur.execute(
                "INSERT INTO waits (job_id, parent, rule, since) SELECT %s, p, %s, %s FROM unnest(%s::text[]) AS p"
                " ON CONFLICT (job_id, parent) DO NOTHING",
                (job_id, rule, row[0], list(after)),
            )
            wrote.append(True)
            return True

        def resolve(cur: Cur) -> Found[bool] | None:
            if not wrote:
                return Found(False)
            row = cur.execute("SELECT state, token FROM jobs WHERE job_id = %s", (job_id,)).fetchone()
            return Found(True) if row == (Row.WAITING, token) else None

        return self.runner.run("wait", body, resolve)

    def waits(self, job_ids: Iterable[str] | None = None) -> list[Wait]:
        """Return the waits recorded for these ids (None: of every job in state waiting)."""
        if job_ids is None:
            rows = self.runner.run("waits", lambda cur: cur.execute(_WAITING).fetchall())
        else:
            ids = list(job_ids)
            rows = self.runner.run(
                "waits",
                lambda cur: cur.execute(
                    "SELECT job_id, parent, rule, since FROM waits WHERE job_id = ANY(%s) ORDER BY since, job_id",
                    (ids,),
                ).fetchall(),
            )
        return fold_waits(rows)

    def waiting_on(self, parents: Iterable[str], *, any_state: bool = False) -> list[str]:
        """Return the ids of waiting jobs that name any of ``parents`` (``any_state``: whatever their state)."""
        ids = list(parents)
        if not ids:
            return []
        rows = self.runner.run(
            "waiting_on",
            lambda cur: cur.execute(
                "SELECT DISTINCT w.job_id FROM waits w JOIN jobs j ON j.job_id = w.job_id"
                " WHERE w.parent = ANY(%s) AND (%s OR j.state = 'waiting') ORDER BY w.job_id",
                (ids, any_state),
            ).fetchall(),
        )
        return [r[0] for r in rows]

    def take_waiting(self, job_id: str) -> int | None:
        """Turn a waiting job into a claim by this daemon; return the new token, None if another won."""
        plan: list[int] = []

        def body(cur: Cur) -> int | None:
            plan.clear()
            if not self.leases.check(cur, lease=True):
                return None
            row = cur.execute(
                "UPDATE jobs SET state = 'claimed', owner = %s, token = token + 1,"
                " updated = extract(epoch from now())::float8 WHERE job_id = %s AND state = 'waiting'"
                " RETURNING token",
                (self.leases.owner, job_id),
            ).fetchone()
            if row is None:
                return None
            plan.append(int(row[0]))
            return plan[0]

        def resolve(cur: Cur) -> Found[int | None] | None:
            if not plan:
                return Found(None)
            row = cur.execute("SELECT owner, token, state FROM jobs WHERE job_id = %s", (job_id,)).fetchone()
            return Found(plan[0]) if row == (self.leases.owner, plan[0], Row.CLAIMED) else None

        return self.runner.run("take_waiting", body, resolve)
