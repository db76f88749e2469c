"""The durable job ledger: an interface (``base``) and its engines (SQLite; PostgreSQL for many hosts).

``open_ledger`` is the one way in: it picks the engine from the config's
``ledger`` setting and refuses to start a fresh, empty ledger over job folders
that already exist (that would accept their ids again).
"""

from __future__ import annotations

import os

from dispatcher.config import Config
from dispatcher.errors import UsageError
from dispatcher.layout import Layout, has_jobs
from dispatcher.ledger.base import (
    FINISHED,
    OPEN,
    Busy,
    Child,
    ClaimAnswer,
    Claimed,
    ClaimRequest,
    DaemonInfo,
    Entry,
    Finish,
    Known,
    Ledger,
    LedgerUnavailable,
    Request,
    Row,
)

__all__ = [
    "FINISHED",
    "OPEN",
    "Busy",
    "Child",
    "ClaimAnswer",
    "ClaimRequest",
    "Claimed",
    "DaemonInfo",
    "Entry",
    "Finish",
    "Known",
    "Ledger",
    "LedgerLost",
    "LedgerUnavailable",
    "LedgerUnreachable",
    "Request",
    "Row",
    "open_ledger",
]

REBUILD_HINT = "run `dispatcher ledger rebuild` (with no daemon running) to rebuild it from the job folders"


class LedgerLost(UsageError):
    """The ledger is missing or unreadable while job folders exist: nothing may start on it."""


class LedgerUnreachable(UsageError):
    """The ledger cannot be opened right now (a full disk, a read-only folder)."""


def open_ledger(config: Config, layout: Layout, *, patience_s: float | None = None, create: bool = True) -> Ledger:
    """Open the configured ledger; raise LedgerLost (a one-line error) if it cannot be trusted.

    ``patience_s`` bounds how long a write waits for a busy ledger (None: forever).
    With ``create`` False a missing ledger raises instead of being created.
    """
    if config.ledger.startswith(("postgresql://", "postgres://")):
        from dispatcher.ledger.postgres import PostgresLedger  # type: ignore[import-untyped,unused-ignore]

        try:
            pg: Ledger = PostgresLedger(config.ledger, layout, lease_s=config.lease_s, patience_s=patience_s)
        except LedgerUnavailable as exc:
            raise LedgerUnreachable(f"the ledger cannot be reached: {exc}") from None
        if pg.is_empty() and has_jobs(layout):
            pg.close()
            raise LedgerLost(
                f"{layout.root}: the PostgreSQL ledger is empty but job folders exist; copy the SQLite ledger"
                " into it first with `dispatcher ledger migrate URL` (or rebuild it from the folders)"
            )
        return pg
    from dispatcher.ledger.netfs import filesystem_kind
    from dispatcher.ledger.sqlite import LedgerError, SqliteLedger

    path = layout.ledger
    kind = filesystem_kind(layout.root) if layout.root.exists() else None
    if kind is not None:
        raise UsageError(
            f"{layout.root}: is on a network filesystem ({kind}); the SQLite ledger needs a local disk:"
            " use `ledger: postgresql://...` (and `watch: poll`) for a root shared between hosts"
        )
    missing = not path.exists() or os.path.getsize(path) == 0
    if missing and has_jobs(layout):
        raise LedgerLost(f"{path}: the ledger is missing but job folders exist; {REBUILD_HINT}")
    if missing and not create:
        raise LedgerLost(f"{path}: no ledger yet")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        ledger = SqliteLedger(path, layout.state_dir, patience_s=patience_s)
    except LedgerError as exc:
        if exc.unreachable:  # a full disk, a read-only folder: the ledger itself may be fine
            raise LedgerUnreachable(f"{path}: the ledger cannot be opened ({exc})") from None
        raise LedgerLost(f"{path}: the ledger cannot be read ({exc}); {REBUILD_HINT}") from None
    except OSError as exc:
        raise LedgerUnreachable(f"{path}: the ledger cannot be opened ({exc.strerror})") from None
    # Claims are committed without an fsync: after a power cut a young ledger can hold no row while
    # active/ jobs exist. Their rows are put back at start (reconcile_active); only finished jobs
    # beside an empty ledger mean the ledger itself was lost.
    if (missing and has_jobs(layout)) or (not missing and ledger.is_empty() and has_jobs(layout, finished=True)):
        ledger.close()
        raise LedgerLost(f"{path}: the ledger is empty but job folders exist; {REBUILD_HINT}")
    return ledger
