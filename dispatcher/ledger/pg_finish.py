"""Finishing steps of the PostgreSQL ledger: finish, follow-up reservations and releases.

Each is one short transaction, conditional on the claim's fencing token (or, for
a follow-up's release, on its row still being reserved) and on this daemon not
having been declared lost: a daemon that comes back after another took its job
over changes nothing. ``finish`` and ``reserve`` are idempotent (run again after
an unknown commit, they give the same answer); ``mark_released`` and
``set_state`` read their row back instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from dispatcher.ledger.pg_conn import Cur, Fence
from dispatcher.ledger.pg_runner import Rollback, Runner
from dispatcher.ledger.pg_settle import Found
from dispatcher.ledger.records import Child, Entry, Finish
from dispatcher.lifecycle import Row

_FINISH = (
    "UPDATE jobs SET state = %s, cost_usd = %s, chain_cost_usd = %s, updated = extract(epoch from now())::float8,"
    # a person's decision on a job in review spends nothing: its cost stays counted from when it finished its work
    " spent = CASE WHEN state = 'review' AND cost_usd IS NOT DISTINCT FROM %s THEN coalesce(spent, updated) END,"
    " owner = CASE WHEN state = 'review' THEN NULL ELSE owner END"  # a person decided: any daemon may release
    " WHERE job_id = %s AND token = %s AND state IN ('claimed', 'review', %s) RETURNING 1"
)
_RESERVE = (
    "INSERT INTO jobs (job_id, state, agent, source, parent, hops, updated)"
    " SELECT u.job_id, 'reserved', u.agent, u.source, %s, %s, extract(epoch from now())::float8"
    " FROM unnest(%s::text[], %s::text[], %s::text[]) AS u(job_id, agent, source)"
    " ORDER BY u.job_id ON CONFLICT (job_id) DO NOTHING RETURNING job_id"
)
_PENDING = (
    "SELECT c.job_id, c.state, c.agent, p.owner, c.token, c.source, c.digest, c.parent, c.hops, c.cost_usd,"
    " p.chain_cost_usd, c.updated FROM jobs c JOIN jobs p ON p.job_id = c.parent"
    " WHERE c.state = 'reserved' AND p.state = 'done' AND (%s::text IS NULL OR c.parent = %s)"
    " ORDER BY c.job_id"
)


class Followups:
    """The steps that end a claim and hand its follow-ups on."""

    def __init__(self, runner: Runner, leases: Fence) -> None:
        self.runner = runner
        self.leases = leases

    def finish(self, items: Sequence[Finish]) -> list[bool]:
        """Record ends in one transaction, each only while its token holds the claim."""

        def body(cur: Cur) -> list[bool]:
            if not self.leases.check(cur, lease=False):
                return [False] * len(items)
            out = []
            for it in items:
                state = str(it.state)
                row = cur.execute(
                    _FINISH, (state, it.cost_usd, it.chain_cost_usd, it.cost_usd, it.job_id, it.token, state)
                ).fetchone()
                if row is not None:  # a cancel asked for a job that has now ended is spent
                    cur.execute("DELETE FROM requests WHERE job_id = %s AND kind = 'cancel'", (it.job_id,))
                if row is not None and it.state == Row.FAILED:  # its follow-ups were never released
                    cur.execute("DELETE FROM jobs WHERE parent = %s AND state = 'reserved'", (it.job_id,))
                out.append(row is not None)
            return out

        return self.runner.run("finish", body, write=True)

    def reserve(self, parent: str, token: int, hops: int, children: Sequence[Child]) -> list[str] | None:
        """Reserve follow-ups of parent; return the ids already taken ([] = all reserved), None if fenced."""

        def body(cur: Cur) -> list[str] | None:
            if not self.leases.check(cur, lease=False):
                return None
            # FOR SHARE: an adopt of the parent waits until this reservation is in or out
            row = cur.execute("SELECT token FROM jobs WHERE job_id = %s FOR SHARE", (parent,)).fetchone()
            if row is None or row[0] != token:
                return None
            ids = [c.job_id for c in children]
            seen = {
                r[0]: (r[1], r[2])
                for r in cur.execute("SELECT job_id, parent, state FROM jobs WHERE job_id = ANY(%s)", (ids,))
            }
            taken, fresh = [], []
            for child in children:
                found = seen.get(child.job_id)
                if found is None:
                    fresh.append(child)
                elif found[0] != parent or found[1] not in (Row.RESERVED, Row.RELEASED, Row.HELD):
                    taken.append(child.job_id)
            if taken:
                return taken
            if fresh:
                cols = ([c.job_id for c in fresh], [c.agent for c in fresh], [c.source for c in fresh])
                inserted = {r[0] for r in cur.execute(_RESERVE, (parent, hops, *cols))}
                late = [c.job_id for c in fresh if c.job_id not in inserted]
                if late:  # claimed by someone else between the two statements: reserve nothing
                    raise Rollback(late)
            return []

        return self.runner.run("reserve", body, write=True)

    def pending_releases(self, parent: str | None = None) -> list[Entry]:
        """Return reserved follow-ups whose parent is done; ``owner`` is the parent's owner."""
        rows = self.runner.run("pending_releases", lambda cur: cur.execute(_PENDING, (parent, parent)).fetchall())
        return [Entry(*r) for r in rows]

    def set_digest(self, job_id: str, digest: str) -> None:
        """Record the digest a reserved follow-up will be released with (before its file exists)."""

        def body(cur: Cur) -> None:
            if self.leases.check(cur, lease=False):
                cur.execute("UPDATE jobs SET digest = %s WHERE job_id = %s AND state = 'reserved'", (digest, job_id))

        self.runner.run("set_digest", body, write=True)

    def release_holder(self, job_id: str) -> tuple[str | None, float] | None:
        """Return who holds a reserved follow-up's release turn and since when, or None if it is not reserved."""
        sql = "SELECT owner, updated FROM jobs WHERE job_id = %s AND state = 'reserved'"
        row = self.runner.run("release_holder", lambda cur: cur.execute(sql, (job_id,)).fetchone())
        return None if row is None else (row[0], float(row[1]))

    def take_release(self, job_id: str, digest: str, releaser: str, holder: str | None) -> bool:
        """Take a reserved follow-up's release turn from ``holder`` (or keep our own: a retried commit)."""

        def body(cur: Cur) -> bool:
            if not self.leases.check(cur, lease=False):
                return False
            row = cur.execute(
                "UPDATE jobs SET digest = %s, owner = %s, updated = extract(epoch from now())::float8"
                " WHERE job_id = %s AND state = 'reserved' AND (owner IS NOT DISTINCT FROM %s OR owner = %s)"
                " RETURNING 1",
                (digest, releaser, job_id, holder, releaser),
            ).fetchone()
            return row is not None

        return self.runner.run("take_release", body, write=True)

    def mark_released(self, job_id: str, source: str, digest: str, *, held: bool = False) -> bool:
        """Record that a reserved follow-up's file is in inbox/ (or held/) under source."""
        state = str(Row.HELD if held else Row.RELEASED)
        wrote: list[bool] = []

        def body(cur: Cur) -> bool:
            wrote.clear()
            if not self.leases.check(cur, lease=False):
                return False
            row = cur.execute(
                "UPDATE jobs SET state = %s, source = %s, digest = %s, updated = extract(epoch from now())::float8"
                " WHERE job_id = %s AND state = 'reserved' RETURNING 1",
                (state, source, digest, job_id),
            ).fetchone()
            wrote.append(row is not None)
            return row is not None

        def resolve(cur: Cur) -> Found[bool] | None:
            if not any(wrote):
                return Found(False)
            row = cur.execute("SELECT state, source, digest FROM jobs WHERE job_id = %s", (job_id,)).fetchone()
            return Found(True) if row == (state, source, digest) else None

        return self.runner.run("mark_released", body, resolve)

    def set_state(self, job_id: str, state: Row, *, expect: Row) -> bool:
        """Move a row from one open state to another (hold, release of a held follow-up)."""
        wrote: list[bool] = []

        def body(cur: Cur) -> bool:
            wrote.clear()
            row = cur.execute(
                "UPDATE jobs SET state = %s, updated = extract(epoch from now())::float8"
                " WHERE job_id = %s AND state = %s RETURNING 1",
                (str(state), job_id, str(expect)),
            ).fetchone()
            wrote.append(row is not None)
            return row is not None

        def resolve(cur: Cur) -> Found[bool] | None:
            if not any(wrote):
                return Found(False)
            row = cur.execute("SELECT state FROM jobs WHERE job_id = %s", (job_id,)).fetchone()
            return Found(True) if row == (str(state),) else None

        return self.runner.run("set_state", body, resolve)
