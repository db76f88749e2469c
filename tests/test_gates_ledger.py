"""Gates and waits in both ledger engines (contract section 14), and the schema migration of older ledgers."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from test_ledger_contract import Engine

from dispatcher.layout import Layout
from dispatcher.ledger.base import ClaimRequest, Finish, Gate, GateKind, Request, Row
from dispatcher.ledger.postgres import PostgresLedger
from dispatcher.ledger.sqlite import SqliteLedger

pytestmark = pytest.mark.postgres
pytest_plugins = ["pg_fixtures"]


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """Yield an Engine on a fresh store of each kind."""
    if request.param == "sqlite":
        state = tmp_path / "state"
        (state / "slots").mkdir(parents=True)
        eng = Engine("sqlite", lambda: SqliteLedger(state / "l.sqlite3", state, patience_s=30))
    else:
        dsn = request.getfixturevalue("pg_db")
        eng = Engine("postgres", lambda: PostgresLedger(dsn, Layout(tmp_path), lease_s=30, patience_s=30))
    try:
        yield eng
    finally:
        for led in eng.made:
            led.close()


def test_a_later_limit_extends_a_gate_and_every_handle_sees_it(engine: Engine) -> None:
    """set_gate: the first of a kind is new; a later until extends it, an earlier one does not shorten it."""
    a, b = engine.daemon("a"), engine.daemon("b")
    now = time.time()
    assert a.set_gate(Gate("coder", GateKind.LIMIT, now + 60, "limit reached"), at=now) is True
    assert b.set_gate(Gate("coder", GateKind.LIMIT, now + 30, "again"), at=now) is False
    assert b.set_gate(Gate("coder", GateKind.LIMIT, now + 90, "later"), at=now) is False
    (gate,) = a.gates()
    assert (gate.agent, gate.kind, gate.reason) == ("coder", "limit", "later")
    assert gate.until == pytest.approx(now + 90)
    assert gate.holds("coder", now) and not gate.holds("other", now) and not gate.holds("coder", now + 91)


def test_a_gates_reason_is_the_text_of_the_limit_that_set_its_until(engine: Engine) -> None:
    """A shorter limit met later leaves the gate its time and its text; a longer one brings its own text."""
    a, b = engine.daemon("a"), engine.daemon("b")
    now = time.time()
    a.set_gate(Gate("cc", GateKind.LIMIT, now + 40, "wait 40 s"), at=now)
    b.set_gate(Gate("cc", GateKind.LIMIT, now + 5, "wait 5 s"), at=now)
    (gate,) = a.gates()
    assert (gate.until, gate.reason) == (pytest.approx(now + 40), "wait 40 s")
    b.set_gate(Gate("cc", GateKind.LIMIT, now + 50, "wait 50 s"), at=now)
    (gate,) = b.gates()
    assert (gate.until, gate.reason) == (pytest.approx(now + 50), "wait 50 s")


def test_a_pause_holds_until_lifted_and_expired_gates_are_lifted_once(engine: Engine) -> None:
    """A pause (no until) outlives expiry sweeps; an expired limit is lifted by one sweep only."""
    a, b = engine.daemon("a"), engine.daemon("b")
    now = time.time()
    a.set_gate(Gate("coder", GateKind.PAUSE, None, "paused by hand"), at=now)
    a.set_gate(Gate("writer", GateKind.LIMIT, now + 1, "limit"), at=now)
    lifted = a.lift_gates(expired_at=now + 2)
    assert [(g.agent, g.kind) for g in lifted] == [("writer", "limit")]
    assert b.lift_gates(expired_at=now + 2) == []
    assert [(g.agent, g.until) for g in b.gates()] == [("coder", None)]
    assert [g.kind for g in b.lift_gates("coder")] == ["pause"] and a.gates() == []


def test_waits_and_the_window_of_costs(engine: Engine) -> None:
    """set_gate_wait/clear_gate_wait are seen by every handle; costs_since gives the finished costs of the window."""
    a, b = engine.daemon("a"), engine.daemon("b")
    a.set_gate_wait("J1", "coder", 123.0)
    a.set_gate_wait("J2", "coder", None)
    assert b.gate_waits() == {"J1": 123.0, "J2": None}
    b.clear_gate_wait("J1")
    assert a.gate_waits() == {"J2": None}
    (claimed,) = a.claim([ClaimRequest("J3", "coder", "J3.yaml", "d")])
    assert a.finish([Finish("J3", claimed.token, Row.DONE, 0.4, 0.4)]) == [True]  # type: ignore[union-attr]
    costs = b.costs_since(time.time() - 60)
    assert [(agent, cost) for _, agent, cost in costs] == [("coder", 0.4)]
    assert b.costs_since(time.time() + 60) == []


@pytest.mark.parametrize("decision", [Row.DONE, Row.FAILED])
def test_a_review_decision_leaves_the_jobs_cost_in_the_window_it_finished_in(engine: Engine, decision: Row) -> None:
    """approve (done) or reject (failed) of a job in review spends nothing: its cost stays dated when its agent's
    work finished, so a review queue decided the next morning does not count the night's spend in today's daily
    window a second time (section 14: "the finished cost of the last 24 hours"). The row's own time moves to the
    decision: `list` gives a job's age since it entered its state."""
    a, b = engine.daemon("a"), engine.daemon("b")
    (claimed,) = a.claim([ClaimRequest("RV", "coder", "RV.yaml", "d")])
    assert a.finish([Finish("RV", claimed.token, Row.REVIEW, 1.0, 1.0)]) == [True]  # type: ignore[union-attr]
    ((finished, agent, cost),) = b.costs_since(0)
    time.sleep(0.05)
    assert b.finish([Finish("RV", claimed.token, decision, 1.0, 1.0)]) == [True]  # type: ignore[union-attr]
    row = a.get("RV")
    assert row is not None and row.state == decision and row.updated >= finished + 0.04
    assert b.costs_since(0) == [(finished, agent, cost)]
    assert b.costs_since(finished + 0.01) == []


def test_a_retried_jobs_earlier_cost_counts_from_when_it_was_taken_back(engine: Engine) -> None:
    """A failed job with a cost, taken back by `retry`: its earlier attempts' cost is counted from that moment (the
    README), also after a daemon takes it over from a dead one."""
    a, b = engine.daemon("a"), engine.daemon("b")
    (claimed,) = a.claim([ClaimRequest("RT", "coder", "RT.yaml", "d")])
    assert a.finish([Finish("RT", claimed.token, Row.FAILED, 0.5, 0.5)]) == [True]  # type: ignore[union-attr]
    ((failed_at, _, _),) = b.costs_since(0)
    time.sleep(0.05)
    a.request("RT", Request.RETRY)
    token = a.take_retry("RT")
    assert token is not None
    ((taken_at, _, cost),) = b.costs_since(0)
    assert taken_at >= failed_at + 0.04 and cost == 0.5
    time.sleep(0.05)
    owner = a.owner
    a.close()  # its daemon is gone (a clean stop): another takes its job over
    engine.made.remove(a)
    assert b.adopt("RT", owner, token) is not None
    assert [at for at, _, _ in b.costs_since(0)] == [taken_at]


def test_a_revise_request_takes_a_job_in_review(engine: Engine) -> None:
    """take_retry with REVISE takes a job in review (a retry does not), once per request."""
    a = engine.daemon("a")
    (claimed,) = a.claim([ClaimRequest("R1", "coder", "R1.yaml", "d")])
    a.finish([Finish("R1", claimed.token, Row.REVIEW)])  # type: ignore[union-attr]
    a.request("R1", Request.RETRY)
    assert a.take_retry("R1") is None
    a.request("R1", Request.REVISE)
    token = a.take_retry("R1", Request.REVISE)
    assert token is not None and a.get("R1").state == Row.CLAIMED  # type: ignore[union-attr]


def test_an_older_sqlite_ledger_gets_the_new_tables(tmp_path: Path) -> None:
    """A version 2 SQLite ledger (no joins, no gates) is migrated when opened, its rows kept."""
    state = tmp_path / "state"
    (state / "slots").mkdir(parents=True)
    path = state / "l.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE jobs (job_id TEXT PRIMARY KEY, state TEXT NOT NULL, agent TEXT, owner TEXT, source TEXT,"
        " digest TEXT, parent TEXT, hops INTEGER NOT NULL DEFAULT 0, updated REAL NOT NULL,"
        " token INTEGER NOT NULL DEFAULT 0, cost_usd REAL, chain_cost_usd REAL) WITHOUT ROWID;"
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;"
        "INSERT INTO meta VALUES ('schema_version', '2');"
        "INSERT INTO jobs (job_id, state, updated) VALUES ('OLD-1', 'done', 1);"
    )
    old.commit()
    old.close()
    led = SqliteLedger(path, state, patience_s=30)
    try:
        assert led.get("OLD-1") is not None and led.gates() == [] and led.gate_waits() == {}
        led.set_gate(Gate("coder", GateKind.PAUSE, None), at=time.time())
        assert len(led.gates()) == 1
    finally:
        led.close()
    version = sqlite3.connect(path).execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    assert version == ("4",)


def test_a_sqlite_ledger_without_the_spent_column_is_read_and_upgraded(tmp_path: Path) -> None:
    """A version 4 ledger from before the `spent` column: a read-only reader (a `status` before the new daemon's
    first start) reads its costs through an upgraded copy, the file untouched; a daemon's open adds the column."""
    state = tmp_path / "state"
    (state / "slots").mkdir(parents=True)
    path = state / "l.sqlite3"
    SqliteLedger(path, state, patience_s=30).close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("INSERT INTO jobs (job_id, state, agent, updated, cost_usd) VALUES ('OLD-1', 'done', 'a', ?, 0.5)",
                   (time.time(),))  # fmt: skip
        db.execute("ALTER TABLE jobs DROP COLUMN spent")
        db.commit()
    reader = SqliteLedger(path, state, readonly=True)
    try:
        assert [(agent, cost) for _, agent, cost in reader.costs_since(0)] == [("a", 0.5)]
    finally:
        reader.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert "spent" not in [r[1] for r in db.execute("PRAGMA table_info(jobs)")]
    led = SqliteLedger(path, state, patience_s=30)
    try:
        assert [(agent, cost) for _, agent, cost in led.costs_since(0)] == [("a", 0.5)]
    finally:
        led.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert "spent" in [r[1] for r in db.execute("PRAGMA table_info(jobs)")]


def test_a_postgres_ledger_without_the_spent_column_gets_it_at_open(pg_db: str, tmp_path: Path) -> None:
    """A PostgreSQL ledger from before the `spent` column: a read-only reader (`status`, a role with SELECT only)
    reads its costs without it; a daemon's open adds it."""
    first = PostgresLedger(pg_db, Layout(tmp_path), lease_s=30, patience_s=30)
    (claimed,) = first.claim([ClaimRequest("PG-OLD", "coder", "PG-OLD.yaml", "d")])
    assert first.finish([Finish("PG-OLD", claimed.token, Row.DONE, 0.5, 0.5)]) == [True]  # type: ignore[union-attr]
    first.close()
    with psycopg.connect(pg_db, autocommit=True) as conn:
        conn.execute("ALTER TABLE jobs DROP COLUMN spent")
    reader = PostgresLedger(pg_db, Layout(tmp_path), readonly=True)  # `status` before this version's daemon started
    try:
        assert [(agent, cost) for _, agent, cost in reader.costs_since(0)] == [("coder", 0.5)]
        led = PostgresLedger(pg_db, Layout(tmp_path), lease_s=30, patience_s=30)
        try:
            assert [(agent, cost) for _, agent, cost in led.costs_since(0)] == [("coder", 0.5)]
            # the reader kept open (the web view) dates a reviewed job's cost by the column the daemon added
            (rv,) = led.claim([ClaimRequest("PG-RV", "coder", "PG-RV.yaml", "d")])
            assert led.finish([Finish("PG-RV", rv.token, Row.REVIEW, 1.0, 1.0)]) == [True]  # type: ignore[union-attr]
            entered = max(at for at, _, _ in led.costs_since(0))
            time.sleep(0.05)
            assert led.finish([Finish("PG-RV", rv.token, Row.DONE, 1.0, 1.0)]) == [True]  # type: ignore[union-attr]
            assert [cost for _, _, cost in reader.costs_since(entered + 0.01)] == []
        finally:
            led.close()
    finally:
        reader.close()
    with psycopg.connect(pg_db) as conn:
        found = conn.execute(
            "SELECT 1 FROM information_schema.columns WHERE table_name = 'jobs' AND column_name = 'spent'"
        )
        assert found.fetchone() is not None


def test_an_older_postgres_ledger_gets_the_new_tables(pg_db: str, tmp_path: Path) -> None:
    """A version 2 PostgreSQL ledger (joins, no gates) is migrated to version 3 when opened."""
    first = PostgresLedger(pg_db, Layout(tmp_path), lease_s=30, patience_s=30)
    first.close()
    with psycopg.connect(pg_db, autocommit=True) as conn:
        conn.execute("DROP TABLE gates")
        conn.execute("DROP TABLE gate_waits")
        conn.execute("UPDATE schema_version SET version = 2")
    led = PostgresLedger(pg_db, Layout(tmp_path), lease_s=30, patience_s=30)
    try:
        assert led.gates() == [] and led.gate_waits() == {}
        led.set_gate_wait("J1", "coder", None)
        assert led.gate_waits() == {"J1": None}
    finally:
        led.close()
    with psycopg.connect(pg_db) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone() == (3,)


def test_a_copied_ledger_keeps_a_reviewed_jobs_cost_in_the_window_it_finished_in(
    engine: Engine, tmp_path: Path
) -> None:
    """The rows of an SQLite ledger copied into another (`ledger migrate` into PostgreSQL, or SQLite rows loaded
    as they are) carry when a reviewed job's cost was counted: the copy's 24-hour spend is the source's. Without
    it, a job approved after its agent's work counted its cost again from the approval."""
    state = tmp_path / "src"
    (state / "slots").mkdir(parents=True)
    source = SqliteLedger(state / "l.sqlite3", state, patience_s=30)
    try:
        (claimed,) = source.claim([ClaimRequest("RV", "coder", "RV.yaml", "d")])
        assert source.finish([Finish("RV", claimed.token, Row.REVIEW, 1.0, 1.0)]) == [True]  # type: ignore[union-attr]
        ((finished, _, _),) = source.costs_since(0)
        time.sleep(0.05)
        assert source.finish([Finish("RV", claimed.token, Row.DONE, 1.0, 1.0)]) == [True]  # type: ignore[union-attr]
        entries = list(source.rows())
        more = source.extras()
    finally:
        source.close()
    target = engine.daemon("a")
    if isinstance(target, PostgresLedger):
        assert target.load_into_empty(entries, more) == 1
    else:
        assert target.load_rows(entries) == 1
    assert [at for at, _, _ in target.costs_since(0)] == [pytest.approx(finished)]
    assert target.costs_since(finished + 0.01) == []
