"""Joins across daemons sharing one PostgreSQL ledger (contract sections 12 and 16).

Two daemons on one root and one PostgreSQL database stand for two hosts (the
many-hosts tests put each in its own network namespace; a join needs no more
than a shared ledger). Parents finish on both; the merger runs exactly once.
"""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import Env, order, wait_until
from test_joins import join_agents, parents_log, starts_of

pytest_plugins = ["pg_fixtures"]
pytestmark = pytest.mark.postgres


def test_parents_finishing_on_two_hosts_run_the_merger_once(env: Env, pg_db: str) -> None:
    """10 parents finish on two daemons of one PostgreSQL ledger; the merger waiting for them runs once."""
    agents = join_agents(env)
    agents["worker"] = env.agent("--sleep", "0.3", concurrency=4)
    env.configure(agents, ledger=pg_db, lease=5, max_jobs=2, rescan_interval=1)
    a, b = env.daemon(), env.daemon()
    a.wait_ready()
    b.wait_ready()
    parents = [f"h{i:02d}" for i in range(10)]
    env.drop(order("merge", to="merger", after=parents))
    for p in parents:
        env.drop(order(p))
    env.wait_job("merge", "done")
    done_on = Counter(
        name
        for name, d in (("a", a), ("b", b))
        for e in d.events()
        if e.get("event") == "job.done" and e["job_id"] in parents
    )
    assert done_on["a"] > 0 and done_on["b"] > 0, f"parents finished on one daemon only: {done_on}"
    assert starts_of(env, "merge") == 1
    [(_, record)] = parents_log(env)
    assert {p["state"] for p in record} == {"done"}
    assert a.stop() == 0 and b.stop() == 0


def test_a_join_claimed_by_a_host_that_died_is_run_by_another(env: Env, pg_db: str) -> None:
    """Host A claims the merger and is killed -9; host B finishes the parents and runs the merger once."""
    env.configure(join_agents(env), ledger=pg_db, lease=2, rescan_interval=0.5)
    a = env.daemon()
    env.drop(order("merge", to="merger", after=["p1", "p2"]))
    a.wait_event("job.waiting", job_id="merge")
    a.kill()
    b = env.daemon()
    b.wait_ready()
    for p in ("p1", "p2"):
        env.drop(order(p))
    env.wait_job("merge", "done")
    wait_until(lambda: any(e.get("event") == "job.joined" for e in b.events()), what="job.joined on b")
    assert starts_of(env, "merge") == 1
    assert b.stop() == 0
