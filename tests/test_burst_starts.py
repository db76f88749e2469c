"""A burst of orders on a root held in memory: the first agents start while the rest are being claimed.

On tmpfs a call to an idle ledger lane may stop the loop in place until its answer is
back (``lanes.HOLD_S``: cheaper than a wake-up for one small claim). A burst is claimed
in chunks of ``CLAIM_CHUNK``; held, the chunks were claimed one after another with the
loop stopped, and not one agent started before the last order of the burst was claimed
(2,000 orders: the first agent 0.8 to 1 s after the drop). A chunk's trip now never holds
the loop, so the first chunk's agents start while the lane claims the next.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Env
from helpers_faults import env_under, hold_agent, tiny_order, ts

from dispatcher.core.scheduler import CLAIM_CHUNK
from dispatcher.storage import in_memory

ORDERS = 6 * CLAIM_CHUNK


@pytest.fixture
def shm_env(tmp_path: Path) -> Iterator[Env]:
    """An Env whose dispatch root lives on /dev/shm (tmpfs), its config and scripts on tmp_path."""
    with env_under("/dev/shm", "dispatcher-burst-", side=tmp_path) as e:
        yield e


def test_the_first_agents_of_a_burst_start_before_its_last_order_is_claimed(shm_env: Env) -> None:
    env = shm_env
    env.configure({"tiny": hold_agent(env, 0, concurrency=ORDERS)}, max_jobs=ORDERS)
    assert in_memory(env.root), "this test needs /dev/shm on tmpfs: the hold is only taken there"
    for i in range(ORDERS):  # waiting at start: the first turn sends them all, in chunks
        env.drop(tiny_order(f"B-{i:04d}"))
    d = env.daemon()
    d.wait_ready()
    for i in range(ORDERS):
        env.wait_job(f"B-{i:04d}", "done", timeout=120)
    events = d.events()
    claims = [ts(e["timestamp"]) for e in events if e.get("event") == "job.claimed"]
    starts = [ts(e["timestamp"]) for e in events if e.get("event") == "agent.started"]
    assert len(claims) == len(starts) == ORDERS
    assert min(starts) < max(claims), (
        f"the first agent started {min(starts) - min(claims):.3f} s after the first claim, "
        f"after the last one ({max(claims) - min(claims):.3f} s): the loop waited out every chunk's claim"
    )
    assert d.stop() == 0
