"""Settling a PostgreSQL ledger step whose COMMIT got no answer.

An error while COMMIT is on its way leaves the outcome unknown (PITFALLS: the
server may have committed and lost only its answer). Every write step therefore
notes its transaction id (``txid_current()``) before COMMIT, and on the next
connection the step is settled by the server's own record, never by a guess
(``ledger.commit_unknown`` is logged with the verdict):

- still in progress, or committed but not yet visible to a new snapshot (its
  backend has not yet noticed that its client went away): wait and ask again;
- committed and visible: the step's answer is the one its body computed; the
  step's read-back (the rows it meant to write: this daemon's owner with the
  fencing token or nonce it planned) is checked against it;
- aborted, or never reached the WAL (a crash): the step runs again;
- forgotten by the server (far too old; not seen in practice): the read-back
  alone decides, and a step without one is idempotent and runs again.

A server crash voids the record: an id whose transaction never reached the disk
is handed out again after crash recovery (also the in-place recovery after one
backend died), so "committed" may be another transaction's verdict. The step
therefore notes a crash marker with its id (the last checkpoint's position: crash
recovery always ends with a checkpoint; the server's start time where that
function is not granted). When the marker moved, the read-back alone decides, and
a step without one runs again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Generic, NamedTuple, TypeVar

import psycopg
import structlog
from psycopg.rows import TupleRow

log = structlog.get_logger("dispatcher")
T = TypeVar("T")
Conn = psycopg.Connection[TupleRow]
Cur = psycopg.Cursor[TupleRow]

# what moves when the server crashed (crash recovery ends with a checkpoint), and what it falls back to
CHECKPOINT_MARKER: Final = "(SELECT checkpoint_lsn::text FROM pg_control_checkpoint())"
START_MARKER: Final = "pg_postmaster_start_time()::text"


class Again(Exception):
    """Raised inside a step to run it again from the start (a row vanished between two statements)."""


@dataclass(frozen=True, slots=True)
class Found(Generic[T]):
    """A read-back's verdict: the step's transaction committed, and this is its answer."""

    value: T


Resolve = Callable[[Cur], "Found[T] | None"]


class Unknown(NamedTuple, Generic[T]):
    """A write step whose COMMIT got no answer: what it noted before, and the answer it computed."""

    xid: int
    marker: str
    value: T


def settle(conn: Conn, what: str, unknown: Unknown[T], resolve: Resolve[T] | None, marker_sql: str) -> Found[T] | None:
    """Did the noted transaction commit? Found(its answer) if so, None if not; raise Again while undecided."""
    xid = unknown.xid
    with conn.cursor() as cur:
        row = cur.execute(f"SELECT {marker_sql}").fetchone()
        crashed = row is None or str(row[0]) != unknown.marker  # its id may have been handed out again
        try:
            row = cur.execute(
                "SELECT txid_status(%s), txid_visible_in_snapshot(%s, txid_current_snapshot())", (xid, xid)
            ).fetchone()
            status, visible = (row[0], bool(row[1])) if row else (None, False)
        except psycopg.errors.InvalidParameterValue:  # "in the future": it never reached the WAL
            conn.rollback()
            status, visible = "aborted", False
        if status == "in progress" or (status == "committed" and not visible):
            raise Again  # its backend (or, after a crash, the one given its id) has not finished yet
        rows = resolve(cur) if resolve is not None else None
    conn.rollback()  # settling writes nothing
    seen = "not read" if resolve is None else "written" if rows is not None else "absent"
    if crashed or status not in ("committed", "aborted"):
        # after a crash the id proves nothing; when forgotten, neither: the rows decide
        # (a step without a read-back is idempotent and runs again)
        found = rows
    elif status == "committed":
        if seen == "absent":
            log.warning("ledger.readback_differs", step=what, detail="committed, but its rows changed since")
        found = Found(unknown.value)
    else:
        found = None
    log.warning(
        "ledger.commit_unknown", step=what, committed=found is not None, status=status or "forgotten", rows=seen,
        crashed=crashed,
    )  # fmt: skip
    return found
