"""A short ledger outage (contract section 12): a daemon that cannot renew its lease starts no agent.

The daemon reaches a real PostgreSQL server through a TCP proxy that can go silent
(every byte held, both ways) and speak again, as a stalled network path does. An
order dropped just after the silence begins has its claim on the way to the ledger
when the daemon fences itself at lease / 2; that claim lands when the path comes
back, before the lease is renewed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from conftest import Env, wait_until
from helpers_faults import alive, hold_agent, tiny_order
from pgserver import PgServer
from tcp_proxy import Proxy

pytest_plugins = ["pg_fixtures"]
pytestmark = pytest.mark.postgres

LEASE = 3.0


@pytest.fixture
def stall(pg_server: PgServer) -> Iterator[Proxy]:
    proxy = Proxy(pg_server.host, pg_server.port)
    try:
        yield proxy
    finally:
        proxy.close()


def test_an_order_claimed_during_an_outage_starts_only_once_the_lease_is_renewed(
    env: Env, stall: Proxy, pg_db: str
) -> None:
    """Silent for about lease / 2 + 1 s, then back: the order's claim lands while the daemon is still fenced.
    Its agent (not retry-safe) is not started then, only after `lease.renewed`; the job runs once and is done.
    The job whose agent the fence ended fails as interrupted by a stop, not as a lost host's."""
    env.configure(
        {"tiny": hold_agent(env, 0), "long": hold_agent(env, 30)}, ledger=stall.via(pg_db), lease=LEASE, max_jobs=2
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(tiny_order("long", to="long"))  # running when the daemon fences itself: its agent is ended
    d.wait_event("agent.started", job_id="long")
    stall.silent()
    time.sleep(0.3)
    env.drop(tiny_order("blip"))
    d.wait_event("lease.fenced", timeout=30)
    time.sleep(0.5)
    stall.speak()
    result = env.wait_job("blip", timeout=60)
    events = [(e["event"], e.get("job_id")) for e in d.events()]
    assert result["state"] == "done", result.get("reason")
    assert [j for j, _a in env.starts()] == ["long", "blip"], "each agent ran once"
    assert ("job.fenced", "blip") not in events
    started = events.index(("agent.started", "blip"))
    assert ("lease.renewed", None) in events[:started], "no agent starts before the lease is renewed"
    # the job its own fence stopped is taken back by this daemon: no host was lost, no daemon stopped, and the
    # attempt keeps the end the daemon saw (its exit status and time), not one lost to a crash
    failed = env.wait_job("long", "failed", timeout=60)
    reason = failed["reason"]
    assert "interrupted: its daemon could not renew its lease" in reason, reason
    assert "host was lost" not in reason and "stop or crash" not in reason and "status lost" not in reason, reason
    assert reason.startswith("exit_ok: ended by its daemon after "), reason
    [cut] = failed["attempts"]
    assert cut["exit_code"] is not None and cut["exit_code"] != 0 and cut["lease_unrenewed"] is True, cut
    ended = next(e for e in d.events() if e["event"] == "agent.exited" and e.get("job_id") == "long")
    # the end the daemon saw, not its recovery (the record's figure is made from its two times, to the ms)
    assert abs(cut["duration_ms"] - ended["duration_ms"]) <= 2, (cut, ended)
    assert not list((env.root / "failed" / "long" / "attempts" / "1").glob(".attempt*")), "the kept record is taken"
    assert d.stop() == 0


def test_an_idle_daemon_fences_itself_within_the_lease_and_ends_its_agent(env: Env, stall: Proxy, pg_db: str) -> None:
    """Nothing happening but one running agent (inotify, the 30 s rescan): the path goes silent and the daemon
    still logs `lease.fenced` and ends its agent's group well before a full lease, when another daemon may take
    the job over. (An idle loop used to notice only at its next wake-up: the rescan, or the agent's exit.)"""
    env.configure({"long": hold_agent(env, 60)}, ledger=stall.via(pg_db), lease=LEASE, max_jobs=1, rescan_interval=30)
    d = env.daemon()
    d.wait_ready()
    env.drop(tiny_order("idle", to="long"))
    d.wait_event("agent.started", job_id="idle")
    wait_until(lambda: env.count_file.exists() and len(env.count_file.read_text().split()) >= 3, 30, "the agent")
    pid = int(env.count_file.read_text().split()[2])
    time.sleep(1.0)  # the loop settles into its wait
    stall.silent()
    silent_at = time.monotonic()
    try:
        d.wait_event("lease.fenced", timeout=30)
        fenced_after = time.monotonic() - silent_at
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        ended_after = time.monotonic() - silent_at
    finally:
        stall.speak()
    assert fenced_after < 2 * LEASE, f"lease.fenced came {fenced_after:.1f} s after the silence began"
    assert not alive(pid) and ended_after < 2 * LEASE + 1, f"the agent ran on {ended_after:.1f} s"
    d.wait_event("lease.renewed", timeout=30)
    assert d.stop() == 0


def test_a_job_a_clean_stop_interrupted_is_not_said_to_have_lost_its_host(env: Env, pg_db: str) -> None:
    """A daemon on the PostgreSQL ledger stopped by SIGTERM past stop_timeout (its agent ended, the job left in
    active/), then started again: the job fails as interrupted by a stop, not as a lost host's (its daemon's row
    says it stopped cleanly)."""
    env.configure({"long": hold_agent(env, 30)}, ledger=pg_db, lease=LEASE, stop_timeout=1, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(tiny_order("halted", to="long"))
    d.wait_event("agent.started", job_id="halted")
    assert d.stop() == 0
    assert (env.root / "active" / "halted").is_dir()
    d2 = env.daemon()
    reason = env.wait_job("halted", "failed", timeout=60)["reason"]
    assert "interrupted: by a stop or crash" in reason and "host was lost" not in reason, reason
    assert d2.stop() == 0


def test_a_daemon_declared_lost_says_daemon_stopping_once_and_why(env: Env, pg_db: str) -> None:
    """Another daemon's reaper marks this one lost: it stops for good with one ``daemon.stopping`` line, an error
    saying why (it logged a second one, as if a SIGTERM had come), and ends its running agent."""
    env.configure({"long": hold_agent(env, 60)}, ledger=pg_db, lease=LEASE, max_jobs=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(tiny_order("held", to="long"))
    d.wait_event("agent.started", job_id="held")
    owner = d.wait_event("daemon.started")["owner"]
    with psycopg.connect(pg_db, autocommit=True) as conn:  # what a reaper on another host writes
        conn.execute("UPDATE daemons SET ended = 'lost', ended_at = now() WHERE owner = %s", (owner,))
    d.wait(30)
    stopping = [e for e in d.events() if e.get("event") == "daemon.stopping"]
    assert len(stopping) == 1, stopping
    assert stopping[0]["level"] == "error" and "declared lost" in stopping[0]["reason"]
    assert "signal" not in stopping[0]
