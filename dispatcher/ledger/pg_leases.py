"""Daemons, leases and concurrency slots of the PostgreSQL ledger, on the database's clock only.

A daemon is a row of ``daemons`` inserted at each start under a new identity.
It is alive while ``lease_until`` (renewed to the database's ``now()`` +
lease) is ahead of the database's ``now()`` and no one set ``ended``: 'stopped'
at a clean stop, 'lost' when a reaper found its lease run out. ``ended`` is
final: a lost daemon can never renew again (its jobs are someone else's now).

Local clocks only ever make this daemon more careful: ``lease_ok()`` measures
lease/2 from the *send* time of the last successful renewal on the monotonic
clock, which is never later than the database's view of it.

What the daemon must call on its ``PostgresLedger`` (``lease_s`` is the config's ``lease``):

- ``register(info)`` once at start (a new identity every start);
- ``renew()`` every lease/6 seconds (at least every lease/3, as the contract
  says; more often, so that one failed renewal does not cost the lease/2 of
  ``lease_ok``), right away again after it returned False; from its own thread
  or timer, not the ledger lane (it has its own connection and never waits
  behind other steps; one try is bounded by the connection timeouts, < lease/2);
- ``lease_ok()`` before claiming and while agents run: False once the last
  successful renewal is lease/2 old by the local monotonic clock; then end the
  agents' groups and claim nothing until it is True again. ``lost`` is True once
  another daemon declared this one lost: its identity is dead for good, so the
  daemon should stop (and be restarted under a new identity);
- ``reap()`` every lease/3 or so: returns the owners newly declared lost (log
  ``host.lost`` for each; exactly one reaper gets each owner) and frees their
  slots; it returns [] until ``may_reap()``, i.e. until this daemon has renewed
  its own lease without a gap for a full lease (after a database outage nobody
  reaps anybody before every live daemon had the time to renew). ``alive()`` of a
  lapsed daemon stays True for a daemon that is back from such an outage until
  ``may_reap()`` (``may_adopt``), and adopting a job of a lapsed daemon declares
  it lost in the same transaction (``host.lost``): it can never renew and start
  that job's agent again;
- ``close()`` at a clean stop: the daemon is marked stopped (alive no more, its
  slots free, never reported lost), so that the next start recovers its jobs
  at once instead of after a lease.
"""

from __future__ import annotations

import itertools
import threading
import time

import psycopg
import structlog

from dispatcher.ledger.pg_conn import Conn, Cur, PostgresLedgerError, cut_socket
from dispatcher.ledger.pg_runner import Runner
from dispatcher.ledger.pg_settle import Found
from dispatcher.ledger.records import DaemonInfo, LedgerUnavailable

log = structlog.get_logger("dispatcher")


class LeaseLost(LedgerUnavailable):
    """This daemon may not take anything now: its lease ran out, or it was declared lost."""


class Leases:
    """This process's daemon row: register, renew, reap, liveness of others, slots."""

    def __init__(self, runner: Runner, conninfo: str, lease_s: float) -> None:
        self.runner = runner
        self.where = runner.where
        self.lease_s = lease_s
        self.owner = ""
        self._conninfo = conninfo
        self._lock = threading.Lock()  # the renewal connection
        self._conn: Conn | None = None
        self._renewing: tuple[Conn, float] | None = None  # the renewal in flight: its connection, since when
        self.silent = False  # a stop cut calls hung on a silent server: no last step is sent at stop
        self._renewed_at: float | None = None  # monotonic send time of the last successful renewal
        self._streak_since: float | None = None  # start of the current gap-free run of renewals
        self._gap_seen = False  # a renewal came after a gap (an outage): others' lapsed leases are not trusted yet
        self.lost = False
        self._failing = False
        self.closed = False
        self._nonces = itertools.count(1)
        self._live_seen: dict[str, float] = {}
        self._ended: set[str] = set()
        self.reaped: dict[str, tuple[str, int]] = {}  # owner -> (host, pid) of each daemon this one reaped
        self._slot_rows: set[tuple[str, int]] = set()

    def nonce(self) -> str:
        """Return a tag no other step of any daemon uses (for read-backs)."""
        return f"{self.owner}:{time.time_ns()}:{next(self._nonces)}"

    def check(self, cur: Cur, *, lease: bool) -> bool:
        """Lock this daemon's row (FOR SHARE, so no reaper marks it mid-step); may it act?

        Not declared lost or stopped, and with ``lease``, its lease still running by
        the database's clock. A command that is not a daemon (no owner) always may.
        """
        if not self.owner:
            return True
        row = cur.execute(
            "SELECT ended IS NULL, lease_until > now() FROM daemons WHERE owner = %s FOR SHARE", (self.owner,)
        ).fetchone()
        if row is None:
            return False
        if not row[0]:
            self.lost = True
            return False
        return bool(row[1]) or not lease

    def refusal(self) -> LeaseLost:
        """Return the error a claim raises when ``check(lease=True)`` said no."""
        if self.lost:
            return LeaseLost(f"{self.where}: this daemon ({self.owner}) was declared lost; it must restart")
        return LeaseLost(f"{self.where}: this daemon's lease has run out; it claims nothing until it is renewed")

    # -- life -------------------------------------------------------------------------------
    def register(self, info: DaemonInfo) -> None:
        """Insert the daemon's row with a lease; an identity used before is refused."""
        sent = time.monotonic()

        def body(cur: Cur) -> None:
            row = cur.execute(
                "INSERT INTO daemons (owner, pid, host, started, lease_s, lease_until, config_digest)"
                " VALUES (%s, %s, %s, %s, %s, now() + make_interval(secs => %s), %s)"
                " ON CONFLICT (owner) DO NOTHING RETURNING 1",
                (info.owner, info.pid, info.host, info.started, self.lease_s, self.lease_s, info.config_digest),
            ).fetchone()
            if row is None:
                raise PostgresLedgerError(f"{self.where}: daemon identity {info.owner} was used before; never reused")

        def resolve(cur: Cur) -> Found[None] | None:
            row = cur.execute("SELECT pid, host, started FROM daemons WHERE owner = %s", (info.owner,)).fetchone()
            return Found(None) if row == (info.pid, info.host, info.started) else None

        self.runner.run("register", body, resolve)
        self.owner = info.owner
        self._renewed_at = self._streak_since = sent
        self.lost = False

    def renew(self) -> bool:
        """Renew the lease to the database's now() + lease; one try on its own connection."""
        if not self.owner or self.lost or self.closed:
            return False
        sent = time.monotonic()
        with self._lock:
            try:
                conn = self._conn
                if conn is None or conn.closed or conn.broken:
                    conn = self._conn = psycopg.connect(self._conninfo, autocommit=True)
                self._renewing = (conn, sent)
                row = conn.execute(
                    "UPDATE daemons SET lease_until = now() + make_interval(secs => %s), renewed = now()"
                    " WHERE owner = %s AND ended IS NULL RETURNING 1",
                    (self.lease_s, self.owner),
                ).fetchone()
            except psycopg.Error as exc:
                self._renewing = None
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                if not self._failing:
                    log.warning("ledger.renew_failed", owner=self.owner, error=" ".join(str(exc).split())[:300])
                self._failing = True
                return False
            self._renewing = None
        self._failing = False
        if row is None:
            self.lost = True
            log.error("ledger.lease_lost", owner=self.owner, reason="declared lost by another daemon")
            return False
        if self._renewed_at is None or self._streak_since is None or sent - self._renewed_at >= self.lease_s / 2:
            self._gap_seen = self._gap_seen or self._renewed_at is not None
            self._streak_since = sent  # the lease may have lapsed in between: the gap-free run starts again
        self._renewed_at = sent
        return True

    def sever(self, older_than_s: float) -> int:
        """Cut the socket of a renewal in flight for longer than older_than_s (see ``Pool.sever``); 1 if cut."""
        found = self._renewing  # read without the lock, which the hung renewal holds
        if found is None or time.monotonic() - found[1] < older_than_s:
            return 0
        return int(cut_socket(found[0]))

    def lease_ok(self) -> bool:
        """True while the last successful renewal is younger than lease/2 (local monotonic clock)."""
        at = self._renewed_at
        return bool(self.owner) and not self.lost and at is not None and time.monotonic() - at < self.lease_s / 2

    def ok_for_s(self) -> float | None:
        """Return how long ``lease_ok`` stays True if no renewal succeeds meanwhile (None: not ok now)."""
        if not self.lease_ok():
            return None
        at = self._renewed_at
        return None if at is None else at + self.lease_s / 2 - time.monotonic()

    def may_reap(self) -> bool:
        """True once this daemon has renewed its own lease without a gap for a full lease."""
        since = self._streak_since
        return self.lease_ok() and since is not None and time.monotonic() - since >= self.lease_s

    def may_adopt(self) -> bool:
        """True when another daemon's lapsed lease may be read as its death here: this daemon saw no gap in its
        own renewals since its start, or has renewed without one for a full lease since (``may_reap``).

        After a database outage every daemon's lease lapsed; the first to renew would otherwise take the
        jobs of every other live daemon, which renew an instant later.
        """
        return not self._gap_seen or self.may_reap()

    def reap(self) -> list[str]:
        """Mark every daemon whose lease ran out as lost and free its slots; return those newly marked."""
        if not self.may_reap():
            return []
        nonce = self.nonce()

        def body(cur: Cur) -> list[str]:
            rows = cur.execute(
                "UPDATE daemons SET ended = 'lost', ended_at = now(), ended_by = %s"
                " WHERE ended IS NULL AND lease_until < now() AND owner <> %s"
                " AND EXISTS (SELECT 1 FROM daemons me WHERE me.owner = %s AND me.ended IS NULL"
                " AND me.lease_until > now()) RETURNING owner, host, pid",
                (nonce, self.owner, self.owner),
            ).fetchall()
            self.reaped.update({r[0]: (r[1], r[2]) for r in rows})
            owners = sorted(r[0] for r in rows)
            if owners:
                cur.execute(
                    "UPDATE slots SET owner = NULL, nonce = NULL, taken = NULL WHERE owner = ANY(%s)", (owners,)
                )
            return owners

        def resolve(cur: Cur) -> Found[list[str]] | None:
            rows = cur.execute(
                "SELECT owner, host, pid FROM daemons WHERE ended_by = %s ORDER BY owner", (nonce,)
            ).fetchall()
            self.reaped.update({r[0]: (r[1], r[2]) for r in rows})
            return Found([r[0] for r in rows]) if rows else None

        owners = self.runner.run("reap", body, resolve)
        self._ended.update(owners)
        return owners

    def declared_lost(self, owner: str, host: str, pid: int) -> None:
        """Note and log a daemon this one declared lost outside ``reap`` (adopting its job): ``host.lost``, once."""
        if owner in self._ended:
            return
        self._ended.add(owner)
        self.reaped[owner] = (host, pid)
        log.warning("host.lost", owner=owner, host=host, pid=pid)

    def stop(self) -> None:
        """Give this daemon's slots back and mark it stopped (a clean end: never reported lost)."""
        if self.closed:
            return
        self.closed = True
        if self.owner and not self.lost and not self.silent:

            def body(cur: Cur) -> None:
                cur.execute("UPDATE slots SET owner = NULL, nonce = NULL, taken = NULL WHERE owner = %s", (self.owner,))
                cur.execute(
                    "UPDATE daemons SET ended = 'stopped', ended_at = now(), lease_until = least(lease_until, now())"
                    " WHERE owner = %s AND ended IS NULL",
                    (self.owner,),
                )

            try:
                self.runner.run("close", body, write=True, patience_s=min(5.0, self.lease_s / 3))
            except (LedgerUnavailable, psycopg.Error) as exc:
                log.warning("ledger.close_failed", error=str(exc), owner=self.owner)
        # a renewal hung in a connect to a silent server holds the lock until its timeout: not waited for (the
        # process ends; its connection with it)
        if self._lock.acquire(blocking=not self.silent):
            try:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
            finally:
                self._lock.release()

    # -- others -----------------------------------------------------------------------------
    def alive(self, owner: str) -> bool:
        """True while ``owner``'s lease runs (database clock) and it was not marked ended."""
        if not owner:
            return False
        if owner == self.owner:
            return not self.lost
        if owner in self._ended:
            return False
        seen = self._live_seen.get(owner)
        if seen is not None and time.monotonic() - seen < min(1.0, self.lease_s / 10):
            return True
        row = self.runner.run(
            "alive",
            lambda cur: cur.execute(
                "SELECT ended IS NOT NULL, lease_until > now() FROM daemons WHERE owner = %s", (owner,)
            ).fetchone(),
        )
        if row is None:
            return False
        if row[0]:
            self._ended.add(owner)
            return False
        if row[1]:
            self._live_seen[owner] = time.monotonic()
            return True
        self._live_seen.pop(owner, None)
        return bool(self.owner) and not self.may_adopt()  # a daemon just back from an outage waits (a command not)

    def stopped_cleanly(self, owner: str) -> bool:
        """True if ``owner``'s row says it ended by a clean stop ('stopped'), not declared lost."""
        row = self.runner.run(
            "stopped", lambda cur: cur.execute("SELECT ended FROM daemons WHERE owner = %s", (owner,)).fetchone()
        )
        return row is not None and row[0] == "stopped"

    def daemons(self) -> list[DaemonInfo]:
        """Every daemon that ever registered, newest first, alive by the database's clock."""
        rows = self.runner.run(
            "daemons",
            lambda cur: cur.execute(
                "SELECT owner, pid, host, started, ended IS NULL AND lease_until > now(), config_digest FROM daemons"
                " ORDER BY started DESC, owner"
            ).fetchall(),
        )
        return [DaemonInfo(r[0], r[1], r[2], r[3], bool(r[4]), r[5]) for r in rows]

    def record_config(self, digest: str | None) -> None:
        """Record the digest of the config this daemon loaded in its row."""
        owner = self.owner
        self.runner.run(
            "record_config",
            lambda cur: cur.execute("UPDATE daemons SET config_digest = %s WHERE owner = %s", (digest, owner)),
            write=True,
        )

    # -- slots ------------------------------------------------------------------------------
    def take_slot(self, agent: str, concurrency: int) -> int | None:
        """Take a free slot (agent, n < concurrency) with FOR UPDATE SKIP LOCKED; None if all are busy (or a live
        daemon holds a slot at or beyond concurrency: a reload lowered it while that copy ran)."""
        if concurrency < 1:
            return None
        nonce = self.nonce()
        took: list[int] = []

        def body(cur: Cur) -> int | None:
            took.clear()
            if not self.check(cur, lease=True):
                return None
            if (agent, concurrency) not in self._slot_rows:
                cur.execute(
                    "INSERT INTO slots (agent, n) SELECT %s, g FROM generate_series(0, %s - 1) AS g"
                    " ON CONFLICT DO NOTHING",
                    (agent, concurrency),
                )
            row = cur.execute(
                "SELECT s.n FROM slots s WHERE s.agent = %s AND s.n < %s AND (s.owner IS NULL OR NOT EXISTS"
                " (SELECT 1 FROM daemons d WHERE d.owner = s.owner AND d.ended IS NULL))"
                # a reload lowered concurrency while copies ran on slots at or beyond it: none starts beside them
                " AND NOT EXISTS (SELECT 1 FROM slots h JOIN daemons d ON d.owner = h.owner AND d.ended IS NULL"
                " WHERE h.agent = %s AND h.n >= %s)"
                " ORDER BY s.n LIMIT 1 FOR UPDATE OF s SKIP LOCKED",
                (agent, concurrency, agent, concurrency),
            ).fetchone()
            if row is None:
                return None
            cur.execute(
                "UPDATE slots SET owner = %s, nonce = %s, taken = now() WHERE agent = %s AND n = %s",
                (self.owner, nonce, agent, row[0]),
            )
            took.append(int(row[0]))
            return took[0]

        def resolve(cur: Cur) -> Found[int | None] | None:
            if not took:
                return Found(None)
            row = cur.execute(
                "SELECT n FROM slots WHERE agent = %s AND owner = %s AND nonce = %s", (agent, self.owner, nonce)
            ).fetchone()
            return Found(int(row[0])) if row else None

        slot = self.runner.run("take_slot", body, resolve)
        self._slot_rows.add((agent, concurrency))
        return slot

    def free_slot(self, agent: str, slot: int) -> None:
        """Give a slot back (only if this daemon holds it); idempotent."""
        self.runner.run(
            "free_slot",
            lambda cur: cur.execute(
                "UPDATE slots SET owner = NULL, nonce = NULL, taken = NULL WHERE agent = %s AND n = %s AND owner = %s",
                (agent, slot, self.owner),
            ),
            write=True,
        )
