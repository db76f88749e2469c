"""The shared ledger: one PostgreSQL database for every daemon on every host (contract section 12).

Same meaning as the SQLite engine, method by method (``sqlite.py`` is the
reference); what differs is how it is made safe across hosts:

- Every claim, finish and follow-up step is one short transaction. A claim is
  ``INSERT ... ON CONFLICT DO NOTHING`` on the job id (the primary key refuses a
  duplicate); take-overs and released follow-ups are conditional UPDATEs on the
  row's token, under ``SELECT ... FOR UPDATE``.
- Liveness is a lease in ``daemons``, renewed on the database's clock
  (``now()``). A daemon is alive while its lease runs and no one marked it
  ended. Nothing here touches the filesystem (the root may be on NFS).
- Fencing: every finishing step carries the claim's token, and refuses
  (False / None) when the token moved on or this daemon was declared lost.
  Steps that take something new (claim, adopt, retry, slot) also need this
  daemon's lease to be running in the database's eyes.
- Connection loss, timeouts and conflicts are waited out (``pg_runner.Runner``);
  an unknown commit outcome is settled by the server's record of the
  transaction, checked against the rows the step meant to write.

What the daemon must call for its lease: ``pg_leases``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import structlog
from filelock import FileLock, Timeout

from dispatcher.errors import UsageError
from dispatcher.layout import Layout

try:
    import psycopg
except ImportError:  # the optional extra is not installed: say so in one line (open_ledger imports this lazily)
    raise UsageError(
        "ledger: postgresql:// needs psycopg 3; install folder-dispatcher[postgres] (pip install 'psycopg[binary]')"
    ) from None
from dispatcher.ledger import pg_bulk, pg_schema
from dispatcher.ledger.base import Leases as LeasesInterface
from dispatcher.ledger.base import Ledger
from dispatcher.ledger.flocks import make_lock
from dispatcher.ledger.pg_claims import Claims
from dispatcher.ledger.pg_conn import SILENT_S, Conn, Pool, PostgresLedgerError, describe, make_conninfo, permanent
from dispatcher.ledger.pg_finish import Followups
from dispatcher.ledger.pg_gates import Gates
from dispatcher.ledger.pg_leases import LeaseLost, Leases
from dispatcher.ledger.pg_requests import Requests
from dispatcher.ledger.pg_runner import Runner
from dispatcher.ledger.pg_waits import Waits
from dispatcher.ledger.records import (
    Child,
    ClaimAnswer,
    ClaimRequest,
    DaemonInfo,
    Entry,
    Extras,
    Finish,
    Gate,
    Request,
    Wait,
)
from dispatcher.ledger.releasers import holder_gone
from dispatcher.lifecycle import Row

__all__ = ["LeaseLost", "PostgresLedger", "PostgresLedgerError"]

log = structlog.get_logger("dispatcher")


class PostgresLedger(Ledger, LeasesInterface):
    """A handle on a PostgreSQL ledger; safe to share between threads (a small connection pool)."""

    def __init__(
        self,
        url: str,
        layout: Layout | None = None,
        *,
        lease_s: float = 30.0,
        patience_s: float | None = None,
        connect_timeout_s: int | None = None,
        answer_by: float | None = None,
        readonly: bool = False,
        give_up: Callable[[], bool] | None = None,
        cut_silent: bool = True,
    ) -> None:
        """Connect, create or check the schema; raise PostgresLedgerError (one line) if it cannot be used.

        ``layout``: a daemon that registers also holds its liveness flock in the root's
        ``.state/daemons/``, so that `ledger migrate` and `rebuild` there see it alive.
        ``patience_s`` bounds how long a step waits for an unreachable database
        (None: forever, as a daemon does; then ``LedgerUnavailable``); ``connect_timeout_s``
        bounds each connection attempt (a command's; a daemon's follows the lease), and
        ``answer_by`` (monotonic seconds) ends the attempts before the first connection there.
        ``readonly`` (`status`, `list`, `show`) never creates or changes the schema and
        runs every transaction read-only: a role with SELECT alone is enough
        (``pg_schema.NoSchema`` when no daemon has made the ledger yet). ``give_up`` ends a wait
        early (then ``LedgerUnavailable`` too), from the first step on. A command's (``answer_by``)
        step that hears nothing from the server for ``SILENT_S`` is cut, unless ``cut_silent`` is False.
        """
        if not lease_s > 0:
            raise PostgresLedgerError(f"lease must be a positive number of seconds, not {lease_s}")
        self.where = describe(url)
        self.lease_s = float(lease_s)
        self._layout = layout
        self._root_life: FileLock | None = None
        if give_up is not None:
            self.set_give_up(give_up)
        conninfo = make_conninfo(url, self.lease_s, connect_timeout_s, readonly=readonly)
        # a command's steps are cut once the server is silent for SILENT_S: it answers within 5 s (section 12)
        self._pool = Pool(
            conninfo, size=4, deadline=answer_by, silent_s=SILENT_S if answer_by is not None and cut_silent else None
        )
        self._runner = Runner(self._pool, self.where, self.giving_up, patience_s)
        self._leases = Leases(self._runner, conninfo, self.lease_s)
        self._claims = Claims(self._runner, self._leases)
        self._followups = Followups(self._runner, self._leases)
        self._waits = Waits(self._runner, self._leases)
        self._gates = Gates(self._runner)
        self._requests = Requests(self._runner)
        try:
            patient = patience_s is None  # a daemon; a command answers in its time (section 12)
            step = pg_schema.check if readonly else functools.partial(pg_schema.ensure, patient=patient)
            self._runner.run("schema", lambda cur: step(cur, self.where), fatal=permanent)
            if not readonly:
                self._runner.choose_crash_marker()
        except psycopg.Error as exc:  # not a wait: a missing privilege, an unusable database
            self._pool.close()
            if readonly:
                text = " ".join(str(exc).split())
                raise PostgresLedgerError(f"{self.where}: the ledger cannot be read: {text}") from None
            text = " ".join(str(exc).split())
            raise PostgresLedgerError(f"{self.where}: the ledger schema cannot be set up: {text}") from None
        except BaseException:
            self._pool.close()
            raise

    @property
    def patience_s(self) -> float | None:
        """How long a step waits for an unreachable database (None: forever)."""
        return self._runner.patience_s

    @patience_s.setter
    def patience_s(self, value: float | None) -> None:
        self._runner.patience_s = value

    @property
    def before_commit(self) -> Callable[[Conn], None] | None:
        """Test hook: called with the connection right before each COMMIT is sent."""
        return self._runner.before_commit

    @before_commit.setter
    def before_commit(self, hook: Callable[[Conn], None] | None) -> None:
        self._runner.before_commit = hook

    def close(self) -> None:
        """Give this daemon's slots back, mark it stopped (alive no more) and close the connections."""
        self._leases.stop()
        self._pool.close()
        if self._root_life is not None:
            self._root_life.release()

    def sever_stuck(self, older_than_s: float) -> int:
        """Cut the steps and the lease renewal hung for longer than older_than_s (``Pool.sever``).

        Once a call was cut, ``close`` no longer marks this daemon stopped in the database:
        a silent server would hold that last step too (a connect waits out its timeout, more
        than once). Its lease then runs out, and it is treated as a daemon that died.
        """
        cut = self._pool.sever(older_than_s) + self._leases.sever(older_than_s)
        if cut:
            self._leases.silent = True
        return cut

    # -- liveness (pg_leases) ---------------------------------------------------------------
    def register(self, info: DaemonInfo) -> None:
        """Insert this daemon's row under a new identity with a lease of ``lease_s``; never reuse one."""
        self._leases.register(info)
        self.owner = info.owner
        if self._layout is not None:  # seen on the root by commands that read no PostgreSQL (section 12)
            lock = make_lock(self._layout.daemons / f"{info.owner}.lock")
            try:
                self._layout.daemons.mkdir(parents=True, exist_ok=True)
                lock.acquire()
            except (OSError, Timeout):  # a root whose filesystem gives no locks: the lease alone tells
                return
            self._root_life = lock

    @property
    def leases(self) -> LeasesInterface:
        """This ledger itself: a daemon's liveness here is a lease renewed in the database."""
        return self

    def renew(self) -> bool:
        """Renew the lease to the database's now() + lease (one try, own connection); False if it failed.

        Call it every lease/6 s (the contract's floor is lease/3) and again soon after a False.
        """
        return self._leases.renew()

    def lease_ok(self) -> bool:
        """Return False once the last successful renewal is lease/2 old (local monotonic clock).

        Then end the agents' groups and claim nothing until it is True again.
        """
        return self._leases.lease_ok()

    def ok_for_s(self) -> float | None:
        """Return how long ``lease_ok`` stays True if no renewal succeeds meanwhile (None: not ok now)."""
        return self._leases.ok_for_s()

    @property
    def lost(self) -> bool:
        """True once another daemon declared this one lost: its identity is dead for good (restart)."""
        return self._leases.lost

    def may_reap(self) -> bool:
        """Return True once this daemon has renewed its own lease without a gap for a full lease."""
        return self._leases.may_reap()

    def reap(self) -> list[str]:
        """Mark daemons whose lease ran out as lost (one idempotent UPDATE), free their slots.

        Return the owners this call newly marked (log ``host.lost`` for each: two
        reapers at once never both get one); [] until ``may_reap()``.
        """
        return self._leases.reap()

    def lost_daemon(self, owner: str) -> tuple[str, int] | None:
        """Return the host and pid of a daemon ``reap`` found dead, as its row says (None when unknown)."""
        return self._leases.reaped.get(owner)

    def alive(self, owner: str) -> bool:
        """Return True while ``owner``'s lease runs (database clock) and it was not marked ended."""
        return self._leases.alive(owner)

    def stopped_cleanly(self, owner: str) -> bool:
        """Return True if ``owner`` marked itself stopped at a clean stop (its row's ``ended``), not lost."""
        return self._leases.stopped_cleanly(owner)

    def daemons(self) -> list[DaemonInfo]:
        """Return every daemon that ever registered on this ledger, newest first."""
        return self._leases.daemons()

    def record_config(self, digest: str | None) -> None:
        """Record the digest of the config this daemon loaded in its row."""
        self._leases.record_config(digest)

    def take_slot(self, agent: str, concurrency: int) -> int | None:
        """Take a free slot of agent over every daemon (FOR UPDATE SKIP LOCKED); None if all are busy.

        A slot is free when no one holds it or its holder has ended (stopped, or
        declared lost by ``reap``). A slot whose holder only let its lease run out
        stays taken until that holder is reaped, so that a daemon back from a
        database outage never finds its running agent's slot given away.
        """
        return self._leases.take_slot(agent, concurrency)

    def free_slot(self, agent: str, slot: int) -> None:
        """Give a slot back (only if this daemon holds it)."""
        self._leases.free_slot(agent, slot)

    # -- reads --------------------------------------------------------------------------
    def get(self, job_id: str) -> Entry | None:
        """Return the row of job_id, or None if the id was never seen."""
        row = self._runner.run(
            "get", lambda cur: cur.execute(pg_bulk.SELECT + " WHERE job_id = %s", (job_id,)).fetchone()
        )
        return pg_bulk.entry(row) if row else None

    def known(self, job_ids: Iterable[str]) -> dict[str, Entry]:
        """Return the rows of those ids that the ledger knows."""
        ids = list(job_ids)
        if not ids:
            return {}
        rows = self._runner.run(
            "known",
            lambda cur: cur.execute(pg_bulk.SELECT + " WHERE job_id = ANY(%s)", (ids,)).fetchall(),
        )
        return {r[0]: pg_bulk.entry(r) for r in rows}

    def children(self, job_id: str) -> list[str]:
        """Return the follow-up ids whose parent is job_id, in id order."""
        rows = self._runner.run(
            "children",
            lambda cur: cur.execute("SELECT job_id FROM jobs WHERE parent = %s ORDER BY job_id", (job_id,)).fetchall(),
        )
        return [r[0] for r in rows]

    def in_state(self, *states: Row) -> list[Entry]:
        """Return the rows in any of these states."""
        names = [str(s) for s in states]
        rows = self._runner.run(
            "in_state",
            lambda cur: cur.execute(pg_bulk.SELECT + " WHERE state = ANY(%s)", (names,)).fetchall(),
        )
        return [pg_bulk.entry(r) for r in rows]

    def count(self) -> int:
        """Return how many job ids the ledger holds."""
        row = self._runner.run("count", lambda cur: cur.execute("SELECT count(*) FROM jobs").fetchone())
        return int(row[0]) if row else 0

    def is_empty(self) -> bool:
        """Return True if the ledger holds no job id (without counting them)."""
        return self._runner.run("is_empty", lambda cur: cur.execute("SELECT 1 FROM jobs LIMIT 1").fetchone()) is None

    def rows(self) -> Iterator[Entry]:
        """Yield every row, in id order (pages of a few thousand; no connection held between pages)."""
        after: str | None = None
        while True:
            page = self._runner.run("rows", functools.partial(pg_bulk.page, after))
            yield from (pg_bulk.entry(r) for r in page)
            if len(page) < pg_bulk.PAGE:
                return
            after = page[-1][0]

    # -- claims (pg_claims) -----------------------------------------------------------------
    def claim(self, requests: Sequence[ClaimRequest]) -> list[ClaimAnswer]:
        """Claim many ids in one transaction (see ``Ledger.claim``).

        Raise LeaseLost (a LedgerUnavailable) when this daemon's lease has run out
        in the database's eyes, or it was declared lost: it may not claim now.
        """
        return self._claims.claim(requests)

    def unclaim(self, job_id: str, token: int, previous: str | None, previous_owner: str | None = None) -> None:
        """Undo a claim whose job folder could not be put in place (nothing ran); fenced by token."""
        self._claims.unclaim(job_id, token, previous, previous_owner)

    def adopt(self, job_id: str, expected_owner: str | None, expected_token: int) -> int | None:
        """Take over a claimed job of a dead daemon; return the new token, or None if another won."""
        return self._claims.adopt(job_id, expected_owner, expected_token)

    def take_retry(self, job_id: str, kind: Request = Request.RETRY) -> int | None:
        """Turn a failed (or reviewed, for `revise`) job into a claim by this daemon; return the token."""
        return self._claims.take_retry(job_id, kind)

    def reconcile(self, job_id: str, agent: str | None, parent: str | None, hops: int) -> bool:
        """Put back the claim row of a job folder found in active/ without one (a lost commit)."""
        return self._claims.reconcile(job_id, agent, parent, hops)

    # -- finishing (pg_finish) ----------------------------------------------------------------
    def finish(self, items: Sequence[Finish]) -> list[bool]:
        """Record ends in one transaction; False for each item whose claim was taken over."""
        return self._followups.finish(items)

    def reserve(self, parent: str, token: int, hops: int, children: Sequence[Child]) -> list[str] | None:
        """Reserve follow-ups of parent; return the ids already taken ([] = all reserved), None if fenced."""
        return self._followups.reserve(parent, token, hops, children)

    def pending_releases(self, parent: str | None = None) -> list[Entry]:
        """Return reserved follow-ups whose parent is done; ``owner`` is the parent's owner."""
        return self._followups.pending_releases(parent)

    def set_digest(self, job_id: str, digest: str) -> None:
        """Record the digest a reserved follow-up will be released with (before its file exists)."""
        self._followups.set_digest(job_id, digest)

    def take_release(self, job_id: str, digest: str, releaser: str) -> bool:
        """Take the turn to release a reserved follow-up (see ``Ledger.take_release``)."""
        held = self._followups.release_holder(job_id)
        if held is None:
            return False
        holder, since = held
        if holder not in (None, releaser) and not holder_gone(holder, self.alive, since, time.time()):
            return False
        return self._followups.take_release(job_id, digest, releaser, holder)

    def mark_released(self, job_id: str, source: str, digest: str, *, held: bool = False) -> bool:
        """Record that a reserved follow-up's file is in inbox/ (or held/) under source."""
        return self._followups.mark_released(job_id, source, digest, held=held)

    def set_state(self, job_id: str, state: Row, *, expect: Row) -> bool:
        """Move a row from one open state to another (hold, release of a held follow-up)."""
        return self._followups.set_state(job_id, state, expect=expect)

    # -- joins (pg_waits) ----------------------------------------------------------------------
    def wait(self, job_id: str, token: int, after: Sequence[str], rule: str) -> bool:
        """Turn this daemon's claim into a wait for ``after`` (no owner); False if the token moved on."""
        return self._waits.wait(job_id, token, after, rule)

    def waits(self, job_ids: Iterable[str] | None = None) -> list[Wait]:
        """Return the waits recorded for these ids (None: of every job in state waiting)."""
        return self._waits.waits(job_ids)

    def waiting_on(self, parents: Iterable[str], *, any_state: bool = False) -> list[str]:
        """Return the ids of waiting jobs that name any of ``parents`` (``any_state``: whatever their state)."""
        return self._waits.waiting_on(parents, any_state=any_state)

    def take_waiting(self, job_id: str) -> int | None:
        """Turn a waiting job into a claim by this daemon; return the new token, None if another won."""
        return self._waits.take_waiting(job_id)

    # -- requests (pg_requests) ----------------------------------------------------------------
    def request(self, job_id: str, kind: Request) -> None:
        """Record a request for a daemon to carry out."""
        self._requests.request(job_id, kind)

    def requests(self, kind: Request) -> list[str]:
        """Return the job ids with an open request of this kind, oldest first."""
        return self._requests.requests(kind)

    def clear_request(self, job_id: str, kind: Request, *, drop_reserved: bool = False) -> None:
        """Mark a request as carried out (``Ledger.clear_request``)."""
        self._requests.clear_request(job_id, kind, drop_reserved=drop_reserved)

    # -- gates and waits (pg_gates) ----------------------------------------------------------
    def set_gate(self, gate: Gate, *, at: float) -> bool:
        """Gate an agent (a later ``until`` of the same kind wins, with its reason); return True if none of that
        kind held."""
        return self._gates.set_gate(gate, at=at)

    def lift_gates(
        self, agent: str | None = None, *, kind: str | None = None, expired_at: float | None = None
    ) -> list[Gate]:
        """Remove every gate of ``agent`` (of ``kind``), or those whose time has come; return them."""
        return self._gates.lift_gates(agent, kind=kind, expired_at=expired_at)

    def gates(self) -> list[Gate]:
        """Return every gate recorded, by agent."""
        return self._gates.gates()

    def set_gate_wait(self, job_id: str, agent: str, until: float | None) -> None:
        """Record that a claimed job waits for a gate."""
        self._gates.set_gate_wait(job_id, agent, until)

    def clear_gate_wait(self, job_id: str) -> None:
        """Record that a job no longer waits."""
        self._gates.clear_gate_wait(job_id)

    def gate_waits(self) -> dict[str, float | None]:
        """Return the waiting jobs with the time each waits for."""
        return self._gates.gate_waits()

    def note_spend(self, job_id: str, token: int, cost_usd: float) -> None:
        """Record a running job's cost so far (a daily cap's window)."""
        self._gates.note_spend(job_id, token, cost_usd)

    def costs_since(self, since: float) -> list[tuple[float, str, float]]:
        """Return (finished, agent, cost_usd) of the jobs that finished since ``since``."""
        return self._gates.costs_since(since)

    # -- bulk (pg_bulk) ----------------------------------------------------------------------
    def load_rows(self, entries: Iterable[Entry]) -> int:
        """Insert rows as they are, keeping rows the ledger already has; return how many were new."""
        return pg_bulk.load_rows(self._runner, entries)

    def load_into_empty(self, entries: Iterable[Entry], more: Extras | None = None) -> int:
        """Copy rows and the rest (requests, waits, gates) into this ledger if it holds no job id (else error)."""
        return pg_bulk.load_into_empty(self._runner, entries, more)

    def extras(self) -> Extras:
        """Return every open request, join wait, gate and gate wait."""
        return pg_bulk.extras(self._runner)
