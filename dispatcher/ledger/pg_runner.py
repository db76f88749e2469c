"""Run each PostgreSQL ledger step as one short transaction, waiting out what a retry can fix.

Every ledger step is one short transaction run by :meth:`Runner.run` on a
connection of ``pg_conn.Pool``. A lost connection, a server restart, a lock or
statement timeout, a serialisation failure or a deadlock is a wait, never a
failure: the step is run again on a fresh connection with backoff (``ledger.reconnecting`` is logged) until it
succeeds, ``patience_s`` runs out or ``give_up()`` says so (then
``LedgerUnavailable``).

An error while COMMIT is on its way leaves the outcome unknown; ``pg_settle``
settles it by the server's own record before anything runs again.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable
from typing import Final, TypeVar, cast

import psycopg
import structlog

from dispatcher.ledger.pg_conn import Conn, Cur, Pool, PostgresLedgerError, TooLate, transient
from dispatcher.ledger.pg_settle import CHECKPOINT_MARKER, START_MARKER, Again, Resolve, Unknown, settle
from dispatcher.ledger.records import LedgerUnavailable

log = structlog.get_logger("dispatcher")
T = TypeVar("T")

_LOG_EVERY_S = 5.0
_MAX_DELAY_S = 2.0


class Rollback(Exception):
    """Raised inside a step to roll its transaction back and return ``value`` (nothing was done)."""

    def __init__(self, value: object) -> None:
        super().__init__("rollback")
        self.value = value


Body = Callable[[Cur], T]


class _Default(enum.Enum):
    PATIENCE = 0


DEFAULT: Final = _Default.PATIENCE


class Runner:
    """Run ledger steps as short transactions, retrying what a retry can fix."""

    def __init__(self, pool: Pool, where: str, give_up: Callable[[], bool], patience_s: float | None) -> None:
        self.pool = pool
        self.where = where
        self.give_up = give_up
        #: how long a step waits for the database by default (None: forever)
        self.patience_s = patience_s
        #: test hook, called with the connection just before COMMIT is sent
        self.before_commit: Callable[[Conn], None] | None = None
        #: SQL for a value that changes when the server crashed (see the module docstring)
        self.crash_marker: str = START_MARKER

    def choose_crash_marker(self) -> None:
        """Use the checkpoint position as the crash marker when this role may read it."""
        try:
            self.run("crash_marker", lambda cur: cur.execute(f"SELECT {CHECKPOINT_MARKER}").fetchone())
        except psycopg.Error:  # not granted here: the server's start time misses only in-place recovery
            return
        self.crash_marker = CHECKPOINT_MARKER

    def run(
        self,
        what: str,
        body: Body[T],
        resolve: Resolve[T] | None = None,
        *,
        write: bool = False,
        patience_s: float | _Default | None = DEFAULT,
        fatal: Callable[[BaseException], bool] | None = None,
    ) -> T:
        """Run ``body`` in one transaction and commit; see the module docstring for retries.

        ``write`` (implied by ``resolve``) makes an unknown commit be settled before
        anything runs again. ``fatal`` picks errors to raise at once as
        PostgresLedgerError (a bad login at open).
        """
        patience = self.patience_s if patience_s is DEFAULT else patience_s
        write = write or resolve is not None
        started = time.monotonic()
        # a daemon says at once that it waits; a command (bounded patience) answers before it would
        delay, logged, failures, outage = 0.05, (-_LOG_EVERY_S if patience is None else 0.0), 0, False
        unknown: Unknown[T] | None = None  # a commit whose outcome is unknown
        while True:
            try:
                with self.pool.connection() as conn:
                    if unknown is not None:
                        found = settle(conn, what, unknown, resolve, self.crash_marker)
                        unknown = None
                        if found is not None:
                            self._recovered(what, outage, failures, started)
                            return found.value
                    noted, value = self._once(conn, body, write)
                    unknown = Unknown(*noted, value) if noted is not None else None  # until COMMIT answers
                    if self.before_commit is not None:
                        self.before_commit(conn)
                    conn.commit()
                    self._recovered(what, outage, failures, started)
                    return value
            except Rollback as rb:
                return cast(T, rb.value)
            except Exception as exc:
                if fatal is not None and fatal(exc):
                    raise PostgresLedgerError(f"{self.where}: {_text(exc)}") from None
                if isinstance(exc, psycopg.errors.InsufficientPrivilege):  # a role that may read but not write
                    raise PostgresLedgerError(f"{self.where}: the ledger cannot be written: {_text(exc)}") from None
                if not transient(exc):
                    raise
                failures += 1
                waited = time.monotonic() - started
                doubt = " (the last commit's outcome is unknown)" if unknown is not None else ""
                if patience is not None and (waited >= patience or isinstance(exc, TooLate)):
                    raise LedgerUnavailable(
                        f"{self.where}: the ledger cannot be reached ({waited:.0f} s): {_text(exc)}{doubt}"
                    ) from None
                if self.give_up():
                    raise LedgerUnavailable(f"{self.where}: the ledger cannot be reached; gave up{doubt}") from None
                outage = outage or not isinstance(exc, Again)
                if not isinstance(exc, Again) and waited - logged >= _LOG_EVERY_S:
                    log.warning(
                        "ledger.reconnecting", step=what, attempt=failures, waited_s=round(waited, 1), error=_text(exc)
                    )
                    logged = waited
                pause = delay * random.uniform(0.5, 1.0)
                time.sleep(pause if patience is None else max(0.0, min(pause, patience - waited)))
                delay = min(delay * 2, _MAX_DELAY_S)

    def _once(self, conn: Conn, body: Body[T], write: bool) -> tuple[tuple[int, str] | None, T]:
        """Run body in a new transaction; for a write, note the transaction's id and the crash marker first."""
        with conn.cursor() as cur:
            noted = None
            if write:
                row = cur.execute(f"SELECT txid_current(), {self.crash_marker}").fetchone()
                noted = (int(row[0]), str(row[1])) if row else None
            try:
                return noted, body(cur)
            except Rollback:
                conn.rollback()
                raise

    @staticmethod
    def _recovered(what: str, outage: bool, failures: int, started: float) -> None:
        if outage:
            log.info("ledger.reconnected", step=what, attempts=failures, waited_s=round(time.monotonic() - started, 1))


def _text(exc: BaseException) -> str:
    """Return an error as one short line (psycopg messages span lines)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]
