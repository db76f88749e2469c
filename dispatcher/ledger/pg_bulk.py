"""Bulk steps of the PostgreSQL ledger: load rows as they are (rebuild, migrate, benchmarks).

``load_into_empty`` (`ledger migrate`) copies the rows and every ``Extras`` table
(requests, join waits, gates, gate waits) in the same transaction.

Each is one transaction, however many rows (statement timeout lifted for it).
An unknown commit is settled by the server's record of the transaction
(``pg_runner.Runner``), so a copy that did commit is not run again (it would count
0 new rows, or find the target no longer empty).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dispatcher.ledger.pg_conn import Cur, TargetNotEmpty
from dispatcher.ledger.pg_runner import Runner
from dispatcher.ledger.pg_settle import Found
from dispatcher.ledger.records import Entry, Extras, Gate, GateWait, Request, fold_waits

COLUMNS = "job_id, state, agent, owner, token, source, digest, parent, hops, cost_usd, chain_cost_usd, updated"
# every SELECT of whole rows: the Entry fields in order (fixed text, never user input)
SELECT = (
    "SELECT job_id, state, agent, owner, token, source, digest, parent, hops, cost_usd, chain_cost_usd, updated"
    " FROM jobs"
)
PAGE = 5000  # rows per page of ``PostgresLedger.rows``
_CHUNK = 5000
_INSERT = (
    "INSERT INTO jobs (job_id, state, agent, owner, token, source, digest, parent, hops, cost_usd, chain_cost_usd,"
    " updated, spent) SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::bigint[],"
    " %s::text[], %s::text[], %s::text[], %s::int[], %s::float8[], %s::float8[], %s::float8[], %s::float8[])"
    " ON CONFLICT (job_id) DO NOTHING"
)
_COPY = (
    "COPY jobs (job_id, state, agent, owner, token, source, digest, parent, hops, cost_usd, chain_cost_usd, updated,"
    " spent) FROM STDIN"
)


def values(e: Entry) -> tuple[object, ...]:
    """Return an entry's fields in COLUMNS order, then its ``spent`` (the bulk steps write it)."""
    return (e.job_id, e.state, e.agent, e.owner, e.token, e.source, e.digest, e.parent, e.hops, e.cost_usd,
            e.chain_cost_usd, e.updated, e.spent)  # fmt: skip


def _begin(cur: Cur) -> None:
    cur.execute("SET LOCAL statement_timeout = 0")


def load_rows(runner: Runner, entries: Iterable[Entry]) -> int:
    """Insert rows as they are, keeping rows the ledger already has; return how many were new."""
    batch = [values(e) for e in entries]

    def body(cur: Cur) -> int:
        _begin(cur)
        total = 0
        for start in range(0, len(batch), _CHUNK):
            chunk = batch[start : start + _CHUNK]
            cur.execute(_INSERT, [list(col) for col in zip(*chunk, strict=True)])
            total += max(cur.rowcount, 0)
        return total

    return runner.run("load_rows", body, write=True)


def extras(runner: Runner) -> Extras:
    """Return every open request, join wait, gate and gate wait, read in one transaction."""

    def body(cur: Cur) -> Extras:
        requests = cur.execute("SELECT job_id, kind, at FROM requests ORDER BY at, job_id").fetchall()
        # the waits of joins still in waiting/: a join that went on keeps its rows, but waits no more
        waits = cur.execute(
            "SELECT w.job_id, w.parent, w.rule, w.since FROM waits w JOIN jobs j ON j.job_id = w.job_id"
            " WHERE j.state = 'waiting' ORDER BY w.since, w.job_id, w.parent"
        ).fetchall()
        gates = cur.execute("SELECT agent, kind, until, reason FROM gates ORDER BY agent, kind").fetchall()
        held = cur.execute("SELECT job_id, agent, until, since FROM gate_waits ORDER BY since, job_id").fetchall()
        return Extras(
            requests=tuple((str(j), Request(k), float(at)) for j, k, at in requests),
            waits=tuple(fold_waits(waits)),
            gates=tuple(Gate(*g) for g in gates),
            gate_waits=tuple(GateWait(*w) for w in held),
        )

    return runner.run("extras", body)


def load_into_empty(runner: Runner, entries: Iterable[Entry], more: Extras | None = None) -> int:
    """Copy rows, then requests, join waits, gates and gate waits into a ledger that holds no job id.

    Return how many rows. Raise TargetNotEmpty (one line; the command exits 1) if it holds any.
    The tables are locked against writers for the copy, so no claim slips in
    between the check and it. A gate the target already has (set there by hand
    before the copy) is kept as it is.
    """
    batch = [values(e) for e in entries]
    more = more or Extras()
    waits = [(w.job_id, parent, w.rule, w.since) for w in more.waits for parent in w.after]

    def body(cur: Cur) -> int:
        _begin(cur)
        cur.execute("SET LOCAL lock_timeout = '2s'")  # a command: a table held locked is a ledger that does not answer
        cur.execute("LOCK TABLE jobs, requests, waits, gates, gate_waits IN SHARE ROW EXCLUSIVE MODE")
        held = cur.execute("SELECT count(*) FROM jobs").fetchone()
        if held and held[0]:
            raise TargetNotEmpty(
                f"{runner.where}: the target ledger is not empty ({held[0]} job ids); migrate only into an empty one"
            )
        with cur.copy(_COPY) as copy:
            for row in batch:
                copy.write_row(row)
        cur.executemany(
            "INSERT INTO requests (job_id, kind, at) VALUES (%s, %s, %s) ON CONFLICT (job_id, kind) DO NOTHING",
            [(job_id, str(kind), at) for job_id, kind, at in more.requests],
        )
        cur.executemany(
            "INSERT INTO waits (job_id, parent, rule, since) VALUES (%s, %s, %s, %s)"
            " ON CONFLICT (job_id, parent) DO NOTHING",
            waits,
        )
        cur.executemany(
            "INSERT INTO gates (agent, kind, until, reason, updated)"
            " VALUES (%s, %s, %s, %s, extract(epoch from now())::float8) ON CONFLICT (agent, kind) DO NOTHING",
            [(g.agent, g.kind, g.until, g.reason) for g in more.gates],
        )
        cur.executemany(
            "INSERT INTO gate_waits (job_id, agent, until, since) VALUES (%s, %s, %s, %s)"
            " ON CONFLICT (job_id) DO NOTHING",
            [(w.job_id, w.agent, w.until, w.since) for w in more.gate_waits],
        )
        return len(batch)

    def resolve(cur: Cur) -> Found[int] | None:  # only if the server forgot the transaction
        row = cur.execute("SELECT count(*) FROM jobs").fetchone()
        return Found(len(batch)) if row and row[0] == len(batch) and batch else None

    return runner.run("load_into_empty", body, resolve)


def entry(row: tuple[object, ...]) -> Entry:
    """Return a row of ``SELECT`` as an Entry."""
    return Entry(*row)  # type: ignore[arg-type]


def page(after: str | None, cur: Cur) -> list[tuple[Any, ...]]:
    """One page of rows in id order, after the id ``after`` (None: from the start); an index range scan."""
    if after is None:
        return cur.execute(SELECT + " ORDER BY job_id LIMIT %s", (PAGE,)).fetchall()
    return cur.execute(SELECT + " WHERE job_id > %s ORDER BY job_id LIMIT %s", (after, PAGE)).fetchall()
