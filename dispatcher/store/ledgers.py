"""Open the configured ledger, and refuse one that cannot be trusted over existing job folders.

``open_ledger`` is the one way in: it picks the engine from the config's ``ledger`` setting
and refuses to start a fresh, empty ledger over job folders that already exist (that would
accept their ids again). It lives beside the job folders, not among the engines, because
the refusal needs both.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from dispatcher import fsutil, lean, procs
from dispatcher.errors import UsageError
from dispatcher.layout import Layout, has_jobs
from dispatcher.ledger.base import Ledger, LedgerUnavailable
from dispatcher.ledger.records import REBUILD_HINT
from dispatcher.ledger.sqlite_db import has_tables, path_too_long
from dispatcher.spec.settings import Config

#: how long a command tries to reach a PostgreSQL ledger: one connection attempt (CONNECT_S, libpq's
#: shortest), or quick retries of a refused one for REACH_S, so that it answers within 5 seconds even
#: when the machine is busy and the interpreter's start takes a second or two
CONNECT_S = 2
REACH_S = 1.0
#: a command gives up reaching PostgreSQL this long after its process started (the contract: an answer
#: within 5 s), however long the interpreter's start took; at least MIN_REACH_S is left to the attempt
ANSWER_S = 3.5
MIN_REACH_S = 0.25
#: how long a command waits for a ledger another process is writing
PATIENCE_S = 30.0


class LedgerLost(UsageError):
    """The ledger is missing or unreadable while job folders exist: nothing may start on it."""


class NoLedgerYet(LedgerLost):
    """A shared ledger no daemon has made yet, opened by a reader over a root without jobs."""


class LedgerUnreachable(UsageError):
    """The ledger cannot be opened right now (a full disk, a read-only folder)."""


def answer_by() -> float:
    """Return when (monotonic seconds) a command stops trying to reach its PostgreSQL ledger."""
    return time.monotonic() + max(MIN_REACH_S, ANSWER_S - procs.age_s())


def open_ledger(
    config: Config, layout: Layout, *, patience_s: float | None = None, create: bool = True, readonly: bool = False,
    give_up: Callable[[], bool] | None = None,
) -> Ledger:  # fmt: skip
    """Open the configured ledger; raise LedgerLost (a one-line error) if it cannot be trusted.

    ``patience_s`` bounds how long a write waits for a busy ledger (None: forever);
    ``give_up`` ends such a wait early (a daemon asked to stop while the server is down).
    With ``create`` False a missing ledger raises instead of being created;
    ``readonly`` (implies not ``create``) opens the SQLite ledger for reading only.
    """
    if config.ledger.startswith(("postgresql://", "postgres://")):
        from dispatcher.ledger.pg_schema import NoSchema  # type: ignore[import-untyped,unused-ignore]

        lean.with_openssl()  # psycopg imports ssl
        from dispatcher.ledger.postgres import PostgresLedger  # type: ignore[import-untyped,unused-ignore]

        # a daemon waits for its ledger (patience None); a command answers within seconds
        reach = None if patience_s is None else min(patience_s, REACH_S)
        try:
            pg: Ledger = PostgresLedger(
                config.ledger,
                layout,
                lease_s=config.lease_s,
                patience_s=reach,
                connect_timeout_s=None if reach is None else CONNECT_S,
                answer_by=None if reach is None else answer_by(),
                readonly=readonly,
                give_up=give_up,
            )
        except LedgerUnavailable as exc:
            raise LedgerUnreachable(str(exc)) from None
        except NoSchema as exc:  # a reader before any daemon started: nothing recorded yet
            if has_jobs(layout):
                raise LedgerLost(
                    f"{exc}; job folders exist: copy the SQLite ledger into it with `dispatcher ledger migrate URL`"
                ) from None
            raise NoLedgerYet(str(exc)) from None
        if pg.is_empty() and has_jobs(layout):
            pg.close()
            raise LedgerLost(
                f"{layout.root}: the PostgreSQL ledger is empty but job folders exist; copy the SQLite ledger"
                " into it first with `dispatcher ledger migrate URL` (`ledger: sqlite` in the config meanwhile;"
                " `dispatcher ledger rebuild` makes that one again from the folders if it is lost)"
            )
        return pg
    from dispatcher.ledger.sqlite import LedgerError, SqliteLedger

    path = layout.ledger
    refuse_network_root(layout)
    # a daemon makes the ledger (and commits to it) before any job folder: so folders seen before the file was
    # found missing mean it was lost, while folders seen after may be those of another daemon that made the
    # ledger meanwhile (three daemons starting together on a fresh root). Missing: the folders, then the file again
    missing = not path.exists() or os.path.getsize(path) == 0
    jobs = missing and has_jobs(layout)
    missing = missing and (not path.exists() or os.path.getsize(path) == 0)
    if missing and jobs:
        raise LedgerLost(f"{path}: the ledger is missing but job folders exist; {REBUILD_HINT}")
    if missing and (readonly or not create):
        raise LedgerLost(f"{path}: no ledger yet")
    try:
        if not readonly:
            fsutil.make_dirs(path.parent)  # durable: a power cut must not take the ledger's folder back
        ledger = SqliteLedger(path, layout.state_dir, patience_s=patience_s, readonly=readonly, give_up=give_up)
    except LedgerError as exc:
        if exc.fresh:  # made by a daemon still starting (its tables come in one commit): as if missing
            if not has_jobs(layout):
                raise NoLedgerYet(f"{path}: no ledger yet") from None
            if not has_tables(path):  # not made meanwhile by a daemon whose jobs those are
                raise LedgerLost(f"{path}: the ledger is empty but job folders exist; {REBUILD_HINT}") from None
            return open_ledger(config, layout, patience_s=patience_s, create=create, readonly=readonly, give_up=give_up)
        if exc.unreachable:  # a full disk, a read-only folder: the ledger itself may be fine
            raise LedgerUnreachable(f"{path}: the ledger cannot be opened ({exc})") from None
        raise LedgerLost(f"{path}: the ledger cannot be read ({exc}); {REBUILD_HINT}") from None
    except OSError as exc:
        raise LedgerUnreachable(f"{path}: the ledger cannot be opened ({exc.strerror})") from None
    # Claims are committed without an fsync: after a power cut a young ledger can hold no row while
    # active/ jobs exist. Their rows are put back at start (reconcile_active); only finished jobs
    # beside an empty ledger mean the ledger itself was lost.
    # (not "missing" as seen before the open: another daemon may have made the ledger and its first jobs since)
    if ledger.is_empty() and has_jobs(layout, finished=True):
        ledger.close()
        raise LedgerLost(f"{path}: the ledger is empty but job folders exist; {REBUILD_HINT}")
    return ledger


def open_reader(config: Config, layout: Layout) -> Ledger | None:
    """Open the ledger read-only for a command that reads; None on a fresh root that has none yet.

    Reading needs no write access anywhere in the root: anyone who can read it (the
    service's group) may run `status`, `list` and `show`.

    A ledger missing or unreadable while job folders exist raises ``LedgerLost``
    (exit 2, naming `dispatcher ledger rebuild`), as for every command.
    """
    if config.ledger == "sqlite":
        path = layout.ledger
        missing = not path.exists() or path.stat().st_size == 0
        if missing and (too_long := path_too_long(path)) is not None:  # never openable: say so, as every command
            raise LedgerUnreachable(f"{path}: the ledger cannot be opened ({too_long})")
        if missing and not has_jobs(layout):
            return None
    try:
        return open_ledger(config, layout, patience_s=PATIENCE_S, create=False, readonly=True)
    except NoLedgerYet:
        return None


def refuse_network_root(layout: Layout) -> None:
    """Raise UsageError if the root is on a network filesystem, where a SQLite ledger must not live (section 12)."""
    from dispatcher.ledger.netfs import filesystem_kind

    kind = filesystem_kind(layout.root) if layout.root.exists() else None
    if kind is not None:
        raise UsageError(
            f"{layout.root}: is on a network filesystem ({kind}); the SQLite ledger needs a local disk:"
            " use `ledger: postgresql://...` (and `watch: poll`) for a root shared between hosts"
        )
