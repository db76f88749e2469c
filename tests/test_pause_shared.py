"""`pause` on a shared ledger (contract sections 12 and 14): in force on every host once the command returns.

Two daemons share one root and one PostgreSQL ledger and watch the inbox by polling,
as daemons on several hosts of a network filesystem do. `pause` is run as a command of
its own; the order dropped right after it must not start on either daemon.
"""

from __future__ import annotations

import time

import pytest
from conftest import Env, order

pytest_plugins = ["pg_fixtures"]
pytestmark = pytest.mark.postgres


def test_an_order_dropped_right_after_pause_starts_on_no_host_until_resume(env: Env, pg_db: str) -> None:
    """Five rounds of pause, drop, wait, resume: no attempt starts while its agent is paused; each runs after."""
    env.configure(ledger=pg_db, watch="poll", poll_interval=0.2, lease=6, max_jobs=2)
    daemons = [env.daemon(), env.daemon()]  # the same root, ledger and config: two daemons, as on two hosts
    for d in daemons:
        d.wait_ready()
    for i in range(5):
        job_id = f"PZ{i}"
        assert env.cli("pause", "worker", check=True).returncode == 0
        env.drop(order(job_id))
        time.sleep(1.5)  # longer than the gates' refresh and two inbox polls
        started = [j for j, _a in env.starts() if j == job_id]
        assert started == [], f"{job_id} started while its agent was paused (round {i})"
        assert env.cli("resume", "worker", check=True).returncode == 0
        env.wait_job(job_id, "done", timeout=60)
    assert sorted(j for j, _a in env.starts()) == [f"PZ{i}" for i in range(5)]
    for d in daemons:
        assert d.stop() == 0
