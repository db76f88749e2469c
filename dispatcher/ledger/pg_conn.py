"""Connections to the PostgreSQL ledger: options below the lease, a small pool, what a retry fixes.

Every ledger step is one short transaction on a connection of the ``Pool``, run by
``pg_runner.Runner``, which waits out the errors ``transient`` names.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

import psycopg
import structlog
from psycopg import conninfo as pg_conninfo
from psycopg.rows import TupleRow

from dispatcher.errors import UsageError, oneline
from dispatcher.ledger.pg_settle import Again
from dispatcher.ledger.records import LedgerUnavailable

log = structlog.get_logger("dispatcher")
T = TypeVar("T")
Conn = psycopg.Connection[TupleRow]
Cur = psycopg.Cursor[TupleRow]

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


class TargetNotEmpty(PostgresLedgerError):
    """``ledger migrate`` found job ids in the target: it copies only into an empty ledger (the operation fails: 1)."""

    exit_code = 1


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


def connection_options(lease_s: float, lock_s: float | None = None) -> dict[str, Any]:
    """Return libpq options that keep every wait well below the lease (PITFALLS: PostgreSQL).

    A dead peer is noticed within about lease/2 (keepalives, ``tcp_user_timeout``);
    a stuck statement or lock wait ends within lease/3 and lease/6 (``lock_s`` at most,
    for a command that must answer soon); a session cut off inside a transaction loses
    its locks after lease/3 on the server.
    """
    third = max(1.0, lease_s / 3)
    lock = max(0.5, lease_s / 6) if lock_s is None else min(lock_s, max(0.5, lease_s / 6))
    return {
        "connect_timeout": max(2, int(lease_s / 6)),  # libpq's minimum is 2
        "keepalives": 1,
        "keepalives_idle": max(1, int(lease_s / 6)),
        "keepalives_interval": max(1, int(lease_s / 12)),
        "keepalives_count": 3,
        "tcp_user_timeout": _ms(third),
        "options": (
            f"-c statement_timeout={_ms(third)} -c lock_timeout={_ms(lock)}"
            f" -c idle_in_transaction_session_timeout={_ms(third)}"
        ),
    }


URL_UNREADABLE = (
    "ledger URL cannot be read: write it as postgresql://USER:PASSWORD@HOST/DB, with a space,"
    " @, :, / or % in a part percent-encoded (%20, %40, %3A, %2F, %25)"
)


def read_url(url: str) -> dict[str, Any]:
    """Return the URL's parts as libpq reads them; raise PostgresLedgerError, never quoting them.

    libpq's own message quotes the part it could not read, which may be the password. An
    unencoded ``@`` in the user or password is refused too: libpq ends the user part at the
    first one and would try to reach the rest of the password as the host, naming it.
    """
    authority = url.partition("://")[2].split("/", 1)[0].split("?", 1)[0]
    if authority.count("@") > 1:
        raise PostgresLedgerError(URL_UNREADABLE)
    try:
        return dict(pg_conninfo.conninfo_to_dict(url))
    except psycopg.ProgrammingError:
        raise PostgresLedgerError(URL_UNREADABLE) from None


COMMAND_LOCK_S = 1.0  # a command's longest lock wait: with its retries it still answers within 5 s


def make_conninfo(url: str, lease_s: float, connect_timeout_s: int | None = None, *, readonly: bool = False) -> str:
    """Return the URL with the lease-bound options added (options already in the URL are kept first).

    ``connect_timeout_s`` (a command that must answer soon) replaces the lease-bound
    connect timeout, also one given in the URL, and bounds a lock wait by ``COMMAND_LOCK_S``
    (a table another session holds locked is met as a ledger that does not answer);
    ``readonly`` makes every transaction read-only on the server.
    """
    given = read_url(url)
    opts = connection_options(lease_s, None if connect_timeout_s is None else COMMAND_LOCK_S)
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


SILENT_S = 2.0  # a command's step that hears nothing from the server for this long is cut (``Pool``)
SILENCE_POLL_S = 0.25
HURRY_S = 0.5  # after such a cut, how long each new connection may take: a server that answers does at once


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

    def __init__(
        self, conninfo: str, size: int = 4, deadline: float | None = None, silent_s: float | None = None
    ) -> None:
        """``silent_s`` (a command's): a step that hears nothing for this long is cut (``watch_silence``)."""
        self.conninfo = conninfo
        self.size = size
        self.deadline = deadline
        self._idle: list[Conn] = []
        self._count = 0
        self._closed = False
        self._cond = threading.Condition()
        self._busy: dict[int, tuple[Conn, float]] = {}  # lent connections by id(), with when they were lent
        self._hurry = False  # a silent server was cut off: the next connections get HURRY_S each
        if silent_s is not None:
            threading.Thread(target=self.watch_silence, args=(silent_s,), name="silence", daemon=True).start()

    def watch_silence(self, silent_s: float) -> None:
        """Cut every step lent for longer than silent_s, until the pool is closed (a thread of its own).

        For a command, which answers within 5 s (section 12): a server that stopped after the login
        (SIGSTOP, a hung host) still has its kernel answer TCP, so no keepalive or timeout of libpq
        ends a read; the step cut fails as a lost connection, and its caller answers in one line.
        A command's lock waits end at ``COMMAND_LOCK_S``: a step silent for longer is no lock wait.
        """
        while not self._closed:
            time.sleep(SILENCE_POLL_S)
            now = time.monotonic()
            with self._cond:
                stuck = [conn for conn, since in self._busy.values() if now - since >= silent_s]
                if stuck:
                    self._hurry = True
            for conn in stuck:
                cut_socket(conn)

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
            if self.deadline is None and not self._hurry:
                return psycopg.connect(self.conninfo, autocommit=False)
            conn = connect_by(self.conninfo, self.deadline or time.monotonic() + HURRY_S)
            self.deadline = None
            self._hurry = False
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
        with self._cond:
            self._busy[id(conn)] = (conn, time.monotonic())
        clean = False
        try:
            yield conn
            clean = True
        finally:
            with self._cond:
                self._busy.pop(id(conn), None)
            self._give(conn, clean)

    def sever(self, older_than_s: float) -> int:
        """Cut the sockets of connections lent for longer than older_than_s; return how many.

        For a stop while the server is silent (stopped, not gone: its kernel still answers
        TCP, so no keepalive or timeout of ours ends a read): the step blocked in it then
        fails as a lost connection, and its caller's wait gives up at the stop.
        """
        now = time.monotonic()
        idle: list[Conn] = []
        with self._cond:
            stuck = [conn for conn, since in self._busy.values() if now - since >= older_than_s]
            cut = sum(cut_socket(conn) for conn in stuck)
            if cut:
                self.deadline = now  # and a new connection to that silent server is given up at once
                idle, self._idle = self._idle, []  # as the idle ones to it are: a step lent one would hang too
                self._count -= len(idle)
                self._cond.notify_all()
        for conn in idle:
            cut_socket(conn)
            conn.close()
        return cut

    def close(self) -> None:
        """Close idle connections now and busy ones when they come back."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            conn.close()


def cut_socket(conn: Conn) -> bool:
    """Shut a connection's socket down both ways, from any thread (its descriptor stays open); True if cut.

    A read blocked on it returns at once with end of file, and libpq reports a lost
    connection. ``shutdown`` acts on the socket, not the descriptor, so this dup is safe.
    """
    try:
        if conn.closed:
            return False
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except (OSError, psycopg.Error):
        return False
    return True


class Fence(Protocol):
    """What a step asks of this daemon's lease before it writes (``pg_leases.Leases``)."""

    owner: str

    def check(self, cur: Cur, *, lease: bool) -> bool:
        """Lock this daemon's row; may it act (with ``lease``: is its lease still running)?"""

    def refusal(self) -> Exception:
        """Return the error a claim raises when ``check(lease=True)`` said no."""

    def nonce(self) -> str:
        """Return a new value that tells this daemon's write apart (``ended_by``)."""

    def declared_lost(self, owner: str, host: str, pid: int) -> None:
        """Note and log a daemon this one declared lost while adopting its job."""
