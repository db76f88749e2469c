"""`expires` (contract section 16) for work that waits for a slot or a gate: not started by then, it ends `expired`.

Real daemons and folders: an order read while its slot is busy is refused as
`expired` (failed/<stem>@<time>/) once its time has come; a claimed job that
waits for a gate (a join whose agent is paused) fails with reason `expired` in
failed/<job_id>/. In both cases its agent never starts; work without `expires` runs.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
from conftest import Env, order, wait_until

SLOW_S = "8"


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.mark.parametrize(
    ("max_jobs", "to"),
    [(1, "worker"), (2, "slow")],
    ids=["every-slot-busy", "agent-concurrency-busy"],
)
def test_an_order_that_expires_while_waiting_for_a_slot_ends_expired_and_never_starts(
    env: Env, max_jobs: int, to: str
) -> None:
    """A slow job holds the only slot: an order expiring 2 s ahead is refused `expired` then; a plain one runs."""
    env.configure({"slow": env.agent("--sleep", SLOW_S, concurrency=1), "worker": env.agent()}, max_jobs=max_jobs)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("slow1", to="slow"))
    d.wait_event("agent.started", job_id="slow1")
    expires = time.time() + 2
    env.drop(order("exp", to=to, expires=iso(expires)))
    env.drop(order("plain", to=to))
    refused = env.wait_refused("exp")
    late = datetime.fromisoformat(refused["finished"].replace("Z", "+00:00")).timestamp() - expires
    assert late < 3, f"refused {late:.1f} s after its expires: at the busy slot's end, not its time"
    assert (refused["state"], refused["job_id"], refused["reason"]) == ("failed", "exp", "expired")
    env.wait_job("plain", "done")
    assert not (env.root / "failed" / "exp").exists() and not (env.root / "inbox" / "exp.json").exists()
    assert sorted(j for j, _ in env.starts()) == ["plain", "slow1"]
    assert any(e.get("event") == "job.refused" and e.get("reason") == "expired" for e in d.events())
    assert d.stop() == 0


def test_a_job_waiting_for_a_paused_agent_past_its_expires_fails_expired_without_a_start(env: Env) -> None:
    """A join whose agent is paused fails `expired` at its expires, no attempt; later work and a `retry` of it run."""
    # W1 runs 6 s: the `pause` below must land before it ends (a command's start takes seconds on a busy machine)
    env.configure({"worker": env.agent("--sleep", "6"), "merger": env.agent()})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("W1"))
    env.drop(order("M", to="merger", after=["W1"], expires=iso(time.time() + 12)))
    d.wait_event("job.waiting", job_id="M", rule="all_done")  # claimed, in waiting/ until W1 is done
    env.cli("pause", "merger", check=True)
    d.wait_event("job.waiting", job_id="M", kind="pause")  # W1 is done: now it waits for the gate, in active/
    result = env.wait_job("M", "failed")
    assert (result["reason"], result["attempts"]) == ("expired", [])
    assert d.wait_event("job.failed", job_id="M")["reason"] == "expired"
    env.cli("resume", "merger", check=True)
    env.drop(order("M2", to="merger"))
    env.wait_job("M2", "done")
    assert sorted(j for j, _ in env.starts()) == ["M2", "W1"]
    env.cli("retry", "M", check=True)  # asked for by hand: it runs, expires or not
    wait_until(lambda: (env.root / "done" / "M" / "result.json").exists(), what="M done after retry")
    assert sorted(j for j, _ in env.starts()) == ["M", "M2", "W1"]
    assert d.stop() == 0


@pytest.mark.parametrize("resumed", [False, True], ids=["still-paused", "resumed-before-its-expires"])
def test_an_order_for_a_paused_agent_expires_on_time_while_every_slot_is_busy(env: Env, resumed: bool) -> None:
    """`pause merger`; a slow job holds the only slot; an order for merger expiring 4 s ahead (with `resume merger`
    1 s later, the slot still busy, or not) is refused `expired` at its expires, not when the slot frees (README:
    also when it waited for a gate, a `pause`, with every slot busy)."""
    env.configure({"slow": env.agent("--sleep", "10"), "merger": env.agent()}, max_jobs=1)
    d = env.daemon()
    d.wait_ready()
    env.cli("pause", "merger", check=True)
    env.drop(order("slow1", to="slow"))
    d.wait_event("agent.started", job_id="slow1")
    expires = time.time() + 4
    env.drop(order("exp", to="merger", expires=iso(expires)))
    if resumed:
        time.sleep(1)
        env.cli("resume", "merger", check=True)
    refused = env.wait_refused("exp")
    late = datetime.fromisoformat(refused["finished"].replace("Z", "+00:00")).timestamp() - expires
    assert late < 3, f"refused {late:.1f} s after its expires: at the busy slot's end, not its time"
    assert refused["reason"] == "expired" and sorted(j for j, _ in env.starts()) == ["slow1"]
    assert d.stop() == 0
