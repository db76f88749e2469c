"""Daily cost caps (contract section 14): once the last 24 hours' spend reaches a cap, new attempts wait."""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from conftest import Daemon, Env, order, wait_until

HEADLESS = Path(__file__).resolve().parent / "agents" / "headless.py"


def agent(env: Env, name: str, cost: float, **settings: Any) -> dict[str, Any]:
    plan = env.tmp / f"plan-{name}.json"
    plan.write_text(json.dumps({"cost_usd": cost}))
    spec: dict[str, Any] = {
        "command": [sys.executable, str(HEADLESS), "--count", str(env.count_file), "--plan", str(plan)],
        "timeout": 30,
        "writes": ["out.csv"],
    }
    spec.update(settings)
    return spec


def notify_argv(env: Env) -> list[str]:
    script = "import sys; open(sys.argv[1], 'a').write(' | '.join(sys.argv[2:]) + '\\n')"
    return [sys.executable, "-c", script, str(env.tmp / "notified.txt"), "{event}", "{agent}", "{reason}"]


def test_an_agent_cap_reached_mid_run_holds_the_next_attempts(env: Env) -> None:
    """0.4 USD a job, cap 1.0: three jobs run, the fourth waits gated (budget.gated logged and notified)."""
    env.configure(agents={"worker": agent(env, "w", 0.4, max_daily_cost_usd=1.0)}, notify=notify_argv(env))
    d = env.daemon()
    d.wait_ready()
    for i in range(1, 6):
        env.drop(order(f"DAY-{i}"))
    gated = d.wait_event("budget.gated", agent="worker")
    assert gated["reason"] == "1.2 USD in 24 h reached max_daily_cost_usd 1"
    wait_until(lambda: json.loads(env.cli("status", "--json", check=True).stdout)["counts"]["waiting"] == 1)
    info = json.loads(env.cli("status", "--json", check=True).stdout)
    assert info["counts"]["done"] == 3 and info["counts"]["inbox"] == 1
    assert [g["kind"] for g in info["gates"]] == ["budget"]
    time.sleep(1.5)
    assert len(env.starts()) == 3  # no attempt of the agent started after the cap
    line = wait_until(lambda: (env.tmp / "notified.txt").exists() and (env.tmp / "notified.txt").read_text())
    assert line == "budget.gated | worker | 1.2 USD in 24 h reached max_daily_cost_usd 1\n"
    assert len([e for e in d.events() if e.get("event") == "budget.gated"]) == 1


def test_a_retry_after_the_cap_is_reached_waits_and_its_spend_stays_counted(env: Env) -> None:
    """1 USD an attempt, cap 1.5, F1 and G1 failed: `retry F1` waits gated; the 24 h spend stays 2 USD."""
    cost = json.dumps({"type": "result", "total_cost_usd": 1.0})
    worker = env.agent("--json-result", cost, "--fail-attempts", "1", max_daily_cost_usd=1.5, max_attempts=1)
    env.configure(agents={"worker": worker}, max_jobs=1)
    env.drop(order("F1"))
    env.drop(order("G1"))
    assert env.cli("run", "--once").returncode == 1
    assert [env.result(j, "failed")["cost_usd"] for j in ("F1", "G1")] == [1.0, 1.0]
    d = env.daemon()
    d.wait_ready()
    assert env.cli("retry", "F1").returncode == 0
    gated = d.wait_event("budget.gated", agent="worker")
    assert gated["reason"] == "2 USD in 24 h reached max_daily_cost_usd 1.5"
    time.sleep(1.5)
    assert len(env.starts()) == 2  # F1's retry did not start
    info = json.loads(env.cli("status", "--json", check=True).stdout)
    assert info["spend_24h"] == {"worker": 2.0}
    assert d.stop() == 0


def test_the_root_cap_holds_every_agent(env: Env) -> None:
    """max_daily_cost_usd at the root, 0.5: after a 0.3 and a 0.3 job of two agents, neither starts again."""
    env.configure(agents={"a": agent(env, "a", 0.3), "b": agent(env, "b", 0.3)}, max_daily_cost_usd=0.5, max_jobs=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("ROOT-1", to="a"))
    env.wait_job("ROOT-1", "done")
    env.drop(order("ROOT-2", to="b"))
    env.wait_job("ROOT-2", "done")
    env.drop(order("ROOT-3", to="a"))
    gated = d.wait_event("budget.gated", agent="*")
    assert gated["reason"] == "0.6 USD in 24 h reached max_daily_cost_usd 0.5"
    time.sleep(1.5)
    assert [s[0] for s in env.starts()] == ["ROOT-1", "ROOT-2"]


def test_the_24_hour_spend_reads_an_index_not_every_finished_job(tmp_path: Path) -> None:
    """On 20,000 finished jobs, the last day's spend (caps, `status`, the web view) is summed from an index."""
    import sqlite3

    from dispatcher.ledger.base import Entry
    from dispatcher.ledger.sqlite import SqliteLedger
    from dispatcher.lifecycle import Row
    from dispatcher.query.report import spend_since

    ledger = SqliteLedger(tmp_path / "ledger.sqlite3", tmp_path)
    now = time.time()
    old = [
        Entry(f"O{i:05d}", Row.DONE, "a", None, 1, None, None, None, 0, 1.0, None, now - 90000 - i)
        for i in range(20000)
    ]
    new = [
        Entry(f"N{i}", Row.FAILED, "b" if i else None, None, 1, None, None, None, 0, 0.25, None, now - i)
        for i in range(4)
    ]
    assert ledger.load_rows(old + new) == 20004
    assert spend_since(ledger, now - 86400) == {"-": 0.25, "b": 0.75}
    plan = (
        sqlite3.connect(tmp_path / "ledger.sqlite3")
        .execute(
            "EXPLAIN QUERY PLAN SELECT updated, coalesce(agent, '-'), cost_usd FROM jobs WHERE state IN (?, ?, ?, ?)"
            " AND updated >= ? AND cost_usd IS NOT NULL ORDER BY updated",
            ("done", "failed", "review", "claimed", now - 86400),
        )
        .fetchall()
    )
    assert "USING INDEX jobs_spent" in str(plan), plan


def cap_reached(env: Env, first: str, second: str, to: str, gated: str) -> Daemon:
    """Start a daemon; `first` (to `to`) runs and spends; `second` then waits, gated on `gated`'s cap."""
    d = env.daemon()
    d.wait_ready()
    env.drop(order(first, to=to))
    env.wait_job(first, "done")
    env.drop(order(second, to=to))
    d.wait_event("budget.gated", agent=gated)
    return d


def test_a_root_cap_removed_by_a_reload_lifts_its_gate_and_the_waiting_job_runs(env: Env) -> None:
    """Cap 0.1 reached; the config drops it and the daemon reloads: the window allows, ROOT-B runs."""
    agents = {"a": agent(env, "a", 0.2), "b": agent(env, "b", 0.0)}
    env.configure(agents=agents, max_daily_cost_usd=0.1, max_jobs=1)
    d = cap_reached(env, "ROOT-A", "ROOT-B", "a", "*")
    env.configure(agents=agents, max_jobs=1)  # no cap any more
    assert env.cli("reload").returncode == 0
    lifted = d.wait_event("agent.resumed", agent="*")
    assert lifted["kind"] == "budget"
    env.wait_job("ROOT-B", "done")
    info = json.loads(env.cli("status", "--json", check=True).stdout)
    assert info["gates"] == []
    env.drop(order("ROOT-C", to="a"))  # a new order runs too
    env.wait_job("ROOT-C", "done")


def test_an_agent_cap_raised_by_a_reload_lets_its_waiting_job_run(env: Env) -> None:
    """Agent cap 0.5 reached by one 0.5 job; raised to 5 and reloaded: the waiting job runs at once."""
    env.configure(agents={"worker": agent(env, "w", 0.5, max_daily_cost_usd=0.5)})
    d = cap_reached(env, "RAISE-1", "RAISE-2", "worker", "worker")
    env.configure(agents={"worker": agent(env, "w", 0.5, max_daily_cost_usd=5.0)})
    assert env.cli("reload").returncode == 0
    env.wait_job("RAISE-2", "done")
    gated = [e for e in d.events() if e.get("event") == "budget.gated"]
    assert len(gated) == 1, gated  # not gated again under the old cap


def test_resume_star_lifts_the_root_cap_by_hand(env: Env) -> None:
    """`resume '*'` lifts the root's daily-cap gate (set again only if a later check still finds it reached)."""
    env.configure(agents={"a": agent(env, "a", 0.2)}, max_daily_cost_usd=0.1)
    d = cap_reached(env, "STAR-1", "STAR-2", "a", "*")
    proc = env.cli("resume", "*")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "*: resumed (budget gate lifted)"
    d.wait_event("agent.resumed", agent="*", kind="budget")
    # STAR-2 asks again: 0.2 USD still reaches 0.1, so the cap gates it anew (logged a second time)
    wait_until(lambda: len([e for e in d.events() if e.get("event") == "budget.gated"]) == 2)
    assert len(env.starts()) == 1


def test_a_daily_cap_is_said_in_plain_numbers(env: Env) -> None:
    """The daily cap's gate reason (budget.gated, status) shows costs as a person writes them (section 7: never
    Python notation): it read 1.5e+06 USD in 24 h reached max_daily_cost_usd 1e-05."""
    env.configure(agents={"worker": agent(env, "w", 1_500_000, max_daily_cost_usd=0.00001)})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("HUGE-DAY-1"))
    env.wait_job("HUGE-DAY-1", "done")
    env.drop(order("HUGE-DAY-2"))  # its start meets the cap
    gated = d.wait_event("budget.gated", agent="worker")
    assert gated["reason"] == "1500000 USD in 24 h reached max_daily_cost_usd 0.00001"
    info = json.loads(env.cli("status", "--json", check=True).stdout)
    assert [g["reason"] for g in info["gates"]] == [gated["reason"]]
    assert d.stop() == 0


def _gated_by_its_own_attempts(
    env: Env, job_id: str, usd: float, *, max_attempts: int
) -> tuple[Daemon, dict[str, Any]]:
    """Run one job of a retry-safe agent whose attempts fail at usd each, under a 0.5 USD daily cap, until the cap
    gates its next attempt; return the daemon and its budget.gated line."""
    cost = json.dumps({"type": "result", "total_cost_usd": usd})
    worker = env.agent("--json-result", cost, "--fail-attempts", "10", max_daily_cost_usd=0.5,
                       max_attempts=max_attempts, retry_safe=True)  # fmt: skip
    env.configure(agents={"worker": worker})
    d = env.daemon()
    d.wait_ready()
    env.drop(order(job_id))
    return d, d.wait_event("budget.gated", agent="worker")


def test_a_cap_reached_by_a_running_jobs_own_attempts_holds_its_next_attempt(env: Env) -> None:
    """0.3 USD an attempt that fails, 6 attempts allowed, cap 0.5: after two attempts (0.6 USD) the job's third
    waits gated, and `status` counts the running job's spend. All six ran (1.8 USD against a 0.5 cap): only
    finished jobs were counted."""
    d, gated = _gated_by_its_own_attempts(env, "OWN-1", 0.3, max_attempts=6)
    assert gated["reason"] == "0.6 USD in 24 h reached max_daily_cost_usd 0.5"
    time.sleep(1.5)
    assert len(env.starts()) == 2
    info = json.loads(env.cli("status", "--json", check=True).stdout)
    assert info["spend_24h"] == {"worker": 0.6} and info["counts"]["waiting"] == 1
    # the commands name the state `status` and `list` show (they said "is active")
    retry = env.cli("retry", "OWN-1")
    assert (retry.returncode, retry.stderr) == (1, "OWN-1: is waiting, only a failed job can be retried\n")
    approve = env.cli("approve", "OWN-1")
    assert (approve.returncode, approve.stderr) == (1, "OWN-1: is waiting, not waiting for review\n")
    for command, said in (
        ("hold", "only a queued order can be held"),
        ("release", "not held"),
        ("land", "not done (only a done job lands)"),
    ):
        proc = env.cli(command, "OWN-1")
        assert (proc.returncode, proc.stderr) == (1, f"OWN-1: is waiting, {said}\n"), command
    assert d.stop() == 0


def test_a_restart_does_not_move_a_running_jobs_noted_spend_later(env: Env) -> None:
    """A job gated by its own attempts' cost keeps the time its spend was counted across a restart of its daemon
    (the README: a daemon that takes over a job does not move its earlier attempts' cost). Each restart dated it
    again at the takeover, pushing the gate out by the time since the spend."""
    d, _ = _gated_by_its_own_attempts(env, "RS-1", 0.6, max_attempts=3)

    def spent() -> float:
        with sqlite3.connect(f"file:{env.root / '.state' / 'ledger.sqlite3'}?mode=ro", uri=True) as db:
            return float(db.execute("SELECT spent FROM jobs WHERE job_id = 'RS-1'").fetchone()[0])

    before = spent()
    assert d.stop() == 0
    time.sleep(1.5)
    d2 = env.daemon()
    d2.wait_ready()
    time.sleep(1.5)  # the recovered job has looked at its gate again
    assert spent() == before
    assert len(env.starts()) == 1
    assert d2.stop() == 0
