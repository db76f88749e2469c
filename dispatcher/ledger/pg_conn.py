"""Connections to the PostgreSQL ledger: options below the lease, a small pool, retries.

Every ledger step is one short transaction run by :meth:`Runner.run`. A lost
connection, a server restart, a lock or statement timeout, a serialisation
failure or a deadlock is a wait, never a failure: the step is run again on a
fresh connection with backoff (``ledger.reconnecting`` is logged) until it
succeeds, ``patience_s`` runs out or ``give_up()`` says so (then
``LedgerUnavailable``).

An error while COMMIT is on its way leaves the outcome unknown; ``pg_settle``
settles it by the server's own record before anything runs again.
"""

from __future__ import annotations

import enum
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final, Protocol, TypeVar, cast

import psycopg
import structlog
from psycopg import conninfo as pg_conninfo
from psycopg.rows import TupleRow

from dispatcher.errors import UsageError, oneline
from dispatcher.ledger.pg_settle import CHECKPOINT_MARKER, START_MARKER, Again, Resolve, Unknown, settle
from dispatcher.ledger.records import LedgerUnavailable

log = structlog.get_logger("dispatcher")
T = TypeVar("T")
Conn = psycopg.Connection[TupleRow]
Cur = psycopg.Cursor[TupleRow]

_LOG_EVERY_S = 5.0
_MAX_DELAY_S = 2.0
# connection errors that no retry fixes (checked at open only; later they are waited out)
_PERMANENT = (
    "password authentication failed",
    "authentication failed",
    "no pg_hba.conf entry",
    "does not exist",
    "invalid connection option",
    "invalid uri",
    "invalid sslmode",
    "permission denied",
)


class PostgresLedgerError(UsageError):
    """The PostgreSQL ledger cannot be used (bad URL or login, newer schema, not empty); one line."""

    def __init__(self, message: str) -> None:
        super().__init__(oneline(message))


class Rollback(Exception):
    """Raised inside a step to roll its transaction back and return ``value`` (nothing was done)."""

    def __init__(self, value: object) -> None:
        super().__init__("rollback")
        self.value = value


Body = Callable[[Cur], T]


def describe(url: str) -> str:
    """Return ``postgresql://user:***@host:port/db`` for messages: the password shown as ``***``, never itself."""
    try:
        params = pg_conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://(unreadable URL)"
    host, port, db = params.get("host") or "localhost", params.get("port") or "5432", params.get("dbname") or ""
    user, secret = params.get("user"), ":***" if params.get("password") else ""
    who = f"{user}{secret}@" if user else f"{secret[1:]}@" if secret else ""
    return f"postgresql://{who}{host}:{port}/{db}"


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def connection_options(lease_s: float) -> dict[str, Any]:
    """Return libpq options that keep every wait well below the lease (PITFALLS: PostgreSQL).

    A dead peer is noticed within about lease/2 (keepalives, ``tcp_user_timeout``);
    a stuck statement or lock wait ends within lease/3 and lease/6; a session
    cut off inside a transaction loses its locks after lease/3 on the server.
    """
    third = max(1.0, lease_s / 3)
    return {
        "connect_timeout": max(2, int(lease_s / 6)),  # libpq's minimum is 2
        "keepalives": 1,
        "keepalives_idle": max(1, int(lease_s / 6)),
        "keepalives_interval": max(1, int(lease_s / 12)),
        "keepalives_count": 3,
        "tcp_user_timeout": _ms(third),
        "options": (
            f"-c statement_timeout={_ms(third)} -c lock_timeout={_ms(max(0.5, lease_s / 6))}"
            f" -c idle_in_transaction_session_timeout={_ms(third)}"
        ),
    }


URL_UNREADABLE = (
    "ledger URL cannot be read: write it as postgresql://USER:PASSWORD@HOST/DB, with a space,"
    " @, :, / or % in a part percent-encoded (%20, %40, %3A, %2F, %25)"
)


def read_url(url: str) -> dict[str, Any]:
    """Return the URL's parts as libpq reads them; raise PostgresLedgerError, never quoting them.

    libpq's own message quotes the part it could not read, which may be the password.
    """
    try:
        return dict(pg_conninfo.conninfo_to_dict(url))
    except psycopg.ProgrammingError:
        raise PostgresLedgerError(URL_UNREADABLE) from None


def make_conninfo(url: str, lease_s: float, connect_timeout_s: int | None = None, *, readonly: bool = False) -> str:
    """Return the URL with the lease-bound options added (options already in the URL are kept first).

    ``connect_timeout_s`` (a command that must answer soon) replaces the lease-bound
    connect timeout, also one given in the URL; ``readonly`` makes every transaction
    read-only on the server.
    """
    given = read_url(url)
    opts = connection_options(lease_s)
    for key in ("connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count"):
        if given.get(key) is not None:
            opts.pop(key)
    if given.get("options"):
        opts["options"] = f"{opts['options']} {given['options']}"
    opts.setdefault("application_name", given.get("application_name") or "dispatcher")
    if readonly:  # the server refuses any write: a reader's role needs SELECT only
        opts["options"] = f"{opts['options']} -c default_transaction_read_only=on"
    if connect_timeout_s is not None:
        opts["connect_timeout"] = max(2, connect_timeout_s)  # libpq's minimum is 2
    return pg_conninfo.make_conninfo(url, **opts)


def transient(exc: BaseException) -> bool:
    """Return True for errors a later try may not meet: lost connections, timeouts, conflicts."""
    if isinstance(exc, Again | psycopg.OperationalError | psycopg.InterfaceError):
        return True
    state = getattr(exc, "sqlstate", None) or ""
    return state[:2] in ("08", "40", "53", "57") or state in ("25P03", "55P03")


def permanent(exc: BaseException) -> bool:
    """Return True for a connection error no wait can fix (a bad login or database name)."""
    text = str(exc).lower()
    return isinstance(exc, psycopg.OperationalError) and any(p in text for p in _PERMANENT)


class TooLate(psycopg.OperationalError):
    """A command's connection attempt given up at its deadline: no retry follows."""


def connect_by(conninfo: str, deadline: float) -> Conn:
    """Connect as ``psycopg.connect`` does, but give up at ``deadline`` (monotonic seconds).

    libpq's shortest connect timeout is 2 s, and a command must answer within the contract's
    5 s however long its own start took on a busy machine. The attempt runs in a thread; one
    given up is closed by that thread if it ever connects.
    """
    lock = threading.Lock()
    box: list[Conn | BaseException] = []
    abandoned = False

    def attempt() -> None:
        try:
            got: Conn | BaseException = psycopg.connect(conninfo, autocommit=False)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            got = exc
        with lock:
            if not abandoned:
                box.append(got)
                return
        if not isinstance(got, BaseException):
            got.close()

    thread = threading.Thread(target=attempt, name="connect", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        if not box:
            abandoned = True
            raise TooLate("connection timeout expired")
    got = box[0]
    if isinstance(got, BaseException):
        raise got
    return got


class Pool:
    """A few connections shared by threads: one per step at a time; a broken one is dropped.

    With ``deadline`` (a command's, monotonic seconds), connection attempts give up then, until
    one succeeds: later ones are not hurried.
    """

    def __init__(self, conninfo: str, size: int = 4, deadline: float | None = None) -> None:
        self.conninfo = conninfo
        self.size = size
        self.deadline = deadline
        self._idle: list[Conn] = []
        self._count = 0
        self._closed = False
        self._cond = threading.Condition()

    def _take(self) -> Conn:
        with self._cond:
            while True:
                if self._closed:  # not a wait: nothing will open it again
                    raise LedgerUnavailable("the ledger is closed")
                if self._idle:
                    return self._idle.pop()
                if self._count < self.size:
                    self._count += 1
                    break
                self._cond.wait()
        try:
            if self.deadline is None:
                return psycopg.connect(self.conninfo, autocommit=False)
            conn = connect_by(self.conninfo, self.deadline)
            self.deadline = None
            return conn
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _give(self, conn: Conn, clean: bool) -> None:
        if not clean and not conn.closed and not conn.broken:
            try:
                conn.rollback()
            except psycopg.Error:
                conn.close()
        keep = not conn.closed and not conn.broken
        with self._cond:
            if keep and not self._closed:
                self._idle.append(conn)
            else:
                self._count -= 1
            self._cond.notify()
        if not keep or self._closed:
            conn.close()

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        """Lend a connection for one step; it goes back rolled back if the step failed."""
        conn = self._take()
        clean = False
        try:
            yield conn
            clean = True
        finally:
            self._give(conn, clean)

    def close(self) -> None:
        """Close idle connections now and busy ones when they come back."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            conn.close()


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


class Fence(Protocol):
    """What a step asks of this daemon's lease before it writes (``pg_leases.Leases``)."""

    owner: str

    def check(self, cur: Cur, *, lease: bool) -> bool:
        """Lock this daemon's row; may it act (with ``lease``: is its lease still running)?"""

    def refusal(self) -> Exception:
        """Return the error a claim raises when ``check(lease=True)`` said no."""
