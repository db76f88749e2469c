"""The embedded ledger: every job id ever claimed or reserved, in one SQLite file.

Why SQLite: it ships with Python, a primary-key lookup stays in the tens of
microseconds at a million rows, WAL mode lets readers (`status`, `show`) run
beside a writer, and ``BEGIN IMMEDIATE`` serialises claims across every daemon
process on one root, so two files with one id give one job and one refusal.

Durability: finishing steps, reservations and requests commit with
``synchronous=FULL``. Claims commit with ``NORMAL``: the durable record of a
claim is its job folder in active/, fsynced before any agent starts, and a
daemon that starts after a power loss puts back the row of any folder it finds
without one (``reconcile``). Another process holding the write lock is a wait,
never a failure: every write is retried with backoff for as long as it takes
(``ledger.waiting`` is logged), so good work is never failed by a busy ledger.
Liveness and slots are flocks (``flocks.py``): this engine is for one host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import sqlite3
from collections.abc import Iterable, Iterator, Sequence

from dispatcher import procs
from dispatcher.fsutil import file_id, fsync_dir
from dispatcher.ledger.base import Ledger, now
from dispatcher.ledger.flocks import make_lock, read_info, read_infos, write_info
from dispatcher.ledger.records import (
    Busy,
    ClaimAnswer,
    Claimed,
    ClaimRequest,
    DaemonInfo,
    Entry,
    Finish,
    Known,
    Request,
    folder_may_be_lost,
    takes_release,
)
from dispatcher.ledger.sqlite_bulk import SqliteBulk
from dispatcher.ledger.sqlite_db import _COLUMNS, LedgerError, _entry
from dispatcher.ledger.sqlite_followups import SqliteFollowups
from dispatcher.ledger.sqlite_gates import SqliteGates
from dispatcher.ledger.sqlite_waits import SqliteWaits
from dispatcher.lifecycle import Row

__all__ = ["LedgerError", "SqliteLedger"]


class SqliteLedger(SqliteGates, SqliteWaits, SqliteFollowups, SqliteBulk, Ledger):
    """A handle on ``<root>/.state/ledger.sqlite3``; safe to share between threads."""

    slots_local = True  # slots are flocks on this host
    _info: DaemonInfo | None = None

    # -- liveness -------------------------------------------------------------------------
    def register(self, info: DaemonInfo) -> None:
        """Hold this daemon's liveness flock and write its info file."""
        if self._life is None or self.owner != info.owner:  # (a register tried again after a full disk: held)
            self.owner = info.owner
            self._daemons.mkdir(parents=True, exist_ok=True)
            self._life = make_lock(self._daemons / f"{info.owner}.lock")
            self._life.acquire()
            self._life_id = file_id(self._daemons / f"{info.owner}.lock")
        self._info = info
        write_info(self._daemons, info)

    def take_back_locks(self) -> list[str]:
        """Lock again each lock file of this daemon found deleted or replaced; return their paths.

        Its liveness lock gone, other daemons and `status` would take it for dead and recover its
        running jobs; a slot's gone, another daemon could exceed the agent's ``concurrency``.
        """
        lost = self._slots.take_back_lost()
        if self._life is None or not self.owner:
            return lost
        if self._info is not None and read_info(self._daemons, self.owner) != self._info:
            # its info file removed, damaged, or not rewritten for a reload (a full disk): `status` and `reload`
            # would not see this daemon, or take its config for another; written again
            with contextlib.suppress(OSError):
                write_info(self._daemons, self._info)
        path = self._daemons / f"{self.owner}.lock"
        if file_id(path) == self._life_id:
            return lost
        self._life.release(force=True)
        self._daemons.mkdir(parents=True, exist_ok=True)
        self._life = make_lock(path)
        self._life.acquire()
        self._life_id = file_id(path)
        if self._info is not None:  # written again with the new lock file's inode (``flocks.owner_alive``)
            with contextlib.suppress(OSError):
                write_info(self._daemons, self._info)
        return [str(path), *lost]

    def record_config(self, digest: str | None) -> None:
        """Rewrite this daemon's info file with the digest of the config it loaded."""
        if self._info is not None:
            self._info = dataclasses.replace(self._info, config_digest=digest)
            write_info(self._daemons, self._info)

    def alive(self, owner: str) -> bool:
        """Return True while the daemon ``owner`` holds its liveness flock."""
        return owner == self.owner or self._liveness.alive(owner)

    def _folder_may_be_lost(self, owner: str) -> bool:
        """Could the dead daemon ``owner`` have lost a claim's folder (``folder_may_be_lost``)?"""
        info = read_info(self._daemons, owner)
        host, started = (info.host, info.started) if info is not None else (None, None)
        return folder_may_be_lost(host, started, socket.gethostname(), procs.boot_time())

    def daemons(self) -> list[DaemonInfo]:
        """Return every daemon that ever registered on this root, newest first."""
        return read_infos(self._daemons, self.alive)

    # -- reads --------------------------------------------------------------------------
    def get(self, job_id: str) -> Entry | None:
        """Return the row of job_id, or None if the id was never seen."""
        return self._read(lambda db: self._row(db, job_id))

    def known(self, job_ids: Iterable[str]) -> dict[str, Entry]:
        """Return the rows of those ids that the ledger knows."""
        ids = list(job_ids)

        def body(db: sqlite3.Connection) -> dict[str, Entry]:
            out = {}
            for job_id in ids:
                entry = self._row(db, job_id)
                if entry is not None:
                    out[job_id] = entry
            return out

        return self._read(body)

    def children(self, job_id: str) -> list[str]:
        """Return the follow-up ids whose parent is job_id, in id order."""
        rows = self._read(
            lambda db: db.execute("SELECT job_id FROM jobs WHERE parent = ? ORDER BY job_id", (job_id,)).fetchall()
        )
        return [r[0] for r in rows]

    def in_state(self, *states: Row) -> list[Entry]:
        """Return the rows in any of these states."""
        marks = ",".join("?" * len(states))
        sql = f"SELECT {_COLUMNS} FROM jobs WHERE state IN ({marks})"  # noqa: S608 - only "?" marks are joined in
        return [_entry(r) for r in self._read(lambda db: db.execute(sql, [str(s) for s in states]).fetchall())]

    def count(self) -> int:
        """Return how many job ids the ledger holds."""
        return int(self._read(lambda db: db.execute("SELECT count(*) FROM jobs").fetchone()[0]))

    def is_empty(self) -> bool:
        """Return True if the ledger holds no job id (without counting a million rows)."""
        return self._read(lambda db: db.execute("SELECT 1 FROM jobs LIMIT 1").fetchone()) is None

    def rows(self) -> Iterator[Entry]:
        """Yield every row, in id order."""
        sql = f"SELECT {_COLUMNS}, spent FROM jobs ORDER BY job_id"  # noqa: S608 - fixed column names
        rows = self._read(lambda db: db.execute(sql).fetchall())
        return (_entry(r) for r in rows)

    # -- claims -------------------------------------------------------------------------
    def claim(self, requests: Sequence[ClaimRequest]) -> list[ClaimAnswer]:
        """Claim many ids in one transaction (see ``Ledger.claim``)."""
        stamp = now()

        def body(db: sqlite3.Connection) -> list[ClaimAnswer]:
            out: list[ClaimAnswer] = []
            for req in requests:
                # a new id (the common case) is one statement, which also tells whether a cancel is open
                # for it (the insert returns a row only when it made one): the row is read only when known
                made = db.execute(
                    "INSERT INTO jobs (job_id, state, agent, owner, source, digest, hops, updated, token)"
                    " VALUES (?, 'claimed', ?, ?, ?, ?, 0, ?, 1) ON CONFLICT (job_id) DO NOTHING"
                    " RETURNING EXISTS (SELECT 1 FROM requests WHERE job_id = jobs.job_id AND kind = 'cancel')",
                    (req.job_id, req.agent, self.owner, req.source, req.digest, stamp),
                ).fetchone()
                if made is not None:
                    out.append(Claimed(req.job_id, 1, cancelled=made[0] == 1))
                    continue
                entry = self._row(db, req.job_id)
                if entry is None:  # the insert met this row inside this very transaction
                    raise sqlite3.IntegrityError(f"jobs: {req.job_id} conflicted but has no row")
                same_file = entry.source == req.source and entry.digest == req.digest
                released = takes_release(entry, req.source, req.digest)
                if entry.state == Row.CLAIMED and same_file and entry.owner is not None:
                    if entry.owner == self.owner or self.alive(entry.owner):
                        out.append(Busy(entry))
                        continue
                    taken_over = req.may_take_over and self._folder_may_be_lost(entry.owner)
                else:
                    taken_over = False
                if not (released or taken_over):
                    out.append(Known(entry))
                    continue
                token = entry.token + 1
                db.execute(
                    "UPDATE jobs SET state = 'claimed', agent = ?, owner = ?, source = ?, updated = ?, token = ?"
                    " WHERE job_id = ?",
                    (req.agent, self.owner, req.source, stamp, token, req.job_id),
                )
                parent_cost = None
                if entry.parent is not None:
                    row = db.execute("SELECT chain_cost_usd FROM jobs WHERE job_id = ?", (entry.parent,)).fetchone()
                    parent_cost = row[0] if row else None
                out.append(
                    Claimed(
                        req.job_id,
                        token,
                        entry.parent,
                        entry.hops,
                        entry.state,
                        parent_cost,
                        entry.owner if taken_over else None,
                        self._cancel_asked(db, req.job_id),
                    )
                )
            return out

        return self._tx(body, durable=False)

    @staticmethod
    def _cancel_asked(db: sqlite3.Connection, job_id: str) -> bool:
        """Return True if a cancel request is open for job_id (read inside the claim's transaction)."""
        return (
            db.execute("SELECT 1 FROM requests WHERE job_id = ? AND kind = 'cancel'", (job_id,)).fetchone() is not None
        )

    def unclaim(self, job_id: str, token: int, previous: str | None, previous_owner: str | None = None) -> None:
        """Undo a claim whose job folder could not be put in place (nothing ran)."""

        def body(db: sqlite3.Connection) -> None:
            if previous_owner is not None:  # a takeover: the claim goes back to the daemon it was taken from
                db.execute(
                    "UPDATE jobs SET owner = ?, token = ? WHERE job_id = ? AND state = 'claimed' AND owner = ?"
                    " AND token = ?",
                    (previous_owner, token - 1, job_id, self.owner, token),
                )
            elif previous in (None, Row.CLAIMED):  # no job folder ever existed for it
                db.execute(
                    "DELETE FROM jobs WHERE job_id = ? AND state = 'claimed' AND owner = ? AND token = ?",
                    (job_id, self.owner, token),
                )
            else:
                db.execute(
                    "UPDATE jobs SET state = ?, owner = NULL WHERE job_id = ? AND state = 'claimed' AND owner = ?"
                    " AND token = ?",
                    (previous, job_id, self.owner, token),
                )

        self._tx(body)

    def adopt(self, job_id: str, expected_owner: str | None, expected_token: int) -> int | None:
        """Take over a claimed job of a dead daemon; return the new token, or None if another won."""

        def body(db: sqlite3.Connection) -> int | None:
            cur = db.execute(
                "UPDATE jobs SET owner = ?, token = token + 1, updated = ?,"
                " spent = CASE WHEN cost_usd IS NULL THEN NULL ELSE coalesce(spent, updated) END"  # its earlier cost
                " WHERE job_id = ? AND state = 'claimed' AND owner IS ? AND token = ?",
                (self.owner, now(), job_id, expected_owner, expected_token),
            )
            return expected_token + 1 if cur.rowcount == 1 else None

        return self._tx(body)

    def take_retry(self, job_id: str, kind: Request = Request.RETRY) -> int | None:
        """Turn a failed (or, for a revise, reviewed) job with an open request into a claim; return the token."""
        states = (Row.FAILED, Row.REVIEW) if kind is Request.REVISE else (Row.FAILED,)

        def body(db: sqlite3.Connection) -> int | None:
            entry = self._row(db, job_id)
            if entry is None or entry.state not in states:
                return None
            asked = db.execute("SELECT 1 FROM requests WHERE job_id = ? AND kind = ?", (job_id, str(kind))).fetchone()
            if asked is None:  # carried out already: one request, one retry
                return None
            stamp = now()
            db.execute(
                # its earlier attempts' cost counted from now, when it was taken back (spent: none of its own)
                "UPDATE jobs SET state = 'claimed', owner = ?, token = ?, updated = ?, spent = NULL WHERE job_id = ?",
                (self.owner, entry.token + 1, stamp, job_id),
            )
            # a join waits again, max_wait counted from now (its wait rows keep their first claim's time otherwise)
            db.execute("UPDATE waits SET since = ? WHERE job_id = ?", (stamp, job_id))
            # the reviewed attempt's follow-ups stay reserved until the job has moved (``clear_request``): a
            # revision cut short before is put back whole, and an approve then releases them
            return entry.token + 1

        return self._tx(body)

    def reconcile(self, job_id: str, agent: str | None, parent: str | None, hops: int) -> bool:
        """Put back the claim row of a job folder found in active/ without one (a lost commit)."""

        def body(db: sqlite3.Connection) -> bool:
            entry = self._row(db, job_id)
            if entry is not None and entry.state not in (Row.RESERVED, Row.RELEASED):
                return False
            db.execute(
                "INSERT OR REPLACE INTO jobs (job_id, state, agent, owner, parent, hops, updated, token)"
                " VALUES (?, 'claimed', ?, NULL, ?, ?, ?, ?)",
                (job_id, agent, parent, hops, now(), (entry.token if entry else 0) + 1),
            )
            return True

        return self._tx(body)

    # -- finishing ------------------------------------------------------------------------
    def finish(self, items: Sequence[Finish]) -> list[bool]:
        """Record ends in one transaction, each only while its token holds the claim."""
        stamp = now()

        def body(db: sqlite3.Connection) -> list[bool]:
            out = []
            for it in items:
                # the update returns a row only when it was made, telling whether a cancel is open for the job
                ended = db.execute(
                    "UPDATE jobs SET state = ?, cost_usd = ?, chain_cost_usd = ?, updated = ?,"
                    # a person's decision on a job in review spends nothing: its cost stays counted from when it
                    # finished its work (the daily window), while updated says when it entered its state (list)
                    " spent = CASE WHEN state = 'review' AND cost_usd IS ? THEN coalesce(spent, updated) END,"
                    " owner = CASE WHEN state = 'review' THEN NULL ELSE owner END"  # a person decided
                    " WHERE job_id = ? AND token = ? AND state IN ('claimed', 'review', ?)"
                    " RETURNING EXISTS (SELECT 1 FROM requests WHERE job_id = jobs.job_id AND kind = 'cancel')",
                    (
                        str(it.state),
                        it.cost_usd,
                        it.chain_cost_usd,
                        stamp,
                        it.cost_usd,
                        it.job_id,
                        it.token,
                        str(it.state),
                    ),
                ).fetchone()
                ok = ended is not None
                if ok and ended[0] == 1:  # a cancel asked for a job that has now ended is spent
                    db.execute("DELETE FROM requests WHERE job_id = ? AND kind = 'cancel'", (it.job_id,))
                if ok and it.state == Row.FAILED:  # its follow-ups were never released
                    db.execute("DELETE FROM jobs WHERE parent = ? AND state = 'reserved'", (it.job_id,))
                out.append(ok)
            return out

        return self._tx(body)

    def set_state(self, job_id: str, state: Row, *, expect: Row) -> bool:
        """Move a row from one open state to another (hold, release of a held follow-up)."""
        return self._tx(
            lambda db: (
                db.execute(
                    "UPDATE jobs SET state = ?, updated = ? WHERE job_id = ? AND state = ?",
                    (str(state), now(), job_id, str(expect)),
                ).rowcount
                == 1
            )
        )

    # -- requests -------------------------------------------------------------------------
    def request(self, job_id: str, kind: Request) -> None:
        """Record a request for a daemon to carry out, durably before the command says it was taken.

        The commit fsyncs the WAL; the folder is fsynced too, so that a WAL file made by this
        very write keeps its name through a power cut.
        """
        self._tx(
            lambda db: db.execute(
                "INSERT OR REPLACE INTO requests (job_id, kind, at) VALUES (?, ?, ?)", (job_id, str(kind), now())
            )
        )
        with contextlib.suppress(OSError):
            fsync_dir(self.path.parent)

    def requests(self, kind: Request) -> list[str]:
        """Return the job ids with an open request of this kind, oldest first."""
        rows = self._read(
            lambda db: db.execute("SELECT job_id FROM requests WHERE kind = ? ORDER BY at", (str(kind),)).fetchall()
        )
        return [r[0] for r in rows]

    def clear_request(self, job_id: str, kind: Request, *, drop_reserved: bool = False) -> None:
        """Mark a request as carried out (``Ledger.clear_request``)."""

        def body(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM requests WHERE job_id = ? AND kind = ?", (job_id, str(kind)))
            if drop_reserved:
                db.execute("DELETE FROM jobs WHERE parent = ? AND state = 'reserved'", (job_id,))

        self._tx(body)

    # -- slots ------------------------------------------------------------------------------
    def take_slot(self, agent: str, concurrency: int) -> int | None:
        """Take a free slot of agent (a flock shared by every daemon on this host)."""
        return self._slots.take(agent, concurrency)

    def free_slot(self, agent: str, slot: int) -> None:
        """Give a slot back."""
        self._slots.free(agent, slot)

    def slot_fd(self, agent: str, slot: int) -> int | None:
        """Return the descriptor of the slot's flock: an agent that inherits it holds the slot while it lives."""
        return self._slots.fd(agent, slot)

    # -- bulk ---------------------------------------------------------------------------------
    def load_rows(self, entries: Iterable[Entry]) -> int:
        """Insert rows as they are, keeping rows the ledger already has; return how many were new."""
        batch = [
            (
                e.job_id,
                e.state,
                e.agent,
                e.owner,
                e.token,
                e.source,
                e.digest,
                e.parent,
                e.hops,
                e.cost_usd,
                e.chain_cost_usd,
                e.updated,
                e.spent,
            )
            for e in entries
        ]

        def body(db: sqlite3.Connection) -> int:
            before = db.total_changes
            sql = f"INSERT OR IGNORE INTO jobs ({_COLUMNS}, spent) VALUES ({','.join('?' * 13)})"  # noqa: S608
            db.executemany(sql, batch)
            return db.total_changes - before

        return self._tx(body)
