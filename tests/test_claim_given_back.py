"""A daemon's own claim of a file, left with no job folder, is given back and the file claimed again.

Claims run one after another in the daemon's ledger lane. If a claim's trip ends after
the ledger row was written but before the job folder was made, and the claim is never
undone, the row names this very daemon as the owner of that file: every later look at
the file answered "busy", so it waited in inbox/ without a word for as long as the
daemon ran, and the next daemon refused it as a known id. The state is made here by
hand, a row written into the real ledger with the running daemon's owner id, and the
user's checks are the ones that matter: the job runs once and ends in done/, and the
log says what happened.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time

import psycopg
import pytest
from conftest import Env, order

pytest_plugins = ["pg_fixtures"]

_INSERT = (
    "INSERT INTO jobs (job_id, state, agent, owner, source, digest, parent, hops, updated, token)"
    " VALUES ({0}, 'claimed', 'worker', {0}, {0}, {0}, {0}, {0}, {0}, 1)"
)


def _orphan_row(
    env: Env, job_id: str, owner: str, data: bytes, parent: str | None = None, hops: int = 0, dsn: str | None = None
) -> None:
    """Write the row a cut-short claim of inbox/<job_id>.json by ``owner`` leaves (``dsn``: in that ledger)."""
    values = (job_id, owner, f"{job_id}.json", hashlib.sha256(data).hexdigest(), parent, hops, time.time())
    if dsn is not None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(_INSERT.format("%s"), values)
        return
    db = sqlite3.connect(env.root / ".state" / "ledger.sqlite3", timeout=30)
    try:
        with db:
            db.execute(_INSERT.format("?"), values)
    finally:
        db.close()


@pytest.mark.parametrize("ledger", ["sqlite", "postgres"])
def test_an_own_claim_without_a_folder_is_given_back_and_the_job_runs_once(
    env: Env, ledger: str, request: pytest.FixtureRequest
) -> None:
    dsn = request.getfixturevalue("pg_db") if ledger == "postgres" else None
    env.configure(**({"ledger": dsn} if dsn else {}))
    d = env.daemon()
    d.wait_ready()
    owner = d.wait_event("daemon.started")["owner"]
    body = order("GB1")
    data = json.dumps(body).encode()
    _orphan_row(env, "GB1", owner, data, dsn=dsn)

    env.drop(data, "GB1.json")

    result = env.wait_job("GB1", "done")
    assert result["state"] == "done"
    assert env.starts() == [("GB1", 1)]
    assert not (env.root / "inbox" / "GB1.json").exists()
    returned = d.wait_event("job.claim_returned", job_id="GB1")
    assert returned["level"] == "warning" and returned["agent"] == "worker" and returned["file"] == "GB1.json"
    assert not env.refusals()


def test_a_follow_ups_row_keeps_its_lineage_when_given_back(env: Env) -> None:
    env.configure()
    d = env.daemon()
    d.wait_ready()
    owner = d.wait_event("daemon.started")["owner"]
    body = order("GB2")
    data = json.dumps(body).encode()
    _orphan_row(env, "GB2", owner, data, parent="GBP", hops=1)

    env.drop(data, "GB2.json")

    result = env.wait_job("GB2", "done")
    assert result["parent"] == "GBP"
    job = json.loads((env.job_dir("GB2", "done") / "job.json").read_text())
    assert (job["parent"], job["hops"]) == ("GBP", 1)
    assert env.starts() == [("GB2", 1)]


def test_a_file_another_live_daemon_is_claiming_is_left_alone(env: Env) -> None:
    """Only this daemon's own claim is given back: another live daemon's stays busy."""
    env.configure()
    d = env.daemon()
    d.wait_ready()
    other = env.daemon()  # a second daemon on the same root: alive, with an owner id of its own
    other.wait_ready()
    other_owner = other.wait_event("daemon.started")["owner"]
    other.signal(19)  # SIGSTOP: it stays registered and alive, and claims nothing meanwhile
    try:
        body = order("GB3")
        data = json.dumps(body).encode()
        _orphan_row(env, "GB3", other_owner, data)
        env.drop(data, "GB3.json")
        d.wait_event("order.received", job_id="GB3")
        time.sleep(2.0)  # a rescan's worth: the file stays where it is, unclaimed, unrefused
        assert (env.root / "inbox" / "GB3.json").exists()
        assert not any(e.get("event") == "job.claim_returned" for e in d.events())
        assert env.starts() == [] and not env.refusals()
    finally:
        other.signal(18)  # SIGCONT
