"""The ledger's join steps on both engines (SQLite and PostgreSQL): wait, waits, waiting_on, take_waiting.

The same rules on both: a claim becomes a wait with no owner; the waits of a job
are kept; of two daemons taking one ready join, exactly one wins; a ledger made
before joins is migrated in place when a daemon opens it.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from test_ledger_contract import Engine, claimed_token, engine, req

from dispatcher.ledger.base import Ledger, Row
from dispatcher.ledger.sqlite import SqliteLedger

pytest_plugins = ["pg_fixtures"]
__all__ = ["engine"]


def test_a_claim_becomes_a_wait_with_no_owner_and_its_ids_are_kept(engine: Engine) -> None:
    """wait() turns the claim into state waiting without owner; waits() and waiting_on() find it."""
    a = engine.daemon("A")
    token = claimed_token(a.claim([req("M")])[0])
    assert a.wait("M", token + 1, ["P1"], "all_done") is False  # a stale token changes nothing
    assert a.wait("M", token, ["P2", "P1"], "all_final") is True
    entry = a.get("M")
    assert entry is not None and (entry.state, entry.owner) == (Row.WAITING, None)
    [w] = a.waits()
    assert (w.job_id, w.after, w.rule) == ("M", ("P1", "P2"), "all_final")
    assert a.waiting_on(["P2", "X"]) == ["M"] and a.waiting_on(["X"]) == []
    assert [x.job_id for x in a.waits(["M"])] == ["M"]


def test_exactly_one_of_two_daemons_takes_a_ready_join(engine: Engine) -> None:
    """Two daemons race take_waiting on one join 20 times: each time exactly one gets a token."""
    a, b = engine.daemon("A"), engine.daemon("B")
    for i in range(20):
        job = f"M{i}"
        a.wait(job, claimed_token(a.claim([req(job)])[0]), ["P"], "all_done")
        got: list[int | None] = []

        def take(led: Ledger, job: str = job, got: list[int | None] = got) -> None:
            got.append(led.take_waiting(job))

        threads = [threading.Thread(target=take, args=(led,)) for led in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got.count(None) == 1, got
        entry = a.get(job)
        assert entry is not None and entry.state == Row.CLAIMED and entry.owner in ("A", "B")
        assert a.waiting_on(["P"]) == [] and a.waits([job])[0].after == ("P",)
        assert a.waiting_on(["P"], any_state=True) == sorted(f"M{k}" for k in range(i + 1))  # `cancel --tree` finds it


def test_a_sqlite_ledger_from_before_joins_is_migrated(tmp_path: Path) -> None:
    """A version-2 SQLite ledger (no waits table) opens, gains the table, and keeps its rows."""
    state = tmp_path / "state"
    (state / "slots").mkdir(parents=True)
    path = state / "l.sqlite3"
    SqliteLedger(path, state).close()
    db = sqlite3.connect(path)
    db.executescript(
        "DROP TABLE waits; UPDATE meta SET value = '2' WHERE key = 'schema_version';"
        "INSERT INTO jobs (job_id, state, updated) VALUES ('OLD', 'done', 0);"
    )
    db.commit()
    db.close()
    led = SqliteLedger(path, state)
    try:
        assert led.get("OLD") is not None and led.waits() == [] and led.waiting_on(["OLD"]) == []
    finally:
        led.close()


def test_a_postgresql_ledger_from_before_joins_is_migrated(tmp_path: Path, pg_db: str) -> None:
    """A version-1 PostgreSQL ledger (no waits table) opens, gains the table and the current version, keeps its rows."""
    import psycopg

    from dispatcher.ledger.pg_schema import SCHEMA_VERSION
    from dispatcher.ledger.postgres import PostgresLedger

    PostgresLedger(pg_db, lease_s=30, patience_s=30).close()
    with psycopg.connect(pg_db, autocommit=True) as conn:
        conn.execute("DROP TABLE waits")
        conn.execute("UPDATE schema_version SET version = 1")
        conn.execute("INSERT INTO jobs (job_id, state, updated) VALUES ('OLD', 'done', 0)")
    led = PostgresLedger(pg_db, lease_s=30, patience_s=30)
    try:
        assert led.get("OLD") is not None and led.waits() == [] and led.waiting_on(["OLD"]) == []
    finally:
        led.close()
    with psycopg.connect(pg_db) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION,)  # 3: gates
