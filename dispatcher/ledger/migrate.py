"""`dispatcher ledger migrate URL`: an SQLite ledger copied into an empty PostgreSQL ledger, whole."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from dispatcher.ledger.base import Ledger
from dispatcher.ledger.postgres import PostgresLedger

log = structlog.get_logger("dispatcher")


@dataclass(frozen=True, slots=True)
class Migrated:
    """What `ledger migrate` copied: the rows, and how many of each kind beside them (``Extras.counts``)."""

    rows: int
    extras: dict[str, int]


def migrate(sqlite_ledger: Ledger, target: PostgresLedger) -> Migrated:
    """Copy every row (ids, states, lineage, costs, tokens) and everything beside it into ``target``.

    Beside the rows: open requests, the waits of joins (so a join in waiting/
    still waits for the ids it names), the gates (a paused agent stays paused)
    and the jobs waiting for one. ``target`` must hold no job id
    (PostgresLedgerError otherwise, one line). All or nothing, in one
    transaction; return how many rows were copied and how many of the rest, by
    name. Run it with no daemon working on either ledger.
    """
    entries = list(sqlite_ledger.rows())
    more = sqlite_ledger.extras()
    copied = target.load_into_empty(entries, more)
    counts = more.counts()
    log.info("ledger.migrated", rows=copied, **counts, target=target.where)
    return Migrated(copied, counts)
