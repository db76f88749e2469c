"""Bulk steps of the PostgreSQL ledger: load rows as they are (rebuild, migrate, benchmarks).

Each is one transaction, however many rows (statement timeout lifted for it).
Re-running ``INSERT ... ON CONFLICT DO NOTHING`` after an unknown commit would
count 0 new rows, so their read-back asks the server about the transaction
itself (``txid_status`` of the id taken at its start) instead of guessing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from dispatcher.ledger.base import Entry, Request
from dispatcher.ledger.pg_conn import Again, Cur, Found, PostgresLedgerError, Resolve, Runner

T = TypeVar("T")

COLUMNS = "job_id, state, agent, owner, token, source, digest, parent, hops, cost_usd, chain_cost_usd, updated"
_CHUNK = 5000
_INSERT = (
    "INSERT INTO jobs (job_id, state, agent, owner, token, source, digest, parent, hops, cost_usd, chain_cost_usd,"
    " updated) SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::bigint[], %s::text[],"
    " %s::text[], %s::text[], %s::int[], %s::float8[], %s::float8[], %s::float8[])"
    " ON CONFLICT (job_id) DO NOTHING"
)
_COPY = (
    "COPY jobs (job_id, state, agent, owner, token, source, digest, parent, hops, cost_usd, chain_cost_usd, updated)"
    " FROM STDIN"
)


def values(e: Entry) -> tuple[object, ...]:
    """Return an entry's fields in COLUMNS order."""
    return (e.job_id, e.state, e.agent, e.owner, e.token, e.source, e.digest, e.parent, e.hops, e.cost_usd,
            e.chain_cost_usd, e.updated)  # fmt: skip


def _begin(cur: Cur, xid: list[int]) -> None:
    xid.clear()
    row = cur.execute("SELECT txid_current()").fetchone()
    if row is not None:
        xid.append(int(row[0]))
    cur.execute("SET LOCAL statement_timeout = 0")


def _committed(xid: list[int], result: list[T]) -> Resolve[T]:
    """A read-back: ask the server whether the step's own transaction committed."""

    def resolve(cur: Cur) -> Found[T] | None:
        if not xid or not result:
            return None
        row = cur.execute("SELECT txid_status(%s)", (xid[0],)).fetchone()
        status = row[0] if row else None
        if status == "in progress":
            raise Again  # the server has not yet seen the session go: ask again
        return Found(result[0]) if status == "committed" else None

    return resolve


def load_rows(runner: Runner, entries: Iterable[Entry]) -> int:
    """Insert rows as they are, keeping rows the ledger already has; return how many were new."""
    batch = [values(e) for e in entries]
    xid: list[int] = []
    result: list[int] = []

    def body(cur: Cur) -> int:
        result.clear()
        _begin(cur, xid)
        total = 0
        for start in range(0, len(batch), _CHUNK):
            chunk = batch[start : start + _CHUNK]
            cur.execute(_INSERT, [list(col) for col in zip(*chunk, strict=True)])
            total += max(cur.rowcount, 0)
        result.append(total)
        return total

    return runner.run("load_rows", body, _committed(xid, result))


def load_into_empty(runner: Runner, entries: Iterable[Entry], requests: Iterable[tuple[str, Request]] = ()) -> int:
    """Copy rows and open requests into a ledger that holds no job id; return how many rows.

    Raise PostgresLedgerError (one line) if it holds any. The tables are locked
    against writers for the copy, so no claim slips in between the check and it.
    """
    batch = [values(e) for e in entries]
    reqs = [(job_id, str(kind)) for job_id, kind in requests]
    xid: list[int] = []
    result: list[int] = []

    def body(cur: Cur) -> int:
        result.clear()
        _begin(cur, xid)
        cur.execute("SET LOCAL lock_timeout = '30s'")
        cur.execute("LOCK TABLE jobs, requests IN SHARE ROW EXCLUSIVE MODE")
        held = cur.execute("SELECT count(*) FROM jobs").fetchone()
        if held and held[0]:
            raise PostgresLedgerError(
                f"{runner.where}: the target ledger is not empty ({held[0]} job ids); migrate only into an empty one"
            )
        with cur.copy(_COPY) as copy:
            for row in batch:
                copy.write_row(row)
        for i, (job_id, kind) in enumerate(reqs):  # oldest first, as they were
            cur.execute(
                "INSERT INTO requests (job_id, kind, at) VALUES (%s, %s, extract(epoch from now())::float8 + %s)"
                " ON CONFLICT (job_id, kind) DO NOTHING",
                (job_id, kind, i * 1e-6),
            )
        result.append(len(batch))
        return len(batch)

    return runner.run("load_into_empty", body, _committed(xid, result))
