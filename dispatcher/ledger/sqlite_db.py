"""The SQLite ledger's database handle: schema, migrations, transactions that wait when busy.

Another process holding the write lock, or a full disk, is a wait, never a
failure: every step is retried with backoff for as long as it takes
(``ledger.waiting`` is logged every few seconds), or until ``patience_s`` runs
out (a command) or ``give_up()`` says so (a daemon forced to stop).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar
from urllib.parse import quote

import structlog
from filelock import FileLock

from dispatcher.ledger.flocks import FlockSlots, Liveness
from dispatcher.ledger.records import REBUILD_HINT, Entry, LedgerDamaged, LedgerUnavailable

log = structlog.get_logger("dispatcher")
T = TypeVar("T")
P = ParamSpec("P")

SCHEMA_VERSION = 4  # 3: joins (section 16); 4: gates and gate waits (section 14)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id  TEXT PRIMARY KEY,
    state   TEXT NOT NULL,
    agent   TEXT,
    owner   TEXT,
    source  TEXT,
    digest  TEXT,
    parent  TEXT,
    hops    INTEGER NOT NULL DEFAULT 0,
    updated REAL NOT NULL,
    token   INTEGER NOT NULL DEFAULT 0,
    cost_usd REAL,
    chain_cost_usd REAL,
    spent   REAL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS jobs_parent ON jobs(parent) WHERE parent IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_open ON jobs(state)
    WHERE state IN ('reserved', 'held', 'released', 'claimed', 'review', 'waiting');
CREATE TABLE IF NOT EXISTS requests (
    job_id TEXT NOT NULL,
    kind   TEXT NOT NULL,
    at     REAL NOT NULL,
    PRIMARY KEY (job_id, kind)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS waits (
    job_id TEXT NOT NULL,
    parent TEXT NOT NULL,
    rule   TEXT NOT NULL,
    since  REAL NOT NULL,
    PRIMARY KEY (job_id, parent)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS waits_parent ON waits(parent);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gates (
    agent   TEXT NOT NULL,
    kind    TEXT NOT NULL,
    until   REAL,
    reason  TEXT,
    updated REAL NOT NULL,
    PRIMARY KEY (agent, kind)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gate_waits (
    job_id TEXT PRIMARY KEY,
    agent  TEXT NOT NULL,
    until  REAL,
    since  REAL NOT NULL
) WITHOUT ROWID;
"""
_COLUMNS = "job_id, state, agent, owner, token, source, digest, parent, hops, cost_usd, chain_cost_usd, updated"
# SQLite's own wait for a lock, per try: short, so that a stop's deadline is heard between tries
_BUSY_TIMEOUT_MS = 250
# how long a reader (`status`, `list`, `show`) waits for a ledger another process holds locked before saying so
_READ_GRACE_S = 3.0
_HAS_META = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
_RETRY_MAX_S = 0.25  # the longest pause between tries
_WAIT_LOG_S = 5.0


class LedgerError(Exception):
    """The ledger file cannot be used (not a database, newer schema, unreadable)."""

    def __init__(self, message: str, *, unreachable: bool = False, fresh: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable  # the disk or folder is at fault, not the ledger's contents
        self.fresh = fresh  # a file with no tables yet: a daemon's first start is making it


def _entry(row: tuple[object, ...]) -> Entry:
    return Entry(*row)  # type: ignore[arg-type]


class SqliteDb:
    """The connection to ``<root>/.state/ledger.sqlite3``, shared by threads under one lock."""

    def __init__(
        self,
        path: Path,
        state_dir: Path,
        *,
        patience_s: float | None = None,
        readonly: bool = False,
        give_up: Callable[[], bool] | None = None,
    ) -> None:
        """Open (creating if needed) the ledger; raise LedgerError if it cannot be used.

        ``patience_s`` bounds how long a write waits for a busy ledger (None: forever,
        as a daemon does; a command gives up with a clear error). ``readonly`` opens an
        existing ledger for reading only (``mode=ro``): enough to read the root, no
        write access needed (`status`, `list`, `show`). ``give_up`` ends the open's own waits
        for a ledger another process holds locked (a daemon stopped while it starts).
        """
        self.path = path
        self.patience_s = patience_s
        self._give_up: Callable[[], bool] | None = give_up  # later set by Ledger.set_give_up
        self._lock = threading.Lock()
        self._daemons = state_dir / "daemons"
        self._liveness = Liveness(self._daemons)
        self._slots = FlockSlots(state_dir / "slots")
        self._life: FileLock | None = None
        self._life_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the liveness lock file it holds
        self._immutable = False  # a read-only snapshot taken while no daemon had the ledger open
        self._copied: tuple[object, ...] | None = None  # the file's stamp when an upgraded copy was made of it
        try:
            if readonly:
                self._db, self._immutable = connect_readonly(path)
                if not self._retrying(self._has_tables):
                    self._db.close()
                    raise LedgerError("no ledger yet: a starting daemon is making it", fresh=True)
                if self._retrying(self._check_version) < SCHEMA_VERSION or not self._retrying(self._has_spent):
                    self._upgraded_copy()
                return
            self._db = sqlite3.connect(
                path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
            )
            self._db.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
            self._retrying(lambda: self._db.execute("PRAGMA journal_mode=WAL"))
            self._db.execute("PRAGMA synchronous=FULL")
            self._retrying(self._migrate)
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and _is_locked(exc):  # in use, not damaged: never rebuilt
                raise LedgerError(f"{exc} by another process", unreachable=True) from None
            text = str(exc).lower()
            unreachable = any(w in text for w in ("unable to open", "disk i/o", "readonly", "read-only", "full"))
            raise LedgerError(_describe(exc, path), unreachable=unreachable) from None

    def _migrate(self) -> None:
        # CREATE ... IF NOT EXISTS: safe when daemons start together. One transaction: a reader (`status`
        # while the first daemon starts) sees every table or none, never a ledger without its meta table
        try:
            self._db.executescript(f"BEGIN IMMEDIATE;\n{_SCHEMA}\nCOMMIT;")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        self._write(self._upgrade)

    def _has_tables(self) -> bool:
        """Return True if the ledger's schema is there (False: a file made by a daemon not yet past its start)."""
        return self._db.execute(_HAS_META).fetchone() is not None

    def _upgrade(self, db: sqlite3.Connection) -> None:
        """Bring an older ledger's tables up to this version (inside ``_migrate``'s transaction)."""
        cols = {r[1] for r in db.execute("PRAGMA table_info(jobs)")}
        for name, kind in (
            ("token", "INTEGER NOT NULL DEFAULT 0"),
            ("cost_usd", "REAL"),
            ("chain_cost_usd", "REAL"),
            ("spent", "REAL"),  # when cost_usd was counted, if not updated (a review decided later)
        ):
            if name not in cols:  # a ledger from before fencing tokens and costs
                db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
        # the spend of the last 24 hours (daily caps, `status`, the web view) without a full scan
        db.execute("CREATE INDEX IF NOT EXISTS jobs_spent ON jobs(updated) WHERE cost_usd IS NOT NULL")
        self._check_version(db)
        db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))

    def _check_version(self, db: sqlite3.Connection | None = None) -> int:
        """Return the ledger's schema version; raise LedgerError for one newer than this code knows."""
        db = self._db if db is None else db
        row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        version = int(row[0]) if row else 1
        if version > SCHEMA_VERSION:
            raise LedgerError(
                f"schema version {version} is newer than this dispatcher knows ({SCHEMA_VERSION}); upgrade it"
            )
        return version

    def _has_spent(self, db: sqlite3.Connection | None = None) -> bool:
        """Return True if the jobs table has its ``spent`` column (added without a new version: readers look)."""
        return any(r[1] == "spent" for r in (self._db if db is None else db).execute("PRAGMA table_info(jobs)"))

    def _upgraded_copy(self, source: sqlite3.Connection | None = None) -> None:
        """Read an older ledger (no daemon of this version opened it yet) through an upgraded copy in memory.

        A reader may not write the file (and must not change it under a daemon of the older
        version): `status` and `list` then read what the next daemon's start would make of it.
        The copy is made again from ``source`` (a new connection to the file) once the file changed
        (``_read``): a reader kept open (the web view) follows the daemons' writes.
        """
        stamp = _stamp(self.path)  # before the copy: a write during it makes the next read copy again
        copy = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        with self._lock:
            (self._db if source is None else source).backup(copy)
            self._db.close()
            if source is not None:
                source.close()
            self._db, self._immutable, self._copied = copy, False, stamp
        self._db.executescript(_SCHEMA)
        self._write(self._upgrade)

    def _copy_again(self) -> None:
        """Read the file again under an upgraded copy it outdated: as it is, once a daemon of this version
        upgraded it, else through a new copy."""
        db, immutable = connect_readonly(self.path)
        try:
            current = self._check_version(db) >= SCHEMA_VERSION and self._has_spent(db)
        except BaseException:
            db.close()
            raise
        if not current:
            self._upgraded_copy(db)
            return
        with self._lock:
            self._db.close()
            self._db, self._immutable, self._copied = db, immutable, None

    def close(self) -> None:
        """Close the connection, give slots back and end this daemon's liveness lock."""
        self._slots.release_all()
        with self._lock:
            self._db.close()
        if self._life is not None:
            self._life.release()

    # -- plumbing -----------------------------------------------------------------------
    def _retrying(self, step: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run step(*args); while the database is locked by someone else, wait and run it again."""
        started = time.monotonic()
        delay, logged = 0.05, 0.0
        while True:
            try:
                return step(*args, **kwargs)
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                if self.patience_s is not None and not _is_locked(exc):
                    # a command on a full disk: say so now (a daemon waits, its jobs stay where they are)
                    raise LedgerUnavailable(f"the ledger cannot be written ({exc})") from None
                waited = time.monotonic() - started
                if self.patience_s is not None and waited >= self.patience_s:
                    raise LedgerUnavailable(f"the ledger is locked by another process ({waited:.0f} s)") from None
                if self._give_up is not None and self._give_up():
                    raise LedgerUnavailable("the ledger is locked by another process; gave up at stop") from None
                if waited - logged >= _WAIT_LOG_S:
                    log.warning("ledger.waiting", waited_s=round(waited), error=str(exc))
                    logged = waited
                time.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
            except sqlite3.DatabaseError as exc:
                if getattr(exc, "sqlite_errorcode", 0) & 0xFF in _DAMAGED:
                    raise LedgerDamaged(f"{self.path}: the ledger cannot be read ({exc}); {REBUILD_HINT}") from None
                raise

    def _write(self, body: Callable[[sqlite3.Connection], T], durable: bool = True) -> T:
        """Run body once in a write transaction that holds the database's write lock from its start."""
        with self._lock:
            db = self._db
            if not durable:
                db.execute("PRAGMA synchronous=NORMAL")
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    out = body(db)
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
                return out
            finally:
                if not durable:
                    db.execute("PRAGMA synchronous=FULL")

    def _tx(self, body: Callable[[sqlite3.Connection], T], *, durable: bool = True) -> T:
        """Run body in a write transaction; while the database is busy, wait and run it again."""
        return self._retrying(self._write, body, durable)

    def _read(self, body: Callable[[sqlite3.Connection], T]) -> T:
        def step() -> T:
            if self._copied is not None and _stamp(self.path) != self._copied:
                self._copy_again()
            with self._lock:
                if self._immutable and self.path.with_name(self.path.name + "-wal").exists():
                    self._db.close()  # a daemon writes again: an immutable snapshot would go stale
                    self._db, self._immutable = connect_readonly(self.path)
                return body(self._db)

        return self._retrying(step)

    def _row(self, db: sqlite3.Connection, job_id: str) -> Entry | None:
        row = db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()  # noqa: S608
        return _entry(row) if row else None


def connect_readonly(path: Path) -> tuple[sqlite3.Connection, bool]:
    """Open an existing ledger for reading only, as a user who may not write to its folder.

    While a daemon has it open, the WAL's ``-wal`` and ``-shm`` files exist and are
    readable by its group, and ``mode=ro`` reads through them. After the last daemon
    stopped they are gone and a reader without write access cannot make them: the
    file is then complete on its own and is read as ``immutable`` (the second value
    True), until a daemon opens it again.
    """
    uri = f"file:{quote(str(path.resolve()))}?mode=ro"
    wal = path.with_name(path.name + "-wal")
    me = os.geteuid()
    if me != 0 and not wal.exists() and os.stat(path).st_uid != me:
        # no daemon has it open, and this reader is not its owner: read the complete file as it is, making no
        # -wal/-shm of this user's (in a group-writable .state/ the daemon could not write them, nor start)
        db = sqlite3.connect(f"{uri}&immutable=1", uri=True, isolation_level=None, check_same_thread=False)
        return db, True
    try:
        # a lock held a moment (a daemon switching a new ledger to WAL) is waited out; one held longer (a
        # `sqlite3` shell, a backup) is said within seconds
        db = sqlite3.connect(uri, uri=True, timeout=_READ_GRACE_S, isolation_level=None, check_same_thread=False)
        db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
        return db, False
    except sqlite3.OperationalError as exc:
        text = str(exc).lower()
        if "disk i/o error" in text or "full" in text:  # a full disk: no -shm could be made for the read
            if _wal_size(wal) > 0:
                raise  # rows only the -wal holds: not readable without it
        elif ("unable to open" not in text and "readonly" not in text) or wal.exists():
            raise
    db = sqlite3.connect(f"{uri}&immutable=1", uri=True, isolation_level=None, check_same_thread=False)
    return db, True


def has_tables(path: Path) -> bool:
    """Return True if the SQLite ledger at path has its schema (its tables are made in one commit)."""
    try:
        db, _ = connect_readonly(path)
    except sqlite3.Error:
        return False
    try:
        return db.execute(_HAS_META).fetchone() is not None
    except sqlite3.Error:
        return False
    finally:
        db.close()


def locked_elsewhere(path: Path) -> bool:
    """Return True if another process holds a lock on the SQLite file at path that keeps a writer out."""
    try:
        db = sqlite3.connect(path, timeout=1.0, isolation_level=None)
    except sqlite3.Error:
        return False
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError as exc:
        return _is_locked(exc)
    except sqlite3.Error:
        return False
    finally:
        db.close()


def _stamp(path: Path) -> tuple[object, ...]:
    """Return what changes when the ledger file at path is written: its and its -wal's (mtime, size, inode)."""
    out: list[object] = []
    for name in (path, path.with_name(path.name + "-wal")):
        try:
            st = os.stat(name)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


def _wal_size(wal: Path) -> int:
    """Return the size of a ledger's -wal (0 when there is none: every row is in the main file)."""
    try:
        return os.stat(wal).st_size
    except FileNotFoundError:
        return 0


def _is_locked(exc: sqlite3.OperationalError) -> bool:
    """Return True for "database is locked" and "busy": another connection holds the ledger."""
    text = str(exc).lower()
    return "locked" in text or "busy" in text


_DAMAGED = (11, 26)  # SQLITE_CORRUPT ("database disk image is malformed"), SQLITE_NOTADB ("file is not a database")


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    """Return True for the errors that mean "wait and try again": a lock held elsewhere, a full disk."""
    text = str(exc).lower()
    return any(w in text for w in ("locked", "busy", "disk is full", "disk i/o error"))


# SQLite opens a file by its absolute path, at most this many bytes (SQLITE_MAX_PATHNAME, 512, with its -wal)
_MAX_PATH = 500


_OPENS_UP_TO = 504  # the longest ledger path SQLite opens here, its -journal beside it (measured: 505 fails)


def path_too_long(path: str | os.PathLike[str]) -> str | None:
    """Say why SQLite cannot open a ledger at this path (its absolute path too long), or None."""
    size = len(os.fsencode(os.path.abspath(path)))
    if size > _OPENS_UP_TO:
        return f"its path is {size} bytes, SQLite takes at most about {_MAX_PATH}; use a shorter root"
    return None


def _describe(exc: sqlite3.DatabaseError, path: str | os.PathLike[str] | None = None) -> str:
    text = str(exc)
    if isinstance(exc, sqlite3.OperationalError) and "unable to open" in text:
        size = len(os.fsencode(os.path.abspath(path))) if path is not None else 0
        if size > _MAX_PATH:  # (SQLite said it cannot: the path is the likely cause)
            return f"its path is {size} bytes, SQLite takes at most about {_MAX_PATH}; use a shorter root"
        return f"cannot be opened ({text}; is the folder writable?)"
    return text
