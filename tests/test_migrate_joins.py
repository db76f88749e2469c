"""`ledger migrate` (contract sections 12, 14, 16): joins keep waiting and paused agents stay paused on PostgreSQL.

A real daemon on a SQLite ledger leaves a join in waiting/ and a paused agent;
`dispatcher ledger migrate` copies the ledger into a fresh PostgreSQL one (a
server the test starts), and a daemon on that ledger carries on where the first left.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
from conftest import Env, order, wait_until

pytest_plugins = ["pg_fixtures"]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _waits(dsn: str) -> list[tuple[str, str, str]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT job_id, parent, rule FROM waits ORDER BY job_id, parent").fetchall()
    return [(str(a), str(b), str(c)) for a, b, c in rows]


def test_a_migrated_join_still_waits_and_a_paused_agent_stays_paused(env: Env, pg_db: str) -> None:
    """After `ledger migrate` a join waits for its queued parent and a paused agent stays paused until `resume`."""
    metrics = env.tmp / "m.prom"
    log_file = env.tmp / "d.log"
    agents = {"worker": env.agent(), "merger": env.agent()}
    env.configure(agents, metrics_file=str(metrics), log_file=str(log_file))
    first = env.daemon()
    first.wait_ready()
    env.drop(order("W1"))
    env.wait_job("W1", "done")
    env.cli("pause", "worker", check=True)
    wait_until(lambda: 'dispatcher_agent_gated{agent="worker"} 1.0' in _read(metrics), what="worker gated")
    env.drop(order("W2"))
    env.drop(order("M", to="merger", after=["W1", "W2"]))
    first.wait_event("job.waiting", job_id="M")
    assert first.stop() == 0
    assert (env.root / "waiting" / "M").is_dir() and (env.root / "inbox" / "W2.json").is_file()

    moved = env.cli("ledger", "migrate", "-", input=pg_db + "\n")
    assert moved.returncode == 0, moved.stderr
    assert "2 job ids copied" in moved.stdout and "with 1 join wait, 1 gate, 0 gate waits, 0 requests" in moved.stdout
    assert _waits(pg_db) == [("M", "W1", "all_done"), ("M", "W2", "all_done")]
    (line,) = [json.loads(x) for x in log_file.read_text().splitlines() if '"ledger.migrated"' in x]
    assert (line["rows"], line["waits"], line["gates"], line["requests"]) == (2, 1, 1, 0), line  # README: the counts
    assert line["target"].startswith("postgresql://")

    env.configure(agents, metrics_file=str(metrics), ledger=pg_db)
    second = env.daemon()
    second.wait_ready()
    env.drop(order("OTHER", to="merger"))  # the daemon claims and runs other work meanwhile
    env.wait_job("OTHER", "done")
    status = json.loads(env.cli("status", "--json", check=True).stdout)
    assert status["gates"] == [{"agent": "worker", "kind": "pause", "until": None, "reason": "paused by hand"}]
    assert (env.root / "waiting" / "M").is_dir() and (env.root / "inbox" / "W2.json").is_file()
    assert [j for j, _ in env.starts()] == ["W1", "OTHER"]

    env.cli("resume", "worker", check=True)
    env.wait_job("W2", "done")
    env.wait_job("M", "done")
    assert [j for j, _ in env.starts()] == ["W1", "OTHER", "W2", "M"]
    parents = json.loads((env.root / "done" / "M" / "work" / "parents.json").read_text())
    assert [(p["job_id"], p["state"]) for p in parents] == [("W1", "done"), ("W2", "done")]
    assert second.stop() == 0


def test_a_join_that_went_on_is_no_join_wait_in_the_copy(env: Env, pg_db: str) -> None:
    """A join already done keeps no wait: `ledger migrate` copies and counts only the join still in waiting/."""
    env.configure({"worker": env.agent(), "merger": env.agent()})
    first = env.daemon()
    first.wait_ready()
    env.drop(order("P1"))
    env.drop(order("DONE-JOIN", to="merger", after=["P1"]))
    env.wait_job("DONE-JOIN", "done")
    env.cli("pause", "worker", check=True)
    env.drop(order("P2"))
    env.drop(order("OPEN-JOIN", to="merger", after=["P2"]))
    first.wait_event("job.waiting", job_id="OPEN-JOIN")
    assert first.stop() == 0
    moved = env.cli("ledger", "migrate", "-", input=pg_db + "\n")
    assert moved.returncode == 0, moved.stderr
    assert "with 1 join wait," in moved.stdout, moved.stdout
    assert _waits(pg_db) == [("OPEN-JOIN", "P2", "all_done")]


def test_migrate_of_one_job_says_so_in_the_singular(env: Env, pg_db: str) -> None:
    """`ledger migrate` of a ledger that knows one job id prints `1 job id copied`, as its other counts read."""
    env.drop(order("ONE-1"))
    assert env.cli("run", "--once", timeout=120).returncode == 0
    moved = env.cli("ledger", "migrate", "-", input=pg_db + "\n")
    assert moved.returncode == 0, moved.stderr
    assert ": 1 job id copied from " in moved.stdout, moved.stdout
    assert "with 0 join waits, 0 gates, 0 gate waits, 0 requests" in moved.stdout, moved.stdout
