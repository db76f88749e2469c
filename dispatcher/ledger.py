"""The durable job ledger: every job id ever claimed or reserved, in SQLite.

Why SQLite: it ships with Python, its primary-key lookup stays in the tens of
microseconds at a million rows, WAL mode lets readers (``status``, ``show``) run
beside a writer, and ``BEGIN IMMEDIATE`` serialises claims across every daemon
process on one root, so two files with one id give one job and one refusal.
Commits use ``synchronous=FULL``: a claim that returned is on disk, so a job id
is never run twice, also after a power loss.

Row states: ``reserved`` (a follow-up waiting for its parent), ``released``
(its file is in inbox/), ``claimed`` (a daemon owns it; its folder is in
active/ or being built), ``done`` and ``failed``. A row is never deleted,
except the reservations of a parent that failed (they were never released).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

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
    updated REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS jobs_parent ON jobs(parent) WHERE parent IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_open ON jobs(state) WHERE state IN ('reserved', 'released', 'claimed');
CREATE TABLE IF NOT EXISTS requests (
    job_id TEXT NOT NULL,
    kind   TEXT NOT NULL,
    at     REAL NOT NULL,
    PRIMARY KEY (job_id, kind)
) WITHOUT ROWID;
"""

CLAIMED, DONE, FAILED, RESERVED, RELEASED = "claimed", "done", "failed", "reserved", "released"


@dataclass(frozen=True, slots=True)
class Entry:
    """One row of the ledger."""

    job_id: str
    state: str
    agent: str | None
    owner: str | None
    source: str | None
    digest: str | None
    parent: str | None
    hops: int
    updated: float


@dataclass(frozen=True, slots=True)
class Claim:
    """The answer to a claim: ``ok`` with the lineage, or the entry that blocks it."""

    ok: bool
    parent: str | None = None
    hops: int = 0
    known: Entry | None = None
    previous: str | None = None  # the state a taken-over or released entry had


class Ledger:
    """A handle on ``<root>/.state/ledger.sqlite3``, safe to share between threads."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=30000")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._db.close()

    @contextmanager
    def _write(self, *, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """Run a write transaction that holds the database's write lock from the start.

        A durable commit is fsynced (``synchronous=FULL``) before it returns.
        """
        with self._lock:
            if not durable:
                self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            finally:
                if not durable:
                    self._db.execute("PRAGMA synchronous=FULL")

    def _row(self, db: sqlite3.Connection, job_id: str) -> Entry | None:
        row = db.execute(
            "SELECT job_id, state, agent, owner, source, digest, parent, hops, updated FROM jobs WHERE job_id = ?",
            (job_id,),
        ).fetchone()
        return Entry(*row) if row else None

    # -- reads ---------------------------------------------------------------
    def get(self, job_id: str) -> Entry | None:
        """Return the entry for job_id, or None if the id was never seen."""
        with self._lock:
            return self._row(self._db, job_id)

    def children(self, job_id: str) -> list[str]:
        """Return the follow-up ids whose parent is job_id, in id order."""
        with self._lock:
            rows = self._db.execute("SELECT job_id FROM jobs WHERE parent = ? ORDER BY job_id", (job_id,))
            return [r[0] for r in rows]

    def in_state(self, *states: str) -> list[Entry]:
        """Return the entries in one of the open states (claimed, reserved, released)."""
        marks = ",".join("?" * len(states))
        with self._lock:
            rows = self._db.execute(
                "SELECT job_id, state, agent, owner, source, digest, parent, hops, updated"  # noqa: S608 - only "?" marks are joined in
                f" FROM jobs WHERE state IN ({marks})",
                states,
            ).fetchall()
        return [Entry(*r) for r in rows]

    def known(self, job_ids: Iterable[str]) -> dict[str, Entry]:
        """Return the entries of those ids that the ledger knows."""
        out = {}
        with self._lock:
            for job_id in job_ids:
                entry = self._row(self._db, job_id)
                if entry is not None:
                    out[job_id] = entry
        return out

    # -- claims --------------------------------------------------------------
    def claim(
        self,
        job_id: str,
        *,
        agent: str,
        owner: str,
        source: str,
        digest: str,
        may_take_over: Callable[[Entry], bool] | None = None,
    ) -> Claim:
        """Claim job_id for owner, atomically across processes.

        A new id is inserted. A released follow-up is taken when the file's
        digest is the one the ledger released. An entry still ``claimed`` by
        an owner is taken over only when ``may_take_over(entry)`` says so (its
        owner died between the claim and building the job folder). Anything
        else is refused, with the entry that blocks it.
        """
        now = time.time()
        with self._write() as db:
            entry = self._row(db, job_id)
            if entry is None:
                db.execute(
                    "INSERT INTO jobs (job_id, state, agent, owner, source, digest, hops, updated)"
                    " VALUES (?, 'claimed', ?, ?, ?, ?, 0, ?)",
                    (job_id, agent, owner, source, digest, now),
                )
                return Claim(ok=True)
            takeable = (entry.state in (RESERVED, RELEASED) and entry.digest == digest) or (
                entry.state == CLAIMED and may_take_over is not None and may_take_over(entry)
            )
            if not takeable:
                return Claim(ok=False, known=entry)
            db.execute(
                "UPDATE jobs SET state = 'claimed', agent = ?, owner = ?, source = ?, updated = ? WHERE job_id = ?",
                (agent, owner, source, now, job_id),
            )
            return Claim(ok=True, parent=entry.parent, hops=entry.hops, previous=entry.state)

    def adopt(self, job_id: str, owner: str, *, expected_owner: str | None) -> bool:
        """Make owner the owner of a claimed job still held by expected_owner; return success."""
        with self._write() as db:
            cur = db.execute(
                "UPDATE jobs SET owner = ?, updated = ? WHERE job_id = ? AND state = 'claimed' AND owner IS ?",
                (owner, time.time(), job_id, expected_owner),
            )
            return cur.rowcount == 1

    def unclaim(self, job_id: str, owner: str, previous: str | None) -> None:
        """Undo a claim whose file vanished or changed before any job folder existed.

        A new id is forgotten; a released follow-up goes back to ``previous``.
        """
        with self._write() as db:
            if previous in (None, CLAIMED):  # no job folder ever existed for it
                db.execute("DELETE FROM jobs WHERE job_id = ? AND state = 'claimed' AND owner = ?", (job_id, owner))
            else:
                db.execute(
                    "UPDATE jobs SET state = ?, owner = NULL WHERE job_id = ? AND state = 'claimed' AND owner = ?",
                    (previous, job_id, owner),
                )

    def finish(self, job_id: str, state: str) -> None:
        """Record the final state (done or failed) of a job; drop a failed job's reservations.

        This commit is not fsynced on its own (the next durable commit carries it to
        disk): the final state is also the job's folder, which recovery reads back.
        """
        with self._write(durable=False) as db:
            db.execute(
                "UPDATE jobs SET state = ?, updated = ? WHERE job_id = ?",
                (state, time.time(), job_id),
            )
            if state == FAILED:
                db.execute("DELETE FROM jobs WHERE parent = ? AND state = 'reserved'", (job_id,))

    # -- follow-ups ----------------------------------------------------------
    def reserve(self, parent: str, hops: int, children: Iterable[tuple[str, str, str]]) -> list[str]:
        """Reserve follow-ups (id, agent, outbox file name) for parent; return the ids already taken.

        Nothing is reserved unless every id is free (or already reserved by
        this same parent, after a crash).
        """
        now = time.time()
        with self._write() as db:
            taken, fresh = [], []
            for job_id, agent, source in children:
                entry = self._row(db, job_id)
                if entry is None:
                    fresh.append((job_id, agent, source))
                elif entry.parent != parent or entry.state not in (RESERVED, RELEASED):
                    taken.append(job_id)
            if taken:
                return taken
            db.executemany(
                "INSERT INTO jobs (job_id, state, agent, source, parent, hops, updated)"
                " VALUES (?, 'reserved', ?, ?, ?, ?, ?)",
                [(job_id, agent, source, parent, hops, now) for job_id, agent, source in fresh],
            )
            return []

    def mark_released(self, job_id: str, source: str, digest: str) -> None:
        """Record that a reserved follow-up's file is in inbox/ under source."""
        with self._write() as db:
            db.execute(
                "UPDATE jobs SET state = 'released', source = ?, digest = ?, updated = ?"
                " WHERE job_id = ? AND state = 'reserved'",
                (source, digest, time.time(), job_id),
            )

    def set_digest(self, job_id: str, digest: str) -> None:
        """Record the digest a reserved follow-up will be released with (before its file exists)."""
        with self._write() as db:
            db.execute(
                "UPDATE jobs SET digest = ? WHERE job_id = ? AND state = 'reserved'",
                (digest, job_id),
            )

    def pending_releases(self, parent: str | None = None) -> list[Entry]:
        """Return reserved follow-ups whose parent is done (of one parent, or all).

        ``owner`` of each returned entry is the owner of its parent (who releases it).
        """
        sql = (
            "SELECT c.job_id, c.state, c.agent, p.owner, c.source, c.digest, c.parent, c.hops, c.updated"
            " FROM jobs c JOIN jobs p ON p.job_id = c.parent"
            " WHERE c.state = 'reserved' AND p.state = 'done'"
        )
        with self._lock:
            if parent is None:
                rows = self._db.execute(sql).fetchall()
            else:
                rows = self._db.execute(sql + " AND c.parent = ? ORDER BY c.job_id", (parent,)).fetchall()
        return [Entry(*r) for r in rows]

    # -- requests (retry, cancel) ---------------------------------------------
    def request(self, job_id: str, kind: str) -> None:
        """Record a request (``retry`` or ``cancel``) for a daemon to carry out."""
        with self._write() as db:
            db.execute(
                "INSERT OR REPLACE INTO requests (job_id, kind, at) VALUES (?, ?, ?)",
                (job_id, kind, time.time()),
            )

    def requests(self, kind: str) -> list[str]:
        """Return the job ids with an open request of this kind, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT job_id FROM requests WHERE kind = ? ORDER BY at", (kind,))
            return [r[0] for r in rows]

    def has_request(self, job_id: str, kind: str) -> bool:
        """Return True if job_id has an open request of this kind."""
        with self._lock:
            row = self._db.execute("SELECT 1 FROM requests WHERE job_id = ? AND kind = ?", (job_id, kind))
            return row.fetchone() is not None

    def clear_request(self, job_id: str, kind: str) -> None:
        """Mark a request as carried out."""
        with self._write() as db:
            db.execute("DELETE FROM requests WHERE job_id = ? AND kind = ?", (job_id, kind))

    def take_retry(self, job_id: str, owner: str) -> bool:
        """Atomically turn a failed job into a claim by owner (the request is cleared once it moved)."""
        with self._write() as db:
            cur = db.execute(
                "UPDATE jobs SET state = 'claimed', owner = ?, updated = ? WHERE job_id = ? AND state = 'failed'",
                (owner, time.time(), job_id),
            )
            return cur.rowcount == 1

    # -- bulk (benchmarks, imports) -------------------------------------------
    def insert_done(self, job_ids: Iterable[str], agent: str = "bulk") -> None:
        """Record many finished job ids at once (used by benchmarks)."""
        now = time.time()
        with self._write() as db:
            db.executemany(
                "INSERT OR IGNORE INTO jobs (job_id, state, agent, hops, updated) VALUES (?, 'done', ?, 0, ?)",
                ((job_id, agent, now) for job_id in job_ids),
            )
