"""A gated agent holds no slot (contract section 14) against a real daemon: other agents' work goes on.

A job that waits for a gate gives back its ``max_jobs`` slot and its concurrency
slot, and an order of a gated agent is left unread in inbox/, so that neither a
waiting job nor a paused agent's backlog stops the orders of other agents.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from conftest import Env, order, wait_until

pytest_plugins = ["pg_fixtures"]


def status(env: Env) -> dict[str, Any]:
    return json.loads(env.cli("status", "--json", check=True).stdout)


def listed(env: Env, *args: str) -> list[dict[str, Any]]:
    out = env.cli("list", "--json", *args, check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.parametrize("engine", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_job_waiting_for_a_pause_gives_its_slot_to_another_agent(
    env: Env, engine: str, request: pytest.FixtureRequest
) -> None:
    """max_jobs 1, A paused with a claimed job waiting: B's order is done; after `resume A` A's job runs once."""
    ledger = {"ledger": request.getfixturevalue("pg_db")} if engine == "postgres" else {}
    env.configure(
        agents={"A": env.agent("--fail-attempts", "1", max_attempts=1, retry_safe=True), "B": env.agent()},
        max_jobs=1,
        **ledger,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("A-1", to="A"))
    env.wait_job("A-1", "failed")
    env.cli("pause", "A", check=True)
    env.cli("retry", "A-1", check=True)  # claimed again while A is paused: it waits, in active/
    d.wait_event("job.waiting", job_id="A-1")
    info = status(env)
    [waiting] = info["waiting"]
    assert {k: waiting[k] for k in ("job_id", "agent", "until", "daemon_alive")} == {
        "job_id": "A-1",
        "agent": "A",
        "until": None,
        "daemon_alive": True,
    }
    assert info["active"] == [] and info["counts"]["active"] == 0  # listed once, as waiting
    assert [r["state"] for r in listed(env, "--agent", "A")] == ["waiting"]
    env.drop(order("B-1", to="B"))
    env.wait_job("B-1", "done")
    assert status(env)["counts"]["waiting"] == 1 and ("A-1", 2) not in env.starts()
    env.cli("resume", "A", check=True)
    env.wait_job("A-1", "done")
    assert [s for s in env.starts() if s[0] == "A-1"] == [("A-1", 1), ("A-1", 2)]
    info = status(env)
    assert info["counts"]["waiting"] == 0 and info["counts"]["done"] == 2


def test_a_job_waiting_for_a_pause_by_hand_says_until_resumed_in_every_text(env: Env) -> None:
    """A pause has no time: `list`, `status` and `show` say `until resumed`, as `status`'s gate line does, not
    `until -`; `list --json` keeps `until` null."""
    env.configure(agents={"A": env.agent("--exit", "1")})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("P-1", to="A"))
    env.wait_job("P-1", "failed")
    env.cli("pause", "A", check=True)
    env.cli("retry", "P-1", check=True)
    d.wait_event("job.waiting", job_id="P-1")
    for args in (["list"], ["status"], ["show", "P-1"]):
        text = env.cli(*args, check=True).stdout
        assert "until resumed" in text and "until -" not in text, (args, text)
    [row] = listed(env, "--agent", "A")
    assert row["state"] == "waiting" and row.get("until") is None
    assert d.stop() == 0


def test_a_paused_agents_backlog_does_not_stop_other_agents(env: Env) -> None:
    """A paused, 100 orders for A then 3 for B: B's are done while A waits; after resume A's run, oldest first."""
    env.configure(agents={"A": env.agent(), "B": env.agent()}, max_jobs=2)
    d = env.daemon()
    d.wait_ready()
    env.cli("pause", "A", check=True)
    wait_until(lambda: status(env)["gates"], what="the pause in the ledger")
    a_ids = [f"A-{i:03d}" for i in range(100)]
    for job_id in a_ids:
        env.drop(order(job_id, to="A"))
        time.sleep(0.002)  # distinct modification times: oldest first is A-000 ... A-099
    for job_id in ("B-1", "B-2", "B-3"):
        env.drop(order(job_id, to="B"))
    for job_id in ("B-1", "B-2", "B-3"):
        env.wait_job(job_id, "done")
    info = status(env)
    assert info["counts"]["inbox"] == 100 and info["counts"]["done"] == 3
    assert not [s for s in env.starts() if s[0].startswith("A-")]
    queued = listed(env, "--state", "inbox", "--agent", "A")
    assert len(queued) == 100 and {r["state"] for r in queued} == {"inbox"}
    env.cli("cancel", "A-050", check=True)  # a queued order of a paused agent is still cancelled at once
    assert env.wait_job("A-050", "failed")["reason"] == "cancelled"
    env.cli("hold", "A-051", check=True)
    env.cli("resume", "A", check=True)
    rest = [j for j in a_ids if j not in ("A-050", "A-051")]
    for job_id in rest:
        env.wait_job(job_id, "done", timeout=240)
    assert [s[0] for s in env.starts() if s[0].startswith("A-")] == rest
    assert status(env)["counts"] | {"done": 101, "held": 1, "inbox": 0} == status(env)["counts"]


def test_an_order_left_unread_for_a_paused_agent_is_refused_expired_at_its_expires(env: Env) -> None:
    """Paused agent's orders (JSON, YAML) expiring 2 s ahead are refused `expired` while it stays paused, unstarted."""
    env.configure(agents={"A": env.agent()})
    d = env.daemon()
    d.wait_ready()
    env.cli("pause", "A", check=True)
    wait_until(lambda: status(env)["gates"], what="the pause in the ledger")
    expires = time.time() + 2
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(expires)) + f".{int(expires % 1 * 1e6):06d}Z"
    env.drop(order("EXP-1", to="A", expires=stamp))
    env.drop(order("EXP-2", to="A", expires=stamp), name="EXP-2.yaml")
    env.drop(order("KEEP-1", to="A"))
    for stem in ("EXP-1", "EXP-2"):
        refused = env.wait_refused(stem)
        assert (refused["job_id"], refused["reason"]) == (stem, "expired") and time.time() >= expires
    assert status(env)["gates"] and env.starts() == []
    env.cli("resume", "A", check=True)
    env.wait_job("KEEP-1", "done")
    assert env.starts() == [("KEEP-1", 1)]
