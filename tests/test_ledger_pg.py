"""The PostgreSQL ledger on a real server: races, leases, fencing, schema, outages, unknown commits, migrate.

No mocks: every test talks to the session's throwaway PostgreSQL server (``pg_fixtures``),
each in a fresh database. Faults are real: an immediate server restart, a backend
terminated right before COMMIT, and a TCP proxy that loses a COMMIT or its answer.
The contract shared with SQLite is in ``test_ledger_contract.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import structlog
from netns import Hosts
from pgserver import PgServer
from tcp_proxy import Proxy

from dispatcher.errors import UsageError
from dispatcher.ledger import pg_schema
from dispatcher.ledger.base import (
    Busy,
    Child,
    Claimed,
    ClaimRequest,
    DaemonInfo,
    Entry,
    Finish,
    Gate,
    GateKind,
    Known,
    LedgerUnavailable,
    Request,
)
from dispatcher.ledger.migrate import migrate
from dispatcher.ledger.postgres import LeaseLost, PostgresLedger, PostgresLedgerError
from dispatcher.ledger.sqlite import SqliteLedger
from dispatcher.lifecycle import Row

pytestmark = pytest.mark.postgres
pytest_plugins = ["pg_fixtures"]

LEASE = 2.0  # seconds: short, so that lease tests take a few seconds


class Ledgers:
    """Opens ledgers on one database and closes them all at the end."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.made: list[PostgresLedger] = []

    def open(self, dsn: str | None = None, **kw: Any) -> PostgresLedger:
        kw.setdefault("lease_s", 30.0)
        kw.setdefault("patience_s", 30.0)
        led = PostgresLedger(dsn or self.dsn, None, **kw)
        self.made.append(led)
        return led

    def daemon(self, owner: str, dsn: str | None = None, **kw: Any) -> PostgresLedger:
        led = self.open(dsn, **kw)
        led.register(DaemonInfo(owner, os.getpid(), f"host-{owner}", time.time()))
        return led

    def close(self) -> None:
        for led in self.made:
            with contextlib.suppress(Exception):
                led.close()


@pytest.fixture
def ledgers(pg_db: str) -> Iterator[Ledgers]:
    """Yield a Ledgers factory on a fresh database."""
    made = Ledgers(pg_db)
    try:
        yield made
    finally:
        made.close()


def sql(dsn: str, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run one statement on its own connection; return its rows (if any)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(statement, params)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []


def req(job_id: str, source: str | None = None, digest: str = "d") -> ClaimRequest:
    """A claim request for the file ``<job_id>.yaml``."""
    return ClaimRequest(job_id, "w", source or f"{job_id}.yaml", digest)


def eventually(predicate: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    """Poll predicate until it returns something truthy; fail after timeout."""
    end = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < end, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)
    return value


class Renewer:
    """Renews some ledgers' leases every lease/6 s in a thread, as a daemon would."""

    def __init__(self, *leds: PostgresLedger) -> None:
        self.leds = list(leds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(LEASE / 6):
            for led in list(self.leds):
                led.renew()

    def __enter__(self) -> Renewer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def snapshot(dsn: str) -> list[tuple[Any, ...]]:
    """Every job row and slot, for "nothing changed" checks."""
    return sql(dsn, "SELECT * FROM jobs ORDER BY job_id") + sql(dsn, "SELECT agent, n, owner FROM slots ORDER BY 1, 2")


# -- claims across daemons ------------------------------------------------------------------


def test_two_daemons_racing_for_200_ids_claim_each_exactly_once(ledgers: Ledgers) -> None:
    """Two ledgers claiming the same 200 ids from two threads (with readers beside): each id claimed once."""
    a, b = ledgers.daemon("A"), ledgers.daemon("B")
    ids = [f"R{i:03d}" for i in range(200)]
    won: dict[str, list[str]] = {"A": [], "B": []}
    errors: list[BaseException] = []
    start = threading.Barrier(4)
    done = threading.Event()

    def claimer(led: PostgresLedger, order: list[str]) -> None:
        try:
            start.wait()
            for i in range(0, len(order), 5):  # batches of 5, as the intake sends them
                batch = order[i : i + 5]
                for job_id, answer in zip(batch, led.claim([req(j) for j in batch]), strict=True):
                    if isinstance(answer, Claimed):
                        assert answer.token == 1
                        won[led.owner].append(job_id)
                    else:
                        assert isinstance(answer, Busy | Known)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    def reader(led: PostgresLedger) -> None:  # reads from other threads share the pool
        try:
            start.wait()
            while not done.is_set():
                led.get(ids[0])
                led.known(ids[:20])
                led.alive("A")
                led.daemons()
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    threads = [
        threading.Thread(target=claimer, args=(a, ids)),
        threading.Thread(target=claimer, args=(b, ids[::-1])),
        threading.Thread(target=reader, args=(a,)),
        threading.Thread(target=reader, args=(b,)),
    ]
    for t in threads:
        t.start()
    for t in threads[:2]:
        t.join(120)
    done.set()
    for t in threads[2:]:
        t.join(30)
    assert not errors, errors
    assert sorted(won["A"] + won["B"]) == ids
    rows = sql(ledgers.dsn, "SELECT job_id, owner, token FROM jobs ORDER BY job_id")
    assert [r[0] for r in rows] == ids
    assert all((r[1] == "A") == (r[0] in set(won["A"])) and r[2] == 1 for r in rows)


# -- leases ---------------------------------------------------------------------------------


def test_a_daemon_that_stops_renewing_is_reaped_after_the_lease(ledgers: Ledgers) -> None:
    """A silent daemon is alive until its lease runs out, then one reap marks it lost; its slots are freed."""
    started = time.monotonic()  # before A's one and only renewal: its lease counts from there
    a = ledgers.daemon("A", lease_s=LEASE)
    b = ledgers.daemon("B", lease_s=LEASE)
    assert a.take_slot("w", 1) == 0
    with Renewer(b):
        assert b.alive("A")
        assert b.take_slot("w", 1) is None
        eventually(lambda: not b.alive("A"), "A's lease to run out")
        assert time.monotonic() - started >= LEASE * 0.9
        # lease run out but not yet reaped: its slot stays taken (it may be back in a moment)
        assert b.take_slot("w", 1) is None
        owners = eventually(b.reap, "B to reap A")
    assert owners == ["A"]
    assert b.reap() == []  # marked once
    assert b.take_slot("w", 1) == 0  # A's slot was freed
    assert {d.owner: d.alive for d in b.daemons()} == {"A": False, "B": True}
    assert sql(ledgers.dsn, "SELECT ended, ended_by LIKE 'B:%%' FROM daemons WHERE owner = 'A'") == [("lost", True)]


def test_two_reapers_at_once_mark_a_lost_daemon_once(ledgers: Ledgers) -> None:
    """Two daemons reaping at the same moment: exactly one of them gets the lost owner."""
    ledgers.daemon("A", lease_s=LEASE)
    b = ledgers.daemon("B", lease_s=LEASE)
    c = ledgers.daemon("C", lease_s=LEASE)
    with Renewer(b, c):
        eventually(lambda: b.may_reap() and c.may_reap() and not b.alive("A"), "both reapers ready")
        gate = threading.Barrier(2)
        got: dict[str, list[str]] = {}

        def reap(led: PostgresLedger) -> None:
            gate.wait()
            got[led.owner] = led.reap()

        threads = [threading.Thread(target=reap, args=(led,)) for led in (b, c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert sorted(got["B"] + got["C"]) == ["A"]


def test_a_reaper_that_has_not_renewed_for_a_full_lease_reaps_nothing(ledgers: Ledgers) -> None:
    """A fresh daemon, or one whose renewals had a gap, reaps nobody until it renewed for a full lease."""
    ledgers.daemon("A", lease_s=LEASE)
    b = ledgers.daemon("B", lease_s=LEASE)
    eventually(lambda: not b.alive("A"), "A's lease to run out")
    c = ledgers.daemon("C", lease_s=LEASE)  # registered after A died: has not renewed for a lease yet
    assert not c.may_reap() and c.reap() == []
    c.close()  # a clean stop: never reported lost
    time.sleep(LEASE / 2 + 0.1)  # B's own renewals have a gap longer than lease/2
    assert b.renew()
    assert not b.may_reap() and b.reap() == []
    assert sql(ledgers.dsn, "SELECT ended FROM daemons WHERE owner = 'A'") == [(None,)]
    with Renewer(b):
        assert eventually(b.reap, "B to reap after a full lease of renewals") == ["A"]


def test_a_daemon_back_from_an_outage_takes_no_lapsed_daemon_for_dead_until_it_renewed_for_a_full_lease(
    ledgers: Ledgers,
) -> None:
    """Both leases lapse (an outage); B renews first: A, about to renew, is alive to B, which takes none of its jobs,
    until B has renewed for a full lease without a gap. B took A's jobs at its first renewal: jobs of a live daemon,
    failed as "its host was lost", with no host.lost."""
    a = ledgers.daemon("A", lease_s=LEASE)
    b = ledgers.daemon("B", lease_s=LEASE)
    assert isinstance(a.claim([req("J1")])[0], Claimed)
    time.sleep(LEASE + 0.3)  # neither renews: the database was out of reach
    assert b.renew()
    assert b.alive("A")  # lapsed, but B has just come back itself
    assert a.renew() and b.alive("A")
    assert ledgers.open().alive("A")  # a command reads the lease alone
    time.sleep(LEASE + 0.3)  # A silent again, now for good
    assert not ledgers.open().alive("A")
    with Renewer(b):
        assert b.alive("A")  # B's gap-free run is not a full lease old yet
        eventually(lambda: not b.alive("A"), "B to renew for a full lease", timeout=LEASE * 4)


def test_adopting_a_lapsed_daemons_job_declares_it_lost_so_it_never_renews(ledgers: Ledgers) -> None:
    """B adopts a job of A, whose lease lapsed and whom no one declared lost: A is declared lost in the same
    transaction (once), so it can never renew and start that job's agent again; one that renewed keeps its job."""
    a = ledgers.daemon("A", lease_s=LEASE)
    b = ledgers.daemon("B", lease_s=LEASE)
    assert a.claim([req("J1"), req("J2")]) == [Claimed("J1", 1), Claimed("J2", 1)]
    assert a.take_slot("w", 1) == 0
    with Renewer(b):
        eventually(lambda: not b.alive("A"), "A's lease to run out")
        assert b.adopt("J1", "A", 1) == 2
    assert sql(ledgers.dsn, "SELECT ended, ended_by LIKE 'B:%%' FROM daemons WHERE owner = 'A'") == [("lost", True)]
    assert not a.renew() and a.lost
    assert b.take_slot("w", 1) == 0  # its slots were freed with it
    assert b.adopt("J2", "A", 1) == 2  # already declared: taken as any dead daemon's job
    c = ledgers.daemon("C", lease_s=LEASE)
    d = ledgers.daemon("D", lease_s=LEASE)
    assert c.claim([req("K1")]) == [Claimed("K1", 1)]
    assert d.adopt("K1", "C", 1) is None  # C's lease runs: its job stays its own
    assert sql(ledgers.dsn, "SELECT ended FROM daemons WHERE owner = 'C'") == [(None,)]


def test_lease_ok_turns_false_after_half_a_lease_without_renewal(ledgers: Ledgers) -> None:
    """lease_ok() is True after a renewal and False once lease/2 passed without one; renew() restores it."""
    a = ledgers.daemon("A", lease_s=LEASE)
    assert a.lease_ok()
    time.sleep(LEASE / 4)
    assert a.lease_ok()
    time.sleep(LEASE / 4 + 0.1)
    assert not a.lease_ok()
    assert a.renew() and a.lease_ok()
    assert not ledgers.open().lease_ok()  # a command (no daemon) has no lease


def test_a_daemon_whose_lease_ran_out_claims_nothing_until_it_renews(ledgers: Ledgers) -> None:
    """With its lease run out in the database's eyes (not reaped), a claim raises LeaseLost; a renewal heals."""
    a = ledgers.daemon("A", lease_s=LEASE)
    assert isinstance(a.claim([req("J1")])[0], Claimed)
    time.sleep(LEASE + 0.2)
    with pytest.raises(LeaseLost):
        a.claim([req("J2")])
    assert a.take_slot("w", 1) is None
    assert a.finish([Finish("J1", 1, Row.DONE)]) == [True]  # nobody took J1 over: its token still holds
    assert a.renew()
    assert a.claim([req("J2")]) == [Claimed("J2", 1)]


# -- fencing --------------------------------------------------------------------------------


def test_a_reaped_daemon_changes_nothing_after_its_job_was_adopted(ledgers: Ledgers) -> None:
    """A claims, goes silent, B reaps and adopts: A's finish, reserve, release, unclaim and claims are refused."""
    a = ledgers.daemon("A", lease_s=LEASE)
    b = ledgers.daemon("B", lease_s=LEASE)
    assert a.claim([req("P")]) == [Claimed("P", 1)]
    assert a.reserve("P", 1, 1, [Child("C1", "w", "C1.json")]) == []
    assert a.take_slot("w", 2) == 0
    with Renewer(b):
        assert eventually(b.reap, "B to reap A") == ["A"]
    assert b.adopt("P", "A", 1) == 2
    before = snapshot(ledgers.dsn)
    # A comes back (a paused VM, a healed partition) and carries on with its old token
    assert a.finish([Finish("P", 1, Row.DONE)]) == [False]
    assert a.reserve("P", 1, 1, [Child("C2", "w", "C2.json")]) is None
    a.set_digest("C1", "sha")
    assert a.mark_released("C1", "C1@A.json", "sha") is False
    a.unclaim("P", 1, None)
    assert a.take_retry("P") is None and a.adopt("P", "B", 2) is None
    with pytest.raises(LeaseLost, match="declared lost"):
        a.claim([req("NEW")])
    assert a.take_slot("w", 2) is None
    a.free_slot("w", 0)
    assert snapshot(ledgers.dsn) == before
    assert not a.renew() and a.lost and not a.lease_ok()
    # B, holding the new token, finishes
    assert b.finish([Finish("P", 2, Row.DONE)]) == [True]


# A daemon on a simulated host: claims J, reserves C1, renews its lease, reports lease_ok/lost
# changes, and on "again" tries to carry on with its old token (one JSON line per event).
HOST_DAEMON = """
import json, os, sys, threading, time
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout is for events
from dispatcher.ledger.base import Child, ClaimRequest, DaemonInfo, Finish, LedgerUnavailable
from dispatcher.ledger.postgres import PostgresLedger
from dispatcher.lifecycle import Row
dsn, lease = sys.argv[1], float(sys.argv[2])
led = PostgresLedger(dsn, None, lease_s=lease, patience_s=None)
led.register(DaemonInfo("A", os.getpid(), "host-a", time.time()))
def out(**kw):
    print(json.dumps(kw), flush=True)
out(claim=type(led.claim([ClaimRequest("J", "w", "J.yaml", "d")])[0]).__name__,
    reserve=led.reserve("J", 1, 1, [Child("C1", "w", "C1.json")]))
def renew():
    while True:
        led.renew()
        time.sleep(lease / 6)
def watch():
    state = (True, False)
    while True:
        now = (led.lease_ok(), led.lost)
        if now != state:
            out(lease_ok=now[0], lost=now[1], at=time.monotonic())
            state = now
        time.sleep(0.05)
threading.Thread(target=renew, daemon=True).start()
threading.Thread(target=watch, daemon=True).start()
for line in sys.stdin:
    res = {"finish": led.finish([Finish("J", 1, Row.DONE)]),
           "reserve": led.reserve("J", 1, 1, [Child("C2", "w", "C2.json")])}
    led.set_digest("C1", "sha")
    res["released"] = led.mark_released("C1", "C1@A.json", "sha")
    try:
        led.claim([ClaimRequest("NEW", "w", "NEW.yaml", "d")])
        res["claim"] = "Claimed"
    except LedgerUnavailable as exc:
        res["claim"] = type(exc).__name__
    out(**res)
"""


def test_a_partitioned_daemon_fences_itself_and_changes_nothing_after_healing(
    pg_server: PgServer, hosts: Hosts, ledgers: Ledgers
) -> None:
    """A daemon cut off by a real partition loses lease_ok within lease/2; after B reaps and adopts, it is fenced."""
    lease = 3.0
    host = hosts.add()
    b = ledgers.daemon("B", lease_s=lease)
    dsn = ledgers.dsn.replace(f"@{pg_server.host}:", f"@{host.gateway}:")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = host.run(
        [sys.executable, "-c", HOST_DAEMON, dsn, str(lease)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdin is not None
    lines = proc.stdout

    def next_event() -> dict[str, Any]:
        line = lines.readline()
        assert line, f"the host daemon ended ({proc.poll()})"
        return json.loads(line)

    try:
        assert next_event() == {"claim": "Claimed", "reserve": []}
        with Renewer(b):
            time.sleep(lease / 3)  # a few renewals of A
            host.partition("drop")
            cut_at = time.monotonic()
            fenced = next_event()
            assert fenced["lease_ok"] is False and fenced["lost"] is False
            assert fenced["at"] - cut_at < lease / 2 + 1.0  # its last renewal came before the cut
            assert eventually(b.reap, "B to reap the cut-off A", timeout=30) == ["A"]
            assert b.adopt("J", "A", 1) == 2
            before = snapshot(ledgers.dsn)
            host.heal()
            assert next_event()["lost"] is True  # its first renewal after the heal learns it
            proc.stdin.write("again\n")
            proc.stdin.flush()
            tried = next_event()
        assert tried == {"finish": [False], "reserve": None, "released": False, "claim": "LeaseLost"}
        assert snapshot(ledgers.dsn) == before
        assert b.finish([Finish("J", 2, Row.DONE)]) == [True]
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait(10)


# -- schema ---------------------------------------------------------------------------------


def test_a_newer_schema_version_is_refused_with_one_line(ledgers: Ledgers) -> None:
    """A database whose schema_version is newer than the code knows is refused: one line, a UsageError."""
    ledgers.open()
    sql(ledgers.dsn, "UPDATE schema_version SET version = %s", (pg_schema.SCHEMA_VERSION + 1,))
    with pytest.raises(PostgresLedgerError) as caught:
        PostgresLedger(ledgers.dsn, None)
    text = str(caught.value)
    assert isinstance(caught.value, UsageError) and caught.value.exit_code == 2
    assert "\n" not in text and "newer than this dispatcher knows" in text and "upgrade" in text


def test_a_reader_of_an_older_schema_gets_one_line_saying_to_start_a_daemon(ledgers: Ledgers) -> None:
    """A reader (`status`, `list`: read-only) of a ledger whose schema an older release left gets one line, exit 2,
    saying a daemon of this version upgrades it; it failed later on a missing table, with a traceback. A daemon's
    open upgrades it, and the reader then reads it."""
    ledgers.open()
    sql(ledgers.dsn, "UPDATE schema_version SET version = %s", (pg_schema.SCHEMA_VERSION - 1,))
    with pytest.raises(PostgresLedgerError) as caught:
        PostgresLedger(ledgers.dsn, None, readonly=True)
    text = str(caught.value)
    assert caught.value.exit_code == 2 and "\n" not in text
    assert "is older than this dispatcher's" in text and "start a daemon of this version once" in text
    PostgresLedger(ledgers.dsn, None).close()  # a daemon's (or a writing command's) open: ensure() upgrades
    PostgresLedger(ledgers.dsn, None, readonly=True).close()


def test_a_database_with_foreign_tables_is_refused(ledgers: Ledgers) -> None:
    """A database that holds a `jobs` table but no schema_version is not taken for a ledger."""
    sql(ledgers.dsn, "CREATE TABLE jobs (id int)")
    with pytest.raises(PostgresLedgerError, match="no dispatcher schema_version"):
        PostgresLedger(ledgers.dsn, None)


def test_daemons_creating_the_schema_at_once_all_succeed(ledgers: Ledgers) -> None:
    """Four ledgers opened at the same moment on an empty database: all succeed, one schema, one version row."""
    gate = threading.Barrier(4)
    opened: list[PostgresLedger] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            gate.wait()
            opened.append(PostgresLedger(ledgers.dsn, None))
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ledgers.made += opened
    assert not errors and len(opened) == 4
    assert sql(ledgers.dsn, "SELECT version FROM schema_version") == [(pg_schema.SCHEMA_VERSION,)]


def test_a_bad_login_fails_at_once_with_one_line_and_no_password(pg_server: PgServer, ledgers: Ledgers) -> None:
    """A wrong password or database name is a one-line PostgresLedgerError, quickly, never showing the password."""
    bad = ledgers.dsn.replace(pg_server.password, "not-the-password")
    started = time.monotonic()
    with pytest.raises(PostgresLedgerError) as caught:
        PostgresLedger(bad, None)
    assert time.monotonic() - started < 10
    assert "password authentication failed" in str(caught.value) and "not-the-password" not in str(caught.value)
    with pytest.raises(PostgresLedgerError, match="does not exist"):
        PostgresLedger(ledgers.dsn.rsplit("/", 1)[0] + "/no_such_db", None)


def test_ids_sort_byte_by_byte_whatever_the_database_locale(pg_server: PgServer, tmp_path: Path) -> None:
    """In a database with a linguistic (ICU en-US) collation, rows() and children() still come in byte order."""
    name = f"icu_{os.getpid()}_{time.time_ns() % 10**6}"
    pg_server._sql(  # CREATE DATABASE with a locale needs the superuser
        f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C'"
        f" OWNER {pg_server.user}"
    )
    try:
        led = PostgresLedger(pg_server.dsn_for(database=name), None)
        try:
            ids = ["b", "B", "_x", "Z1", "a", "a.1", "a-1"]
            led.load_rows(Entry(j, "reserved", "w", None, 0, None, None, "P", 1, None, None, 1.0) for j in ids)
            assert [e.job_id for e in led.rows()] == sorted(ids)
            assert led.children("P") == sorted(ids)
        finally:
            led.close()
    finally:
        pg_server.drop_database(name)


def test_a_closed_ledger_refuses_at_once(ledgers: Ledgers) -> None:
    """After close() a call raises LedgerUnavailable at once instead of waiting for a connection."""
    led = ledgers.open(patience_s=None)
    led.close()
    started = time.monotonic()
    with pytest.raises(LedgerUnavailable, match="closed"):
        led.get("J1")
    assert time.monotonic() - started < 1


def test_a_role_without_privileges_gets_one_line(pg_server: PgServer, ledgers: Ledgers) -> None:
    """A role that may not create tables in the database is refused with one line naming the cause."""
    role = f"weak_{os.getpid()}"
    pg_server._sql(f"CREATE ROLE {role} LOGIN PASSWORD 'weak'")  # CREATE ROLE needs the superuser
    try:
        dsn = ledgers.dsn.replace(f"{pg_server.user}:{pg_server.password}@", f"{role}:weak@")
        with pytest.raises(PostgresLedgerError) as caught:
            PostgresLedger(dsn, None)
        assert "permission denied" in str(caught.value) and "\n" not in str(caught.value)
    finally:
        pg_server._sql(f"DROP ROLE {role}")


def test_a_role_that_may_only_read_gets_one_line_when_it_writes(pg_server: PgServer, ledgers: Ledgers) -> None:
    """A role granted SELECT only (a reader's login used for `retry`, say) is refused a write with one line naming
    the cause, a PostgresLedgerError (exit 2 in a command), not psycopg's traceback."""
    ledgers.open().close()  # the schema exists
    role = f"reader_{os.getpid()}"
    pg_server._sql(f"CREATE ROLE {role} LOGIN PASSWORD 'reader'")
    try:
        with psycopg.connect(ledgers.dsn, autocommit=True) as conn:  # in the ledger's own database
            conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
        dsn = ledgers.dsn.replace(f"{pg_server.user}:{pg_server.password}@", f"{role}:reader@")
        led = PostgresLedger(dsn, None, patience_s=5)
        try:
            assert led.get("J1") is None  # reading works
            with pytest.raises(PostgresLedgerError) as caught:
                led.request("J1", Request.RETRY)
            said = str(caught.value)
            assert "the ledger cannot be written: permission denied for table" in said and "\n" not in said
        finally:
            led.close()
    finally:
        with psycopg.connect(ledgers.dsn, autocommit=True) as conn:
            conn.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}")
        pg_server._sql(f"DROP ROLE {role}")


def test_without_psycopg_the_engine_says_what_to_install() -> None:
    """Importing the engine where psycopg is missing raises a one-line UsageError naming the extra."""
    code = (
        "import sys; sys.modules['psycopg'] = None\n"
        "from dispatcher.errors import UsageError\n"
        "try:\n    import dispatcher.ledger.postgres\nexcept UsageError as exc:\n    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert out.stdout.strip().startswith("ledger: postgresql:// needs psycopg 3; install folder-dispatcher[postgres]")


def test_connection_options_stay_below_the_lease(ledgers: Ledgers) -> None:
    """The session's timeouts follow the lease: statement lease/3, lock lease/6, idle in transaction lease/3."""
    led = ledgers.open(lease_s=30)
    with led._pool.connection() as conn:
        got = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")
        }
        assert conn.info.get_parameters()["keepalives_idle"] == "5"
        assert conn.info.get_parameters()["tcp_user_timeout"] == "10000"
    assert got == {"statement_timeout": "10s", "lock_timeout": "5s", "idle_in_transaction_session_timeout": "10s"}


# -- outages --------------------------------------------------------------------------------


def test_claims_survive_a_server_restart_without_loss_or_double(pg_server: PgServer, ledgers: Ledgers) -> None:
    """An immediate server restart amid claims from two threads: each id claimed once, every call done or raised."""
    patient = ledgers.daemon("A", patience_s=None)  # a daemon: waits as long as it takes
    hasty = ledgers.daemon("B", patience_s=0.5)  # a command: gives up quickly
    n = 150
    answers: dict[str, object] = {}
    raised: list[str] = []

    def loop(led: PostgresLedger, prefix: str) -> None:
        for i in range(n):
            job_id = f"{prefix}{i:03d}"
            try:
                answers[job_id] = led.claim([req(job_id)])[0]
            except LedgerUnavailable:
                raised.append(job_id)
            time.sleep(0.01)

    threads = [threading.Thread(target=loop, args=(patient, "A")), threading.Thread(target=loop, args=(hasty, "B"))]
    with structlog.testing.capture_logs() as logs:
        for t in threads:
            t.start()
        eventually(lambda: len(answers) >= 40, "some claims before the restart")
        pg_server.stop("immediate")
        time.sleep(1.5)  # down longer than the hasty ledger's patience, however fast the machine
        pg_server.start()
        for t in threads:
            t.join(180)
    assert all(answers.get(f"A{i:03d}") == Claimed(f"A{i:03d}", 1) for i in range(n))
    claimed_b = {j for j, a in answers.items() if j.startswith("B")}
    assert all(answers[j] == Claimed(j, 1) for j in claimed_b)
    assert raised and claimed_b | set(raised) == {f"B{i:03d}" for i in range(n)}
    rows = {r[0]: (r[1], r[2]) for r in sql(ledgers.dsn, "SELECT job_id, owner, token FROM jobs")}
    assert all(rows[f"A{i:03d}"] == ("A", 1) for i in range(n))
    assert all(rows[j] == ("B", 1) for j in claimed_b)
    assert all(rows.get(j, ("B", 1)) == ("B", 1) for j in raised)  # either it happened once, or not at all
    events = [e["event"] for e in logs]
    assert "ledger.reconnecting" in events and "ledger.reconnected" in events
    # the ids whose claim raised are not lost: the same file from the same daemon is its own (Busy) or new
    for job_id in raised:
        (again,) = hasty.claim([req(job_id)])
        assert again == Claimed(job_id, 1) if job_id not in rows else isinstance(again, Busy)


def test_renew_fails_fast_when_the_server_is_down_and_recovers(pg_server: PgServer, ledgers: Ledgers) -> None:
    """renew() answers False within seconds while the server is down, True again once it is back."""
    a = ledgers.daemon("A", lease_s=6.0)
    assert a.renew()
    pg_server.stop("immediate")
    try:
        started = time.monotonic()
        assert a.renew() is False
        assert time.monotonic() - started < 4
    finally:
        pg_server.start()
    assert eventually(a.renew, "a renewal after the restart")
    assert a.lease_ok()


# -- unknown commits ------------------------------------------------------------------------


class CommitCutter(Proxy):
    """A TCP proxy in front of the server that can lose the next COMMIT, or only its answer.

    ``arm("drop")``: the next COMMIT never reaches the server (it rolls back when the
    connection goes). ``arm("lose_reply")``: the COMMIT reaches the server, which
    commits; its answer is swallowed and the connection cut. ``arm("cut")``: the
    COMMIT is passed on and the connection cut at once, while the server may still
    be committing. Either way the client sees its connection fail while COMMIT was
    on its way: the outcome is unknown.
    """

    COMMIT = b"Q\x00\x00\x00\x0bCOMMIT\x00"
    READY = b"Z\x00\x00\x00\x05"

    def __init__(self, host: str, port: int) -> None:
        self.mode: str | None = None
        self.cuts: list[str] = []
        self._lock = threading.Lock()
        super().__init__(host, port)

    def arm(self, mode: str) -> None:
        with self._lock:
            self.mode = mode

    def _serve(self, client: socket.socket, upstream: socket.socket) -> None:
        swallow = threading.Event()
        threading.Thread(target=self._up, args=(client, upstream, swallow), daemon=True).start()
        threading.Thread(target=self._down, args=(upstream, client, swallow), daemon=True).start()

    @staticmethod
    def _cut(*socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _up(self, client: socket.socket, upstream: socket.socket, swallow: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                with self._lock:
                    mode = self.mode if self.COMMIT in data else None
                    if mode:
                        self.mode = None
                        self.cuts.append(mode)
                if mode == "drop":
                    self._cut(client, upstream)
                    return
                if mode == "cut":
                    upstream.sendall(data)
                    self._cut(client, upstream)
                    return
                if mode == "lose_reply":
                    swallow.set()
                upstream.sendall(data)
        self._cut(client, upstream)

    def _down(self, upstream: socket.socket, client: socket.socket, swallow: threading.Event) -> None:
        with contextlib.suppress(OSError):
            held = b""
            while data := upstream.recv(65536):
                if swallow.is_set():
                    held += data
                    if self.READY in held:  # the server answered the COMMIT: it committed
                        self._cut(client, upstream)
                        return
                    continue
                client.sendall(data)
        self._cut(client, upstream)


@pytest.fixture
def cutter(pg_server: PgServer) -> Iterator[CommitCutter]:
    """Yield a CommitCutter in front of the session server."""
    proxy = CommitCutter(pg_server.host, pg_server.port)
    try:
        yield proxy
    finally:
        proxy.close()


def _via(dsn: str, port: int) -> str:
    """The DSN with its port replaced (to go through the proxy)."""
    head, tail = dsn.rsplit(":", 1)
    return f"{head}:{port}/{tail.split('/', 1)[1]}"


# Each case: (set-up on ledgers A (dead) and B (the one whose COMMIT is cut), the step, its right answer).
def _case_claim(a: PostgresLedger, b: PostgresLedger) -> tuple[Callable[[], object], object]:
    return lambda: b.claim([req("J1"), req("J2")]), [Claimed("J1", 1), Claimed("J2", 1)]


def _case_adopt(a: PostgresLedger, b: PostgresLedger) -> tuple[Callable[[], object], object]:
    a.claim([req("J1")])
    a.close()
    return lambda: b.adopt("J1", "A", 1), 2


def _case_take_retry(a: PostgresLedger, b: PostgresLedger) -> tuple[Callable[[], object], object]:
    b.claim([req("J1")])
    b.finish([Finish("J1", 1, Row.FAILED)])
    b.request("J1", Request.RETRY)
    return lambda: b.take_retry("J1"), 2


def _case_mark_released(a: PostgresLedger, b: PostgresLedger) -> tuple[Callable[[], object], object]:
    b.claim([req("P")])
    b.reserve("P", 1, 1, [Child("C", "w", "C.json")])
    b.finish([Finish("P", 1, Row.DONE)])
    return lambda: b.mark_released("C", "C@B.json", "sha"), True


def _case_take_slot(a: PostgresLedger, b: PostgresLedger) -> tuple[Callable[[], object], object]:
    b.take_slot("w", 2)  # creates the slot rows first
    return lambda: b.take_slot("w", 2), 1


def _case_reconcile(a: PostgresLedger, b: PostgresLedger) -> tuple[Callable[[], object], object]:
    return lambda: b.reconcile("J1", "w", None, 0), True


def _case_load_rows(a: PostgresLedger, b: PostgresLedger) -> tuple[Callable[[], object], object]:
    rows = [Entry(f"L{i}", "done", "w", None, 1, None, None, None, 0, None, None, 1.0) for i in range(50)]
    return lambda: b.load_rows(rows), 50


def _case_finish(a: PostgresLedger, b: PostgresLedger) -> tuple[Callable[[], object], object]:
    b.claim([req("J1")])
    return lambda: b.finish([Finish("J1", 1, Row.DONE)]), [True]


CASES = {
    f.__name__[len("_case_") :]: f
    for f in (
        _case_claim,
        _case_adopt,
        _case_take_retry,
        _case_mark_released,
        _case_take_slot,
        _case_reconcile,
        _case_load_rows,
        _case_finish,
    )
}


@pytest.mark.parametrize("mode", ["lose_reply", "drop"])
@pytest.mark.parametrize("step", sorted(CASES))
def test_an_unknown_commit_is_settled_by_reading_back(
    step: str, mode: str, cutter: CommitCutter, ledgers: Ledgers
) -> None:
    """A COMMIT lost on its way (or only its answer) gives the step's right answer, done exactly once."""
    a = ledgers.daemon("A")
    b = ledgers.daemon("B", dsn=_via(ledgers.dsn, cutter.port))
    run, expected = CASES[step](a, b)
    before_rows = sql(ledgers.dsn, "SELECT count(*) FROM jobs")
    with structlog.testing.capture_logs() as logs:
        cutter.arm(mode)
        assert run() == expected
    assert cutter.cuts == [mode]
    unknown = [e for e in logs if e["event"] == "ledger.commit_unknown"]
    settled = [(e["step"], e["committed"], e["status"], e["rows"]) for e in unknown]
    committed = mode == "lose_reply"
    # the server's record decides; the step's own read-back of its rows agrees with it
    rows = "not read" if step in ("finish", "load_rows") else "written" if committed else "absent"
    assert settled == [(step, committed, "committed" if committed else "aborted", rows)]
    assert not [e for e in logs if e["event"] == "ledger.readback_differs"]
    if step == "load_rows":
        assert sql(ledgers.dsn, "SELECT count(*) FROM jobs") == [(before_rows[0][0] + 50,)]
    if step == "claim":
        assert sql(ledgers.dsn, "SELECT job_id, owner, token FROM jobs ORDER BY 1") == [("J1", "B", 1), ("J2", "B", 1)]


def test_a_commit_still_under_way_is_waited_for_before_it_is_judged(
    pg_server: PgServer, cutter: CommitCutter, ledgers: Ledgers
) -> None:
    """A COMMIT cut off while the server still commits (waiting for a synchronous standby) is waited out.

    Its transaction is in the server's log but not yet visible to others: reading the
    rows then would find nothing and wrongly run the claim again (to answer Busy).
    The ledger waits, answers nothing meanwhile, and says Claimed once it is done.
    """
    b = ledgers.daemon("B", dsn=_via(ledgers.dsn, cutter.port))

    def standby(names: str) -> None:
        pg_server._sql(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'", "SELECT pg_reload_conf()")
        eventually(lambda: sql(ledgers.dsn, "SHOW synchronous_standby_names") == [(names,)], "the reload")

    answers: list[object] = []
    with structlog.testing.capture_logs() as logs:
        standby("nobody")  # every COMMIT now waits for a standby that never comes
        try:
            cutter.arm("cut")
            claimer = threading.Thread(target=lambda: answers.append(b.claim([req("J1")])))
            claimer.start()
            eventually(
                lambda: sql(ledgers.dsn, "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'SyncRep'"),
                "the cut-off COMMIT to wait for the standby",
            )
            time.sleep(1.0)
            assert claimer.is_alive() and not answers  # waiting, not guessing
            assert not [e for e in logs if e["event"] == "ledger.commit_unknown"]
        finally:
            standby("")  # the waiting COMMIT completes
        claimer.join(30)
    assert answers == [[Claimed("J1", 1)]]
    assert cutter.cuts == ["cut"]
    assert [(e["committed"], e["status"]) for e in logs if e["event"] == "ledger.commit_unknown"] == [
        (True, "committed")
    ]
    assert sql(ledgers.dsn, "SELECT job_id, owner, token FROM jobs") == [("J1", "B", 1)]


def test_a_backend_killed_right_before_commit_is_a_commit_that_did_not_happen(ledgers: Ledgers) -> None:
    """pg_terminate_backend just before COMMIT: the claim is read back as not done, run again, and done once."""
    a = ledgers.daemon("A")
    killed: list[int] = []

    def kill(conn: psycopg.Connection[Any]) -> None:
        if not killed:
            killed.append(conn.info.backend_pid)
            sql(ledgers.dsn, "SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))

    a.before_commit = kill
    with structlog.testing.capture_logs() as logs:
        assert a.claim([req("J1")]) == [Claimed("J1", 1)]
    a.before_commit = None
    assert killed
    assert [(e["step"], e["committed"], e["status"]) for e in logs if e["event"] == "ledger.commit_unknown"] == [
        ("claim", False, "aborted")
    ]
    assert sql(ledgers.dsn, "SELECT owner, token FROM jobs") == [("A", 1)]


def test_a_crash_before_commit_is_not_taken_for_the_commit_that_got_its_id(ledgers: Ledgers) -> None:
    """A backend crash right before COMMIT: recovery hands its transaction id to the next claim.

    The server then calls that id committed. The claim reads its row back, finds it
    missing and runs again: each of A's ids is claimed once, by A, and its row is there.
    A round where the lost transaction's writes reached the disk anyway (the WAL writer
    was quicker than the kill) keeps its id; rounds run until one shows the case meant.
    """
    a, b = ledgers.daemon("A"), ledgers.daemon("B")
    reused = False

    def checkpoint() -> str | None:
        try:
            return str(sql(ledgers.dsn, "SELECT checkpoint_lsn FROM pg_control_checkpoint()")[0][0])
        except psycopg.OperationalError:  # the server is recovering
            return None

    for n in range(1, 6):
        noted: list[int] = []

        def crash(conn: psycopg.Connection[Any], n: int = n, noted: list[int] = noted) -> None:
            if noted:
                return
            row = conn.execute("SELECT txid_current()").fetchone()
            assert row is not None
            noted.append(int(row[0]))
            before = checkpoint()
            os.kill(conn.info.backend_pid, signal.SIGKILL)  # the server restarts every backend, in place
            eventually(lambda: checkpoint() not in (before, None), "crash recovery's checkpoint", timeout=60)
            assert b.claim([req(f"B{n}")]) == [Claimed(f"B{n}", 1)]  # the first transaction id after recovery

        a.before_commit = crash
        with structlog.testing.capture_logs() as logs:
            assert a.claim([req(f"A{n}")]) == [Claimed(f"A{n}", 1)]
        a.before_commit = None
        rows = sql(ledgers.dsn, "SELECT owner, token FROM jobs WHERE job_id IN (%s, %s) ORDER BY 1", (f"A{n}", f"B{n}"))
        assert rows == [("A", 1), ("B", 1)]
        unknown = [
            (e["step"], e["committed"], e["crashed"], e["rows"]) for e in logs if e["event"] == "ledger.commit_unknown"
        ]
        assert unknown == [("claim", False, True, "absent")]
        # the case meant: the lost transaction's id went to B's claim, which committed
        if sql(ledgers.dsn, "SELECT txid_status(%s)", (noted[0],)) == [("committed",)]:
            reused = True
            break
    assert reused, "in 5 rounds, no crash lost a transaction whose id was handed out again"


# -- migrate --------------------------------------------------------------------------------


def _sqlite_with_history(tmp_path: Path) -> SqliteLedger:
    """A SQLite ledger with claimed, done (with costs), failed, review, reserved, released and held rows."""
    state = tmp_path / "state"
    (state / "slots").mkdir(parents=True)
    src = SqliteLedger(state / "l.sqlite3", state)
    src.register(DaemonInfo("S", os.getpid(), "old-host", time.time()))
    src.claim([req(j) for j in ("DONE", "FAIL", "REVIEW", "RUN", "P")])
    src.finish([Finish("DONE", 1, Row.DONE, 0.5, 1.25), Finish("FAIL", 1, Row.FAILED), Finish("REVIEW", 1, Row.REVIEW)])
    src.reserve("P", 1, 2, [Child("C1", "w", "C1.json"), Child("C2", "w", "C2.json"), Child("C3", "w", "C3.json")])
    src.finish([Finish("P", 1, Row.DONE, 0.1, 0.3)])
    src.set_digest("C1", "s1")
    src.mark_released("C1", "C1@S.json", "s1")
    src.mark_released("C2", "C2@S.json", "s2", held=True)
    src.request("FAIL", Request.RETRY)
    src.request("RUN", Request.CANCEL)
    src.claim([req("JOIN")])
    src.wait("JOIN", 1, ["DONE", "RUN"], "all_final")
    src.set_gate(Gate("w", GateKind.PAUSE, None, "paused by hand"), at=time.time())
    src.set_gate(Gate("w", GateKind.LIMIT, time.time() + 600, "rate limited"), at=time.time())
    src.set_gate_wait("RUN", "w", None)
    return src


def test_migrate_copies_every_row_exactly(tmp_path: Path, ledgers: Ledgers) -> None:
    """migrate copies ids, states, lineage, costs, tokens, requests, join waits, gates and gate waits as they are."""
    src = _sqlite_with_history(tmp_path)
    try:
        target = ledgers.open()
        moved = migrate(src, target)
        assert moved.rows == src.count() == 9
        assert moved.extras == {"requests": 2, "waits": 1, "gates": 2, "gate_waits": 1}
        assert list(target.rows()) == list(src.rows())
        assert target.extras() == src.extras()
        for kind in Request:
            assert target.requests(kind) == src.requests(kind)
        [join] = target.waits()
        assert (join.job_id, join.after, join.rule) == ("JOIN", ("DONE", "RUN"), "all_final")
        assert target.waiting_on(["RUN"]) == ["JOIN"]
        gates = [(g.agent, g.kind, g.until is None) for g in target.gates()]
        assert gates == [("w", "limit", False), ("w", "pause", True)]
        assert target.gate_waits() == {"RUN": None}
        # the ids are refused again on the new ledger; the released follow-up can still be claimed
        b = ledgers.daemon("B")
        assert isinstance(b.claim([req("DONE")])[0], Known)
        assert b.claim([req("C1", "C1@S.json", "s1")]) == [
            Claimed("C1", 1, parent="P", hops=2, previous="released", parent_chain_cost_usd=0.3)
        ]
    finally:
        src.close()


def test_migrate_refuses_a_target_that_is_not_empty(tmp_path: Path, ledgers: Ledgers) -> None:
    """migrate into a ledger that holds any job id fails with one line and copies nothing."""
    src = _sqlite_with_history(tmp_path)
    try:
        target = ledgers.daemon("T")
        target.claim([req("OTHER")])
        with pytest.raises(PostgresLedgerError) as caught:
            migrate(src, target)
        assert "not empty (1 job ids)" in str(caught.value) and "\n" not in str(caught.value)
        assert target.count() == 1 and target.requests(Request.RETRY) == []
        assert target.waits(["JOIN"]) == [] and target.gates() == [] and target.gate_waits() == {}
    finally:
        src.close()


# -- a small benchmark ----------------------------------------------------------------------


def benchmark(dsn: str, jobs: int = 1000, batch: int = 10) -> dict[str, float]:
    """Claim and finish ``jobs`` ids in batches on a fresh ledger; return steps per second."""
    led = PostgresLedger(dsn, None)
    try:
        led.register(DaemonInfo(f"bench-{os.getpid()}-{time.time_ns()}", os.getpid(), "bench", time.time()))
        ids = [f"B{i:06d}" for i in range(jobs)]
        t0 = time.perf_counter()
        for i in range(0, jobs, batch):
            led.claim([req(j) for j in ids[i : i + batch]])
        t1 = time.perf_counter()
        for i in range(0, jobs, batch):
            led.finish([Finish(j, 1, Row.DONE) for j in ids[i : i + batch]])
        t2 = time.perf_counter()
        return {"claims_per_s": jobs / (t1 - t0), "finishes_per_s": jobs / (t2 - t1)}
    finally:
        led.close()


def test_benchmark_claims_and_finishes(ledgers: Ledgers, capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark runs and claims at a useful rate (printed; the bar is low: the machine is shared)."""
    rates = benchmark(ledgers.dsn, jobs=500)
    with capsys.disabled():
        print(f"\nPostgreSQL ledger, batches of 10: {rates['claims_per_s']:.0f} claims/s, "
              f"{rates['finishes_per_s']:.0f} finishes/s")  # fmt: skip
    assert rates["claims_per_s"] > 50
