"""Signals and systemd: graceful stop, forced stop, reload, and the notify protocol.

Real signals go to a real daemon process; what counts is its exit code, the folders,
the agents' processes (read from /proc) and what arrives on a bound notify socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Daemon, Env, cli_env, order, wait_until
from helpers_faults import (
    ENV_DUMP,
    SLOW_FIRST,
    NotifyListener,
    agent_starts,
    alive,
    count_events,
    env_daemon,
    group_members,
    processes_with,
    tiny_agent,
    tiny_order,
    wait_count,
    wait_gone,
    wait_start,
    write_script,
)


def out_column(env: Env, job_id: str, column: str) -> set[str]:
    """Return the values of one column of the job's out.csv."""
    lines = (env.root / "done" / job_id / "work" / "out.csv").read_text().splitlines()
    header = lines[0].split(",")
    return {line.split(",")[header.index(column)] for line in lines[1:]}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_lets_running_agent_finish_and_claims_nothing_new(env: Env, sig: int) -> None:
    """SIGTERM/SIGINT: the running agent finishes within stop_timeout, no new claim, exit 0."""
    env.configure(agents={"worker": env.agent("--sleep", "2")}, stop_timeout=10)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("STOP-1"))
    d.wait_event("agent.started", job_id="STOP-1")
    sent = time.monotonic()
    d.signal(sig)
    d.wait_event("daemon.stopping")
    env.drop(order("STOP-2"))
    assert d.wait(20) == 0
    assert time.monotonic() - sent < 10
    assert env.result("STOP-1", "done")["state"] == "done"
    assert (env.root / "inbox" / "STOP-2.json").exists(), "a job was claimed after the stop signal"
    assert [j for j, _a, _p in agent_starts(env)] == ["STOP-1"]


def test_a_stop_while_another_process_holds_the_ledger_locked_ends_within_stop_timeout(env: Env) -> None:
    """A job finishes during a stop while another process holds the SQLite ledger locked: the daemon still
    exits 0 within stop_timeout (section 13), and the next start records the job, done."""
    env.configure(agents={"worker": env.agent("--sleep", "1")}, stop_timeout=4, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("LOCKED-1"))
    d.wait_event("agent.started", job_id="LOCKED-1")
    db = sqlite3.connect(env.root / ".state" / "ledger.sqlite3", isolation_level=None, timeout=10)
    db.execute("BEGIN EXCLUSIVE")  # as `sqlite3` in a shell, or a backup, would hold it
    try:
        sent = time.monotonic()
        d.signal(signal.SIGTERM)
        code = d.wait(30)
        took = time.monotonic() - sent
    finally:
        db.execute("ROLLBACK")
        db.close()
    assert code == 0
    assert took < 4, f"the stop took {took:.1f} s with stop_timeout 4"
    d2 = env.daemon()
    assert env.wait_job("LOCKED-1", "done")["state"] == "done"
    assert d2.stop() == 0


def test_a_stop_while_the_ledger_is_locked_at_start_up_ends_at_once(env: Env) -> None:
    """A daemon that starts while another process holds the SQLite ledger locked waits for it; a stop ends that
    wait at once (it has not become ready: nothing was claimed), exit 0 and no READY."""
    env.configure(stop_timeout=30)
    assert env.cli("run", "--once", timeout=60).returncode == 0  # the ledger exists
    db = sqlite3.connect(env.root / ".state" / "ledger.sqlite3", isolation_level=None, timeout=10)
    db.execute("BEGIN EXCLUSIVE")
    try:
        d = env.daemon()
        d.wait_event("ledger.waiting")  # the open waits for the lock (said after 5 s)
        sent = time.monotonic()
        d.signal(signal.SIGTERM)
        code = d.wait(40)
        took = time.monotonic() - sent
    finally:
        db.execute("ROLLBACK")
        db.close()
    assert code == 0
    assert took < 5, f"the stop took {took:.1f} s while the ledger was locked at start-up"
    assert d.wait_event("daemon.stopped")["reason"].startswith("a stop came during start-up")


def test_sigterm_ends_agent_that_outlives_stop_timeout_and_next_start_recovers(env: Env) -> None:
    """An agent still running at stop_timeout is ended, its job stays in active/ and recovers."""
    wrapper = write_script(env.tmp, "slow_first.py", SLOW_FIRST)
    agent = env.agent("--fork-child", "66.1", retry_safe=True, max_attempts=2)
    agent["command"] = [agent["command"][0], str(wrapper), *agent["command"][2:]]
    env.configure(agents={"worker": agent}, stop_timeout=1, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("LONG-1"))
    pid = wait_start(env, "LONG-1")
    d.wait_event("agent.started", job_id="LONG-1")
    sent = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait(20) == 0
    assert time.monotonic() - sent < 1 + 1 + 4, "the stop took far longer than stop_timeout"
    wait_gone([pid, *processes_with("time.sleep(66.1)")], [pid], timeout=3)
    assert (env.root / "active" / "LONG-1").is_dir()
    assert not (env.root / "active" / "LONG-1" / "result.json").exists()
    assert not (env.root / "done" / "LONG-1").exists()
    assert not (env.root / "failed" / "LONG-1").exists()

    d2 = env.daemon()
    result = env.wait_job("LONG-1", "done")
    d2.wait_event("job.recovered", job_id="LONG-1")
    assert [a["n"] for a in result["attempts"]][-1] == 2
    assert [(j, a) for j, a, _p in agent_starts(env)] == [("LONG-1", 1), ("LONG-1", 2)]
    assert d2.stop() == 0


def test_second_sigterm_ends_agents_at_once(env: Env) -> None:
    """A second SIGTERM ends the agents' groups at once instead of waiting stop_timeout."""
    env.configure(
        agents={"worker": env.agent("--sleep", "60", "--fork-child", "64.2")},
        stop_timeout=60,
        kill_grace=1,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("FORCE-1"))
    pid = wait_start(env, "FORCE-1")
    d.wait_event("agent.started", job_id="FORCE-1")
    d.signal(signal.SIGTERM)
    d.wait_event("daemon.stopping")
    assert d.proc is not None and d.proc.poll() is None, "the first SIGTERM did not wait"
    assert alive(pid)
    sent = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait(15) == 0
    assert time.monotonic() - sent < 1 + 5
    wait_gone([pid, *processes_with("time.sleep(64.2)")], [pid], timeout=3)
    assert (env.root / "active" / "FORCE-1").is_dir()


def test_second_sigterm_kills_an_agent_that_ignores_sigterm_without_waiting_kill_grace(env: Env) -> None:
    """A second SIGTERM/SIGINT "ends the agents' groups at once": an agent deaf to SIGTERM is not given kill_grace."""
    env.configure(
        agents={"worker": env.agent("--sleep", "60", "--ignore-term")},
        stop_timeout=60,
        kill_grace=60,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("DEAF-1"))
    pid = wait_start(env, "DEAF-1")
    d.wait_event("agent.started", job_id="DEAF-1")
    d.signal(signal.SIGTERM)
    d.wait_event("daemon.stopping")
    time.sleep(0.5)
    assert alive(pid)
    sent = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait(30) == 0
    assert time.monotonic() - sent < 10  # kill_grace is 60
    wait_gone([pid], [pid], timeout=3)
    assert (env.root / "active" / "DEAF-1").is_dir()


@pytest.mark.parametrize("second", [False, True])
def test_a_hanging_notification_does_not_hold_a_stop_past_stop_timeout(env: Env, second: bool) -> None:
    """A notify command that hangs: SIGTERM ends it at stop_timeout (a second SIGTERM: at once), logged."""
    marker = f"time.sleep(100.7)  # {env.tmp}"  # this test's own: the other variant may run at once (xdist)
    env.configure(
        agents={"worker": env.agent("--exit", "3")},
        notify=[sys.executable, "-c", f"import time; {marker}"],
        stop_timeout=4,
        kill_grace=1,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("NOTE-1"))
    env.wait_job("NOTE-1", "failed")
    wait_until(lambda: processes_with(marker), 15, "the notify command")
    sent = time.monotonic()
    d.signal(signal.SIGTERM)
    d.wait_event("daemon.stopping")
    if second:
        d.signal(signal.SIGTERM)
    assert d.wait(30) == 0
    took = time.monotonic() - sent
    assert took < (1 + 3 if second else 4 + 1 + 3), took  # within stop_timeout (and kill_grace), not 30 s
    assert not processes_with(marker)
    failed = [e for e in d.events() if e.get("event") == "notify.failed"]
    assert [e["error"] for e in failed] == ["ended: the daemon stopped"], failed


def _deaf_notification_beside_a_slow_agent(
    env: Env, marker: str, slow_flags: tuple[str, ...], *, stop_timeout: float, kill_grace: float
) -> Daemon:
    """Start a daemon whose agent `slow` runs (with slow_flags) while a failed job's notify command, which ignores
    SIGTERM and holds marker in its argv, hangs; return the daemon."""
    deaf = f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); {marker}"
    env.configure(
        agents={"worker": env.agent("--exit", "3"), "slow": env.agent("--sleep", "60", *slow_flags)},
        notify=[sys.executable, "-c", deaf],
        stop_timeout=stop_timeout,
        kill_grace=kill_grace,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("SLOW-1", to="slow"))
    d.wait_event("agent.started", job_id="SLOW-1")
    env.drop(order("NOTE-1"))
    env.wait_job("NOTE-1", "failed")
    wait_until(lambda: processes_with(marker), 15, "the notify command")
    return d


def test_a_notification_is_ended_at_the_stops_deadline_beside_an_agent_that_ignores_sigterm(env: Env) -> None:
    """A stop while an agent that ignores SIGTERM runs and a notify command hangs: the notification is ended at
    stop_timeout, beside the agent, not after the agent's own kill_grace (it was ended only once the agents were
    gone, and the stop took stop_timeout plus two kill_grace); the daemon is gone by stop_timeout + kill_grace."""
    marker = f"time.sleep(100.8)  # {env.tmp}"
    d = _deaf_notification_beside_a_slow_agent(env, marker, ("--ignore-term",), stop_timeout=2, kill_grace=3)
    sent = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait(30) == 0
    took = time.monotonic() - sent
    assert took < 2 + 3 + 1.5, took  # stop_timeout + kill_grace (and the exit), not + 2 x kill_grace
    assert not processes_with(marker)
    failed = [e for e in d.events() if e.get("event") == "notify.failed"]
    assert [e["error"] for e in failed] == ["ended: the daemon stopped"], failed


def test_a_second_sigterm_while_an_agent_runs_ends_a_hanging_notification_at_once(env: Env) -> None:
    """The second SIGTERM comes while an agent still runs (the loop takes it): the hanging notify of a failed job
    is ended then too, by SIGKILL, though it ignores SIGTERM; not at stop_timeout, nor after kill_grace."""
    marker = f"time.sleep(100.9)  # {env.tmp}"
    d = _deaf_notification_beside_a_slow_agent(env, marker, (), stop_timeout=30, kill_grace=30)
    d.signal(signal.SIGTERM)
    d.wait_event("daemon.stopping")
    time.sleep(0.5)
    sent = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait(60) == 0
    assert time.monotonic() - sent < 10  # stop_timeout and kill_grace are 30 s
    assert not processes_with(marker)
    failed = [e for e in d.events() if e.get("event") == "notify.failed"]
    assert [e["error"] for e in failed] == ["ended: the daemon stopped"], failed


def test_a_second_sigterm_during_the_shutdown_ends_a_notification_that_ignores_sigterm_at_once(env: Env) -> None:
    """Only a notification runs (the loop has ended): the first SIGTERM gives it stop_timeout, the second ends it at
    once by SIGKILL, not after kill_grace."""
    marker = f"time.sleep(100.8)  # {env.tmp}"
    deaf = f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); {marker}"
    env.configure(
        agents={"worker": env.agent("--exit", "3")},
        notify=[sys.executable, "-c", deaf],
        stop_timeout=20,
        kill_grace=20,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("NOTE-3"))
    env.wait_job("NOTE-3", "failed")
    wait_until(lambda: processes_with(marker), 15, "the notify command")
    d.signal(signal.SIGTERM)
    d.wait_event("daemon.stopping")
    time.sleep(1)
    assert processes_with(marker), "the first SIGTERM gives it stop_timeout"
    sent = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait(60) == 0
    assert time.monotonic() - sent < 8
    assert not processes_with(marker)


def test_run_once_stopped_while_it_runs_its_last_notification_gives_it_stop_timeout(env: Env) -> None:
    """`run --once` out of work runs its notifications; one SIGTERM then is a stop like any: the notification
    may run until stop_timeout (it is not signalled at once)."""
    log = env.tmp / "notify-signals.txt"
    script = (
        "import signal, sys, time\n"
        f"log = {str(log)!r}\n"
        "signal.signal(signal.SIGTERM, lambda *_: (open(log, 'a').write('TERM\\n'), sys.exit(0)))\n"
        "open(log, 'a').write('start\\n')\n"
        "time.sleep(3)\n"
        "open(log, 'a').write('end\\n')\n"
    )
    notify = env.tmp / "notify.py"
    notify.write_text(script)
    env.configure(agents={"worker": env.agent("--exit", "3")}, notify=[sys.executable, str(notify)], stop_timeout=15)
    env.drop(order("NOTE-4"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "run", "--once"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=cli_env(),
    )  # fmt: skip
    try:
        wait_until(lambda: log.exists() and "start" in log.read_text(), 60, "the notification running")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 1  # the job failed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert log.read_text().split() == ["start", "end"]


def test_sighup_reload_applies_to_new_jobs_only(env: Env) -> None:
    """SIGHUP logs config.reloaded; a changed agent applies to new jobs, not claimed ones."""
    old = env.agent(
        "--sleep", "2", "--fail-attempts", "1", "--field", "team=old",
        retry_safe=True, max_attempts=2,
    )  # fmt: skip
    env.configure(agents={"worker": old})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("HUP-1"))
    d.wait_event("agent.started", job_id="HUP-1")
    env.configure(agents={"worker": env.agent("--field", "team=new")})
    d.signal(signal.SIGHUP)
    d.wait_event("config.reloaded")
    env.drop(order("HUP-2"))
    first = env.wait_job("HUP-1", "done")
    env.wait_job("HUP-2", "done")
    assert len(first["attempts"]) == 2, "the claimed job lost its old settings on reload"
    assert out_column(env, "HUP-1", "team") == {"old"}
    assert out_column(env, "HUP-2", "team") == {"new"}
    assert d.stop() == 0


def test_a_reload_that_lowers_concurrency_starts_no_new_job_beyond_it(env: Env) -> None:
    """concurrency 2 -> 1 by SIGHUP while two jobs run: they finish, and from then on no job of the agent starts
    while another of it runs (a slot given back is not handed on beyond the new limit)."""
    slow = env.agent("--sleep", "0.8")
    env.configure(agents={"worker": {**slow, "concurrency": 2}}, max_jobs=4)
    d = env.daemon()
    d.wait_ready()
    for i in range(8):
        env.drop(order(f"CC-{i}"))
    wait_until(lambda: sum(e["event"] == "agent.started" for e in d.events()) >= 2, 30, "two jobs running")
    env.configure(agents={"worker": {**slow, "concurrency": 1}}, max_jobs=4)
    d.signal(signal.SIGHUP)
    d.wait_event("config.reloaded")
    for i in range(8):
        env.wait_job(f"CC-{i}", "done", timeout=60)
    assert d.stop() == 0
    events = d.events()
    reloaded = next(i for i, e in enumerate(events) if e["event"] == "config.reloaded")
    running: set[str] = set()
    for i, e in enumerate(events):
        if e["event"] == "agent.started":
            assert i < reloaded or not running, (e["job_id"], sorted(running))
            running.add(e["job_id"])
        elif e["event"] == "agent.exited":
            running.discard(e["job_id"])


def test_sighup_with_bad_config_or_new_root_keeps_the_old_config(env: Env, tmp_path: Path) -> None:
    """A reload of a broken config, an unknown key or a changed root is rejected; work goes on."""
    env.configure(agents={"worker": env.agent("--field", "team=old")})
    good = env.config_path.read_text()
    d = env.daemon()
    d.wait_ready()
    other_root = tmp_path / "other-root"
    bad_configs = [
        "agents: [unclosed\n",
        good + "no_such_key: 1\n",
        good.replace(str(env.root), str(other_root)),
    ]
    for n, text in enumerate(bad_configs, start=1):
        env.config_path.write_text(text)
        d.signal(signal.SIGHUP)
        wait_count(d, "config.rejected", n)
        assert d.proc is not None and d.proc.poll() is None, "the daemon died on a bad reload"
        env.drop(order(f"KEEP-{n}"))
        env.wait_job(f"KEEP-{n}", "done")
        assert out_column(env, f"KEEP-{n}", "team") == {"old"}
    assert count_events(d, "config.reloaded") == 0
    assert not (other_root / "done").exists()
    env.config_path.write_text(good)
    assert d.stop() == 0


def test_sighup_with_the_same_root_named_through_a_symlink_is_a_reload(env: Env, tmp_path: Path) -> None:
    """A config whose root names the same folder through a symlink does not change the root: reloaded."""
    link = tmp_path / "root-link"
    link.symlink_to(env.root)
    env.configure()
    d = env.daemon()
    d.wait_ready()
    env.config_path.write_text(env.config_path.read_text().replace(str(env.root), str(link)))
    d.signal(signal.SIGHUP)
    d.wait_event("config.reloaded")
    env.drop(order("LINKED-1"))
    env.wait_job("LINKED-1", "done")
    assert d.stop() == 0
    assert count_events(d, "config.rejected") == 0


def test_sighup_reopens_log_file(env: Env, tmp_path: Path) -> None:
    """After logrotate moves log_file away, SIGHUP makes the daemon write a new one."""
    log_file = tmp_path / "dispatcher.log"
    env.configure(log_file=str(log_file))
    d = env.daemon()
    d.wait_ready()
    rotated = tmp_path / "dispatcher.log.1"
    log_file.rename(rotated)
    d.signal(signal.SIGHUP)
    d.wait_event("config.reloaded")
    env.drop(order("ROT-1"))
    env.wait_job("ROT-1", "done")
    assert d.stop() == 0
    events = [json.loads(line) for line in log_file.read_text().splitlines() if line.strip()]
    assert any(e.get("event") == "job.done" and e.get("job_id") == "ROT-1" for e in events)
    assert "ROT-1" not in rotated.read_text()


@contextlib.contextmanager
def notify_socket() -> Iterator[tuple[NotifyListener, dict[str, str]]]:
    """Bind a notify socket; yield its listener and the environment that points at it."""
    sock_dir = Path(tempfile.mkdtemp(prefix="dn", dir="/tmp"))
    listener = NotifyListener(sock_dir / "notify")
    extra = {
        "NOTIFY_SOCKET": str(sock_dir / "notify"),
        "WATCHDOG_USEC": "400000",
        "SECRET_TEST_VARIABLE": "must-not-reach-agents",
    }
    try:
        yield listener, extra
    finally:
        listener.close()
        for p in sock_dir.iterdir():
            p.unlink()
        sock_dir.rmdir()


def test_status_counts_each_waiting_order_once_and_is_not_said_again_while_idle(env: Env) -> None:
    """STATUS= queued counts the orders waiting in inbox/ once each (a parked order was counted twice: 9
    waiting files said `queued 18`), is told again within about a second of a change, and an idle daemon
    says nothing new."""
    env.configure(agents={"worker": env.agent("--sleep", "1.5")}, max_jobs=2)  # concurrency 1: one at a time
    with notify_socket() as (listener, extra):
        d = env_daemon(env, extra)
        listener.wait_line(lambda line: line == "READY=1", 30)
        for n in range(6):
            env.drop(order(f"ST-{n}"))
        wait_until(lambda: len(agent_starts(env)) >= 1, 30, "the first start")
        time.sleep(1.3)  # the next STATUS= after the drops

        def queued() -> list[int]:
            found = [t.split("queued ")[1].split(",")[0] for _at, t in listener.lines if "queued " in t]
            return [int(q) for q in found]

        assert queued() and max(queued()) <= 6, listener.lines
        assert 4 <= queued()[-1] <= 5, listener.lines  # 5 in inbox/ (or 4 once the second started)
        for n in range(6):
            env.wait_job(f"ST-{n}", "done")

        def statuses() -> list[str]:
            return [t for _at, t in listener.lines if t.startswith("STATUS=")]

        wait_until(lambda: statuses()[-1].startswith("STATUS=running 0, queued 0, done 6,"), 10, "the final STATUS=")
        told = len(statuses())
        time.sleep(2.5)  # idle: WATCHDOG=1 only
        assert len(statuses()) == told, statuses()
        d.signal(signal.SIGTERM)
        assert d.wait(30) == 0


def test_a_stop_while_start_up_waits_for_the_ledger_says_stopping_and_never_ready(env: Env) -> None:
    """SIGTERM while start-up waits for a ledger out of reach: STOPPING=1 and `daemon.stopping` as for any
    stop, never READY=1, and exit 0 (nothing was claimed)."""
    env.configure(ledger="postgresql://disp@127.0.0.1:1/ledger", lease=6)
    with notify_socket() as (listener, extra):
        d = env_daemon(env, extra)
        time.sleep(2)  # start-up waits for the ledger
        d.signal(signal.SIGTERM)
        assert d.wait(30) == 0
        listener.wait_line(lambda line: line == "STOPPING=1", 10)
        assert not listener.times("READY=1")
    names = [e["event"] for e in d.events()]
    assert "daemon.stopping" in names and names.index("daemon.stopping") < names.index("daemon.stopped"), names
    assert "daemon.ready" not in names


def test_systemd_ready_comes_after_recovery_has_ended_orphans(env: Env) -> None:
    """READY=1 is sent only once recovery has ended an agent orphaned by kill -9."""
    env.configure(
        # ignores SIGTERM: ending it takes kill_grace, so a READY=1 sent early is seen
        agents={"slow": env.agent("--sleep-after", "30", "--fork-child", "67.3", "--ignore-term")},
        kill_grace=1,
    )
    d0 = env.daemon()
    d0.wait_ready()
    env.drop(order("NOTE-0", to="slow"))
    orphan = wait_start(env, "NOTE-0")
    wait_until((env.root / "active" / "NOTE-0" / "work" / "receipt.json").exists, 30, "receipt")
    d0.kill()
    assert alive(orphan)
    with notify_socket() as (listener, extra):
        d = env_daemon(env, extra)
        listener.wait_line(lambda line: line == "READY=1", 30)
        assert not alive(orphan), "READY=1 came before recovery ended the orphaned agent"
        assert group_members(orphan) == []
        # and after its recovery decided: the receipt it left was checked and the job landed
        assert (env.root / "done" / "NOTE-0" / "result.json").exists(), "READY=1 came before NOTE-0 was recovered"
        assert not (env.root / "active" / "NOTE-0").exists()
        d.wait_event("job.recovered", job_id="NOTE-0")
        assert d.stop() == 0
        assert len(listener.times("READY=1")) == 1


def test_systemd_notify_status_watchdog_stopping_and_clean_agent_env(env: Env) -> None:
    """With NOTIFY_SOCKET: READY, STATUS with counts, WATCHDOG=1 every 200 ms, STOPPING=1; not to agents."""
    dump = write_script(env.tmp, "envdump.py", ENV_DUMP)
    env_out = env.tmp / "agent-env.jsonl"
    env.configure(agents={"dump": {"command": [sys.executable, str(dump), str(env_out)], "timeout": 30}})
    with notify_socket() as (listener, extra):
        d = env_daemon(env, extra)
        ready_at = listener.wait_line(lambda line: line == "READY=1", 30)
        body = order("NOTE-1", to="dump")
        del body["accept"]
        env.drop(body)
        env.wait_job("NOTE-1", "done")
        # watch the watchdog pings for a while after READY
        while time.monotonic() < ready_at + 3.0:
            time.sleep(0.1)
        pings = [t for t in listener.times("WATCHDOG=1") if t >= ready_at]
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert len(gaps) >= 8, f"too few WATCHDOG=1 pings: {len(pings)}"
        assert 0.16 <= statistics.median(gaps) <= 0.24, f"median gap {statistics.median(gaps):.3f} s"
        assert max(gaps) < 0.4, f"a gap of {max(gaps):.3f} s would trip the systemd watchdog"
        statuses = [text for _t, text in listener.lines if text.startswith("STATUS=")]
        assert statuses, "no STATUS= line"
        assert any(ch.isdigit() for ch in statuses[-1]), f"STATUS without counts: {statuses[-1]}"
        assert len(listener.times("READY=1")) == 1

        d.signal(signal.SIGTERM)
        assert d.wait(30) == 0
        listener.wait_line(lambda line: line == "STOPPING=1", 5)
        time.sleep(0.2)
        assert len(listener.times("STOPPING=1")) == 1  # said once, by the signal, not again at the end

    agent_env = json.loads(env_out.read_text().splitlines()[0])
    leaked = [k for k in agent_env if k.startswith(("NOTIFY_", "WATCHDOG_"))]
    assert not leaked, f"the agent inherited {leaked}"
    assert "SECRET_TEST_VARIABLE" not in agent_env
    assert agent_env["DISPATCH_JOB_ID"] == "NOTE-1"
    assert {"DISPATCH_ORDER", "DISPATCH_WORKSPACE", "DISPATCH_RECEIPT", "DISPATCH_ATTEMPT"} <= set(agent_env)


def test_sigterm_cuts_a_retry_wait_and_next_start_resumes(env: Env) -> None:
    """SIGTERM while a job waits 30 s for its retry: exit 0 at once; the next start runs attempt 2."""
    agent = env.agent("--fail-attempts", "1", retry_safe=True, max_attempts=2)
    env.configure(agents={"worker": agent}, retry_delay=30, stop_timeout=20)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("PAUSE-1"))
    d.wait_event("job.retrying", job_id="PAUSE-1")
    sent = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait(25) == 0
    assert time.monotonic() - sent < 5, "the stop waited out the retry delay"
    assert (env.root / "active" / "PAUSE-1").is_dir()
    next_start_runs_attempt_2(env, agent, "PAUSE-1")
    assert [(j, a) for j, a, _p in agent_starts(env)] == [("PAUSE-1", 1), ("PAUSE-1", 2)]


def next_start_runs_attempt_2(env: Env, agent: dict[str, Any], job_id: str) -> None:
    """Start a daemon again (retry_delay 0.1): the job a stop left waiting for its retry ends done with attempt 2."""
    env.configure(agents={"worker": agent}, retry_delay=0.1)
    d2 = env.daemon()
    result = env.wait_job(job_id, "done")
    assert [a["n"] for a in result["attempts"]] == [1, 2]
    assert d2.stop() == 0


def test_sigterm_before_a_retry_wait_begins_cuts_it_too(env: Env) -> None:
    """SIGTERM while the agent still runs; it then fails and its retry would wait 30 s: the stop cuts that wait
    too (section 6), so the daemon exits once the agent is done, and the next start runs attempt 2."""
    agent = env.agent("--fail-attempts", "1", "--sleep", "2", retry_safe=True, max_attempts=2)
    env.configure(agents={"worker": agent}, retry_delay=30, stop_timeout=20)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("LATE-1"))
    d.wait_event("agent.started", job_id="LATE-1")
    sent = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait(40) == 0
    assert time.monotonic() - sent < 12, "the stop waited out the retry delay"
    assert [e["job_id"] for e in d.events() if e["event"] == "agent.exited"] == ["LATE-1"]
    assert (env.root / "active" / "LATE-1").is_dir()
    next_start_runs_attempt_2(env, agent, "LATE-1")


def test_sighup_storm_while_jobs_run_loses_nothing(env: Env) -> None:
    """Twenty SIGHUPs while 60 jobs run: each reloads, every job ends done once, exit 0."""
    env.configure(agents={"tiny": tiny_agent(env, concurrency=3)}, max_jobs=3)
    d = env.daemon()
    d.wait_ready()
    for i in range(60):
        env.drop(tiny_order(f"HUPS-{i:02d}"))
    for n in range(1, 21):
        d.signal(signal.SIGHUP)
        wait_count(d, "config.reloaded", n, timeout=10)
    for i in range(60):
        env.wait_job(f"HUPS-{i:02d}", "done")
    assert sorted(j for j, _a, _p in agent_starts(env)) == [f"HUPS-{i:02d}" for i in range(60)]
    assert d.stop() == 0


def test_sigterm_during_startup_exits_0_and_loses_nothing(env: Env) -> None:
    """SIGTERM right after daemon.started (recovery and first scan under way): exit 0, no loss."""
    env.configure(agents={"tiny": tiny_agent(env, concurrency=2)})
    for i in range(40):
        env.drop(tiny_order(f"EARLY-{i:02d}"))
    d = env.daemon()
    d.wait_event("daemon.started")
    d.signal(signal.SIGTERM)
    assert d.wait(30) == 0
    proc = env.cli("run", "--once", timeout=120)
    assert proc.returncode == 0, proc.stderr
    for i in range(40):
        assert env.result(f"EARLY-{i:02d}", "done")["state"] == "done"
    assert sorted(j for j, _a, _p in agent_starts(env)) == [f"EARLY-{i:02d}" for i in range(40)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_before_the_daemon_has_read_its_config_still_exits_0(env: Env, sig: int) -> None:
    """A stop signal while `run` is still starting (here: its config a FIFO nobody has written yet) is graceful.

    Section 9: SIGTERM and SIGINT stop the daemon with exit 0, also in the first moments of
    the process, before its loop has handlers (not exit -15, or 130 with a traceback).
    """
    env.configure(agents={"tiny": tiny_agent(env)})
    fifo = env.tmp / "late.yaml"
    os.mkfifo(fifo)
    argv = [sys.executable, "-m", "dispatcher", "--config", str(fifo), "run"]
    proc = subprocess.Popen(argv, cwd=env.tmp, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3.0)  # well into its start: blocked on reading the config
        proc.send_signal(sig)
        fifo.write_text(env.config_path.read_text())  # then the config comes, and the noted stop is carried out
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    events = [json.loads(line)["event"] for line in out.splitlines() if line.startswith("{")]
    assert "daemon.stopping" in events and events[-1] == "daemon.stopped", events
    assert "Traceback" not in err


def test_a_job_recovered_at_its_finish_keeps_its_cost_in_the_ledger(env: Env) -> None:
    """A job whose result was written but not recorded (the ledger locked, then a stop) is recorded at the
    next start with its cost, so that `list` and the daily caps count it (sections 11 and 14)."""
    cost = json.dumps({"total_cost_usd": 0.1})
    env.configure(agents={"worker": env.agent("--sleep", "1", "--json-result", cost)}, stop_timeout=4, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("PAID-1"))
    d.wait_event("agent.started", job_id="PAID-1")
    db = sqlite3.connect(env.root / ".state" / "ledger.sqlite3", isolation_level=None, timeout=10)
    db.execute("BEGIN EXCLUSIVE")
    try:
        wait_until((env.root / "active" / "PAID-1" / ".result.json.staged").exists, 30, "the staged result")
        d.signal(signal.SIGTERM)
        assert d.wait(30) == 0
    finally:
        db.execute("ROLLBACK")
        db.close()
    d2 = env.daemon()
    assert env.wait_job("PAID-1", "done")["cost_usd"] == 0.1
    d2.wait_event("job.recovered", job_id="PAID-1")
    listed = [json.loads(line) for line in env.cli("list", "--json", check=True).stdout.splitlines()]
    (row,) = [j for j in listed if j["job_id"] == "PAID-1"]
    assert row["cost_usd"] == 0.1, row
    assert d2.stop() == 0


def test_a_stop_in_the_same_turn_as_a_gate_command_ends_the_gates_refresh(tmp_path: Path) -> None:
    """A pause/resume hint (kick) and SIGTERM's stop in one loop turn: the refresh ends, the stop does not hang.

    The kick completes the refresh's wait in the turn the stop cancels it; a wait that
    swallowed that cancel would sleep until the next idle read (here an hour) and hold the
    daemon's exit past its stop_timeout.
    """
    from dispatcher.core.gatekeeper import GateKeeper
    from dispatcher.lanes import Lanes
    from dispatcher.layout import Layout
    from dispatcher.ledger.sqlite import SqliteLedger

    layout = Layout(tmp_path / "root")
    layout.create()
    ledger = SqliteLedger(layout.ledger, layout.state_dir, patience_s=30)
    lanes = Lanes()

    async def scenario() -> bool:
        keeper = GateKeeper(ledger, lanes, lambda: ["worker"], lambda: None, idle_s=3600.0)
        keeper.start()
        await asyncio.sleep(0.5)  # the first refresh has read the ledger; the refresh now waits
        keeper.kick()
        await asyncio.sleep(0)  # the kick's wake-up runs: the wait is complete, not yet resumed
        stopping = asyncio.ensure_future(keeper.stop())
        done, _ = await asyncio.wait({stopping}, timeout=10)
        return bool(done)

    try:
        assert asyncio.run(scenario()), "the gates' refresh did not end within 10 s of the stop"
    finally:
        lanes.shutdown(wait=True)
        ledger.close()


def test_a_stop_timeout_too_long_for_a_timer_still_stops_cleanly(env: Env) -> None:
    """stop_timeout: 1e300 (valid: a positive number) stops an idle daemon with exit 0 and nothing on stderr but
    its JSON lines: no traceback of a timer that cannot wait that long."""
    env.configure(stop_timeout=1.0e300)
    d = env.daemon()
    d.wait_ready()
    assert d.stop() == 0
    text = d.out.read_text()
    assert "Traceback" not in text and "Error" not in text, text
    assert all(line.startswith("{") for line in text.splitlines()), text
