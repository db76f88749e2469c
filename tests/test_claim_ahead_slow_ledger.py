"""Claims made ahead on a slow ledger: the daemon waits for a claim's answer, its loop never spins.

A PostgreSQL server behind a proxy that holds every chunk 5 ms makes each claim's trip
take tens of milliseconds. While orders of a quick agent are claimed ahead, the next
orders in inbox/ wait for that trip; a daemon with free slots must not turn its loop
again and again meanwhile. It once did: a CPU burnt for every trip, the run three times
as long (CPU 0.77 of the wall time, against 0.08 now).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Env, wait_until
from helpers_faults import hold_agent, tiny_order
from pgserver import PgServer
from tcp_proxy import Proxy

pytest_plugins = ["pg_fixtures"]
pytestmark = pytest.mark.postgres


@pytest.fixture
def slow(pg_server: PgServer) -> Iterator[Proxy]:
    proxy = Proxy(pg_server.host, pg_server.port, delay_s=0.005)
    try:
        yield proxy
    finally:
        proxy.close()


def cpu_seconds(pid: int) -> float:
    """Return the user + system CPU time a process itself has used so far (its children not counted)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_orders_behind_a_claim_made_ahead_wait_without_spinning(env: Env, slow: Proxy, pg_db: str) -> None:
    """max_jobs 4, a 100 ms agent of concurrency 1, 12 orders: every job runs once, and the daemon's own CPU
    stays well under half a CPU over the run (a loop turning while claims travel takes most of one)."""
    quick = hold_agent(env, 0.1, concurrency=1)
    env.configure({"quick": quick}, ledger=slow.via(pg_db), max_jobs=4)
    d = env.daemon()
    d.wait_ready()
    assert d.proc is not None
    jobs = [f"Q{i:02d}" for i in range(12)]
    cpu0, t0 = cpu_seconds(d.proc.pid), time.monotonic()
    for job_id in jobs:
        env.drop(tiny_order(job_id, to="quick"))
    wait_until(lambda: sorted(os.listdir(env.root / "done")) == jobs, 180, "every job done")
    cpu, wall = cpu_seconds(d.proc.pid) - cpu0, time.monotonic() - t0
    assert sorted(j for j, _a in env.starts()) == jobs
    assert cpu < 0.5 * wall, f"the daemon used {cpu:.1f} s of CPU in {wall:.1f} s"
    assert d.stop() == 0
