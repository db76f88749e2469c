"""Crash recovery: `kill -9` of the daemon at many moments, orphaned agents, restarts.

The daemon is killed for real (SIGKILL, nothing gets to clean up) and restarted on the
same root; what a user checks afterwards is the folders, result.json and how often each
agent was started (recorded by the agents themselves, outside the dispatch root).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, cli_env, namespaced_daemon, order, wait_until
from helpers_faults import (
    FAKE_AGENT,
    SLOW_FIRST,
    LogTail,
    agent_starts,
    alive,
    assert_running,
    check,
    env_daemon,
    first_failing,
    group_members,
    job_states,
    processes_with,
    read_result,
    refusals,
    run_once_killed_at,
    tiny_agent,
    tiny_order,
    wait_gone,
    wait_start,
    write_script,
)

# Where each kill lands: the event the daemon must have logged just before (None: a time).
KILL_POINTS: tuple[tuple[str, str | None], ...] = (
    ("during start-up / recovery", None),
    ("after job.claimed", "job.claimed"),
    ("while an agent runs", "agent.started"),
    ("right after an agent exited", "agent.exited"),
    ("after job.verified, before the move", "job.verified"),
    ("at a random time", None),
    ("right after daemon.ready", "daemon.ready"),
    ("after job.done", "job.done"),
)


FOLLOWUP_POINTS = (*KILL_POINTS, ("right after followup.released", "followup.released"))


def kill_storm(
    env: Env, n_jobs: int, kills: int, seed: int, points: tuple[tuple[str, str | None], ...] = KILL_POINTS
) -> Counter[str]:
    """Drop n_jobs orders in chunks and kill -9 the daemon `kills` times; return the kill points.

    Each cycle starts a daemon, waits for one kill point (an event in its log, or a random
    time of 0.2-0.7 s, or 0-0.3 s after the start, which lands in start-up and recovery),
    kills it with SIGKILL and drops the next chunk of orders while no daemon runs.
    """
    rng = random.Random(seed)
    ids = [f"S{i:04d}" for i in range(n_jobs)]
    first = n_jobs // 5
    for job_id in ids[:first]:
        env.drop(tiny_order(job_id))
    rest = ids[first:]
    per = -(-len(rest) // kills)
    landed: Counter[str] = Counter()
    for k in range(kills):
        d = env.daemon()
        tail = LogTail(d.out)
        name, event = points[k % len(points)]
        if event is None:
            # the fault schedule itself: a random delay, not a synchronisation
            time.sleep(rng.uniform(0.0, 0.3) if k % len(points) == 0 else rng.uniform(0.2, 0.7))
            hit = True
        else:
            hit = tail.wait_for(lambda e, ev=event: e.get("event") == ev, 8.0) is not None
        assert_running(d)  # it must die by our SIGKILL, not by itself
        d.kill()
        landed[name if hit else f"{name} (not reached, killed after 8 s)"] += 1
        for job_id in rest[k * per : (k + 1) * per]:
            env.drop(tiny_order(job_id))
    return landed


def assert_all_finished_once(env: Env, n_jobs: int) -> dict[str, str]:
    """Every job is in exactly one of done/ and failed/, nothing left in inbox/ or active/."""
    states = job_states(env.root)
    expected = {f"S{i:04d}" for i in range(n_jobs)}
    assert set(states) == expected, sorted(set(states) ^ expected)[:10]
    wrong = {j: s for j, s in states.items() if s not in (["done"], ["failed"])}
    assert not wrong, f"jobs not in exactly one of done/ failed/: {list(wrong.items())[:10]}"
    assert refusals(env.root) == [], "a job of its own was refused after a restart"
    for job_id, (state,) in states.items():
        result = read_result(env.root / state / job_id)
        assert result["job_id"] == job_id
        assert result["state"] == state
    return {j: s[0] for j, s in states.items()}


@pytest.mark.slow
def test_kill9_storm_never_starts_a_not_retry_safe_job_twice(env: Env) -> None:
    """Under repeated kill -9 every job ends once in done/ or failed/, and none runs twice."""
    n_jobs, kills = 300, 24
    env.configure(
        agents={"tiny": tiny_agent(env, concurrency=4, max_attempts=3)},
        max_jobs=3,
        settle=0.2,
        rescan_interval=1,
        kill_grace=0.5,
    )
    landed = kill_storm(env, n_jobs, kills, seed=1)
    print("kill points:", dict(landed))
    proc = env.cli("run", "--once", timeout=240)
    final = assert_all_finished_once(env, n_jobs)

    started = Counter(job for job, _a, _p in agent_starts(env))
    twice = {j: n for j, n in started.items() if n > 1}
    assert not twice, f"not-retry-safe jobs started more than once: {twice}"
    failed = sorted(j for j, s in final.items() if s == "failed")
    for job_id, state in final.items():
        if state == "done":
            assert started[job_id] == 1, f"{job_id} is done without one recorded start"
    for job_id in failed:
        reason = read_result(env.root / "failed" / job_id)["reason"]
        assert "\n" not in reason
        assert "retr" in reason.lower(), f"{job_id}: reason does not say it was not retried: {reason}"
    if not failed:
        assert proc.returncode == 0, proc.stderr
    assert sum(landed.values()) == kills
    assert sum(n for k, n in landed.items() if "not reached" in k) <= 2, landed


@pytest.mark.slow
def test_kill9_storm_retry_safe_jobs_all_end_done(env: Env) -> None:
    """Under repeated kill -9 a retry-safe agent with 3 attempts gets every job done once."""
    n_jobs, kills = 300, 24
    env.configure(
        agents={"tiny": tiny_agent(env, concurrency=4, retry_safe=True, max_attempts=3)},
        max_jobs=4,
        settle=0.2,
        rescan_interval=1,
        kill_grace=0.5,
    )
    landed = kill_storm(env, n_jobs, kills, seed=2)
    print("kill points:", dict(landed))
    proc = env.cli("run", "--once", timeout=240)
    final = assert_all_finished_once(env, n_jobs)

    not_done = {j: read_result(env.root / s / j)["reason"] for j, s in final.items() if s != "done"}
    assert not not_done, f"retry-safe jobs that did not end done: {list(not_done.items())[:5]}"
    per_attempt = Counter((job, attempt) for job, attempt, _p in agent_starts(env))
    repeated = {k: n for k, n in per_attempt.items() if n > 1}
    assert not repeated, f"one attempt number started more than once: {repeated}"
    started = Counter(job for job, _a, _p in agent_starts(env))
    assert max(started.values()) <= 3
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert sum(n for k, n in landed.items() if "not reached" in k) <= 2, landed


@pytest.mark.slow
def test_kill9_storm_releases_each_followup_exactly_once(env: Env) -> None:
    """Under repeated kill -9 every job's follow-up is released once, runs once, ends done."""
    n_jobs, kills = 150, 18
    common = {"concurrency": 4, "retry_safe": True, "max_attempts": 3}
    env.configure(
        agents={
            "tiny": tiny_agent(env, handoff=("sink", "tiny"), **common),
            "sink": tiny_agent(env, **common),
        },
        max_jobs=4,
        settle=0.2,
        rescan_interval=1,
        kill_grace=0.5,
    )
    landed = kill_storm(env, n_jobs, kills, seed=3, points=FOLLOWUP_POINTS)
    print("kill points:", dict(landed))
    proc = env.cli("run", "--once", timeout=240)

    refused = [read_result(p)["reason"] for p in refusals(env.root)]
    assert refused == [], f"{len(refused)} refusals, e.g. {refused[:2]}"
    parents = {f"S{i:04d}" for i in range(n_jobs)}
    children = {f"{p}-fu" for p in parents}
    states = job_states(env.root)
    assert set(states) == parents | children, sorted(set(states) ^ (parents | children))[:10]
    bad = {j: s for j, s in states.items() if s != ["done"]}
    assert not bad, list(bad.items())[:10]
    for parent in parents:
        assert read_result(env.root / "done" / parent)["children"] == [f"{parent}-fu"]
        assert read_result(env.root / "done" / f"{parent}-fu")["parent"] == parent
    per_attempt = Counter((job, attempt) for job, attempt, _p in agent_starts(env))
    assert not {k: c for k, c in per_attempt.items() if c > 1}, "one attempt started twice"
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert sum(n for k, n in landed.items() if "not reached" in k) <= 3, landed


def test_kill9_orphan_with_receipt_is_ended_and_checked_without_rerun(env: Env) -> None:
    """An agent orphaned by kill -9 is ended at restart; its receipt is checked (exit lost)."""
    marker = "time.sleep(61.37)"
    # the orphan ignores SIGTERM, so ending it takes kill_grace: checks run early would show
    slow = env.agent("--sleep-after", "30", "--fork-child", "61.37", "--ignore-term")
    env.configure(agents={"worker": slow}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("ORPH-1"))
    pid = wait_start(env, "ORPH-1")
    receipt = env.root / "active" / "ORPH-1" / "work" / "receipt.json"
    wait_until(receipt.exists, 30, "the agent's receipt")
    d.kill()
    assert alive(pid), "the agent should outlive its daemon (own process group)"
    child = wait_until(lambda: processes_with(marker), 10, "the agent's child")
    restarted = time.monotonic()

    d2 = env.daemon()
    result = env.wait_job("ORPH-1", "done", timeout=25)
    assert d2.wait_event("agent.orphan_ended", job_id="ORPH-1")["agent"] == "worker"
    assert time.monotonic() - restarted < 20, "the daemon waited for the orphan to end by itself"
    assert not alive(pid), "the orphaned agent is still running after recovery"
    wait_gone(child, [pid], timeout=5)
    exit_ok = check(result, "exit_ok")
    assert exit_ok["ok"] is None
    assert "lost" in exit_ok["detail"].lower()
    assert [job for job, _a, _p in agent_starts(env)] == ["ORPH-1"], "the job was run again"
    d2.wait_event("job.recovered", job_id="ORPH-1")
    assert d2.stop() == 0


def test_kill9_orphan_that_cleared_its_environment_is_ended_before_the_retry(env: Env) -> None:
    """An agent run through `env -i` (no DISPATCH_* variable left) is still found after kill -9, by its logs, and
    ended before attempt 2 starts: two copies of the job never run at once (section 6)."""
    spans = env.tmp / "spans.txt"
    script = f'echo "start $$" >> {spans}; sleep 40; echo "end $$" >> {spans}'
    agent = {"command": ["env", "-i", "/bin/sh", "-c", script], "retry_safe": True, "max_attempts": 2, "timeout": 100}
    env.configure(agents={"worker": agent}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("CLEARED-1"))
    wait_until(lambda: spans.exists() and spans.read_text().startswith("start "), 30, "the agent's start")
    first = int(spans.read_text().split()[1])
    log = env.root / "active" / "CLEARED-1" / "attempts" / "1" / "stdout.log"

    def noted() -> bool:  # the daemon notes the agent just after its start: a busy machine may run the agent first
        try:
            return os.getxattr(log, "user.dispatcher.agent").split()[0] == str(first).encode()
        except OSError:
            return False

    wait_until(noted, 30, "the agent's note on its stdout.log")
    d.kill()
    assert alive(first), "the agent should outlive its daemon (own process group)"
    d2 = env.daemon()
    ended = d2.wait_event("agent.orphan_ended", job_id="CLEARED-1")
    wait_until(lambda: len(spans.read_text().split("start ")) > 2, 30, "attempt 2's start")
    assert not alive(first), "attempt 2 started while the first copy still ran"
    assert ended["pid"] == first
    d2.stop()


def test_kill9_orphan_without_receipt_is_ended_before_the_retry(env: Env) -> None:
    """A retry of an interrupted job starts only after the orphaned first copy is gone."""
    wrapper = write_script(env.tmp, "slow_first.py", SLOW_FIRST)
    agent = env.agent("--ignore-term", retry_safe=True, max_attempts=2)
    agent["command"] = [agent["command"][0], str(wrapper), *agent["command"][2:]]
    env.configure(agents={"worker": agent}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("ORPH-2"))
    pid = wait_start(env, "ORPH-2", attempt=1)
    d.kill()
    assert alive(pid)

    d2 = env.daemon()
    wait_start(env, "ORPH-2", attempt=2, timeout=30)
    assert not alive(pid), "attempt 2 started while the orphaned attempt 1 still ran"
    result = env.wait_job("ORPH-2", "done")
    assert [a["n"] for a in result["attempts"]][-1] == 2
    assert [(j, a) for j, a, _p in agent_starts(env)] == [("ORPH-2", 1), ("ORPH-2", 2)]
    assert group_members(pid) == []
    assert d2.stop() == 0


def test_a_stop_while_start_up_ends_an_orphan_is_answered_within_stop_timeout(env: Env) -> None:
    """kill_grace above stop_timeout, an orphan that ignores SIGTERM: a stop during the start's recovery
    does not wait out kill_grace (the orphan is killed at once), says STOPPING, and never says ready."""
    env.configure(agents={"worker": env.agent("--ignore-term", "--sleep", "60")}, kill_grace=15, stop_timeout=2)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("ORPH-S"))
    pid = wait_start(env, "ORPH-S")
    d.kill()
    assert alive(pid)

    d2 = env.daemon()
    d2.wait_event("agent.orphan_ended", job_id="ORPH-S", timeout=30)
    began = time.monotonic()
    d2.signal(signal.SIGTERM)
    assert d2.wait(timeout=30) == 0
    took = time.monotonic() - began
    assert took < 8, f"the stop took {took:.1f} s (stop_timeout 2, kill_grace 15)"
    assert not alive(pid) and group_members(pid) == []
    events = [e["event"] for e in d2.events()]
    assert "daemon.stopping" in events and "daemon.ready" not in events
    assert (env.root / "active" / "ORPH-S").is_dir()  # recovered by the next start, as any stopped job


def test_kill9_orphan_of_not_retry_safe_job_fails_without_rerun(env: Env) -> None:
    """An interrupted job of a not-retry-safe agent (attempts left) fails, says it was not retried."""
    wrapper = write_script(env.tmp, "talk_first.py", TALK_FIRST)
    agent = env.agent("--sleep", "30", max_attempts=3)
    agent["command"] = [agent["command"][0], str(wrapper), *agent["command"][2:]]
    env.configure(agents={"worker": agent}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("ORPH-3"))
    pid = wait_start(env, "ORPH-3")
    logs = env.root / "active" / "ORPH-3" / "attempts" / "1"
    wait_until(lambda: b"said on stderr" in (logs / "stderr.log").read_bytes(), 15, "the agent's first words")
    d.kill()
    d2 = env.daemon()
    result: dict[str, Any] = env.wait_job("ORPH-3", "failed", timeout=25)
    kept = env.root / "failed" / "ORPH-3" / "attempts" / "1"
    assert (kept / "stdout.log").read_bytes() == b"said on stdout\n", "recovery must keep what the agent wrote"
    assert (kept / "stderr.log").read_bytes() == b"said on stderr\n"
    assert not alive(pid)
    assert "retr" in result["reason"].lower(), result["reason"]
    assert result["reason"].startswith(first_failing(result) or "?"), result["reason"]
    # exit_ok is null only beside a receipt (section 5): without one the interrupted attempt's exit_ok is false
    exit_ok = next(c for c in result["checks"] if c["name"] == "exit_ok")
    assert exit_ok["ok"] is False and exit_ok["detail"].startswith("exit status lost"), exit_ok
    assert [j for j, _a, _p in agent_starts(env)] == ["ORPH-3"]
    # the attempt the crash cut short still says what it ran (contract section 6)
    assert [a["argv"] for a in result["attempts"]] == [agent["command"]], result["attempts"]
    assert json.loads((kept / "attempt.json").read_text())["argv"] == agent["command"]
    assert d2.stop() == 0


def test_job_recovered_counts_the_attempt_a_kill_cut_short(env: Env) -> None:
    """kill -9 during attempt 1 (not retry-safe): ``job.recovered`` says 1 attempt, as ``job.failed`` and
    result.json then do (it said 0: the cut attempt had no record yet)."""
    env.configure(agents={"worker": env.agent("--sleep", "30")}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("ORPH-4"))
    wait_start(env, "ORPH-4")
    d.kill()
    d2 = env.daemon()
    result = env.wait_job("ORPH-4", "failed", timeout=25)
    recovered = d2.wait_event("job.recovered", job_id="ORPH-4")
    failed = d2.wait_event("job.failed", job_id="ORPH-4")
    assert d2.stop() == 0
    assert recovered["attempts"] == failed["attempts"] == len(result["attempts"]) == 1


# Says a line on stdout and one on stderr, then runs the fake agent.
TALK_FIRST = f"""import os, sys
print("said on stdout", flush=True)
print("said on stderr", file=sys.stderr, flush=True)
os.execv(sys.executable, [sys.executable, {str(FAKE_AGENT)!r}, *sys.argv[1:]])
"""


# Runs the fake agent; while the flag file exists it first sleeps 30 s.
SLOW_WHILE_FLAG = f"""import os, sys
flag, args = sys.argv[1], sys.argv[2:]
if os.path.exists(flag):
    args += ["--sleep", "30"]
os.execv(sys.executable, [sys.executable, {str(FAKE_AGENT)!r}, *args])
"""


def crash_before_the_spawn(env: Env, job_id: str, **settings: Any) -> Path:
    """Leave job_id as a kill -9 between its attempt folder and its agent's start leaves it.

    A first daemon starts attempt 1 and is killed; its agent is ended; the attempt's logs,
    which the daemon makes just before the spawn, are removed, and so is the agent's start.
    Returns the job's folder in active/.
    """
    flag = env.tmp / "slow.flag"
    flag.touch()
    wrapper = write_script(env.tmp, "slow_while_flag.py", SLOW_WHILE_FLAG)
    agent = env.agent(**settings)
    agent["command"] = [agent["command"][0], str(wrapper), str(flag), *agent["command"][2:]]
    env.configure(agents={"worker": agent}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order(job_id))
    pid = wait_start(env, job_id)
    d.kill()
    os.killpg(pid, signal.SIGKILL)
    wait_gone([pid], [pid])
    folder = env.root / "active" / job_id
    for name in ("stdout.log", "stderr.log"):
        (folder / "attempts" / "1" / name).unlink()
    assert sorted(p.name for p in (folder / "attempts").iterdir()) == ["1"]
    env.count_file.write_text("")
    flag.unlink()
    return folder


def test_kill9_before_the_spawn_gives_a_retry_safe_job_its_attempt_back(env: Env) -> None:
    """A crash between a retry-safe job's attempt folder and its agent's start costs no attempt."""
    crash_before_the_spawn(env, "NOSPAWN-1", retry_safe=True, max_attempts=1)
    d2 = env.daemon()
    result = env.wait_job("NOSPAWN-1", "done")
    assert [a["n"] for a in result["attempts"]] == [1]
    assert [(j, a) for j, a, _p in agent_starts(env)] == [("NOSPAWN-1", 1)]
    assert (env.root / "done" / "NOSPAWN-1" / "attempts" / "1" / "stdout.log").is_file()
    assert d2.stop() == 0


def test_kill9_attempt_without_logs_but_with_a_receipt_is_checked_not_run_again(env: Env) -> None:
    """Logs missing beside a receipt (a power cut can do that): the receipt is checked, the agent not run again."""
    folder = crash_before_the_spawn(env, "NOSPAWN-3", retry_safe=True, max_attempts=3)
    (folder / "work" / "receipt.json").write_text("{not json")
    d2 = env.daemon()
    result = env.wait_job("NOSPAWN-3", "failed")
    assert result["reason"].startswith("receipt_present"), result["reason"]
    assert agent_starts(env) == []
    assert d2.stop() == 0


def test_a_crash_after_a_failed_exit_was_recorded_beside_a_receipt_does_not_run_the_agent_again(env: Env) -> None:
    """The daemon dies after it recorded attempt 1 (exit 3) and before the checks; work/receipt.json is there. The next
    start does not run the agent again (section 6: with a receipt, the checks decide), though the agent is retry_safe
    with attempts left, and the reason says why it was not retried."""
    env.configure(agents={"worker": env.agent("--exit", "3", retry_safe=True, max_attempts=3)})
    env.drop(order("REC-3"))
    d = env_daemon(env, {"DISPATCHER_FAULT": "attempt.recorded"})
    assert d.wait(60) == -9
    assert (env.root / "active" / "REC-3" / "work" / "receipt.json").exists()
    proc = env.cli("run", "--once", timeout=60)
    assert proc.returncode == 1, proc.stderr
    result = env.result("REC-3", "failed")
    assert [a["n"] for a in result["attempts"]] == [1] and [j for j, _a, _p in agent_starts(env)] == ["REC-3"]
    assert result["reason"].startswith("exit_ok: exit 3"), result["reason"]
    assert "not retried: recovered with its receipt after its daemon died" in result["reason"], result["reason"]


@pytest.mark.parametrize("how", ["expired since", "max_order_bytes lowered since"])
def test_a_claims_leftover_inbox_name_is_dropped_not_refused_when_a_rule_now_refuses_it(env: Env, how: str) -> None:
    """The daemon dies after placing a claimed job, before unlinking its inbox name; before the restart the order's
    `expires` passes (or max_order_bytes is lowered below its size). The name left in inbox/ is the job's own file:
    it is dropped (order.twin_dropped), not refused beside the job (section 1: a refused file never becomes a job)."""
    env.configure()
    expires = time.time() + 4 if how == "expired since" else time.time() + 3600
    body = order("TW-1", expires=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires)))
    path = env.drop(body)
    d = env_daemon(env, {"DISPATCHER_FAULT": "claim.placed"})
    assert d.wait(60) == -9
    assert (env.root / "active" / "TW-1").is_dir() and path.exists()
    if how == "expired since":
        time.sleep(max(0.0, expires - time.time()) + 0.5)
    else:
        env.configure(max_order_bytes=64)
    proc = env.cli("run", "--once", timeout=60)
    failed = sorted(os.listdir(env.root / "failed")) if (env.root / "failed").exists() else []
    assert not [f for f in failed if f.startswith("TW-1@")], (failed, proc.stdout[-3000:])
    assert '"order.twin_dropped"' in proc.stdout
    assert not path.exists()
    status = json.loads(env.cli("status", "--json", check=True).stdout)
    assert status["counts"]["refused"] == 0, status["counts"]


def test_kill9_before_the_spawn_still_counts_for_a_job_not_retry_safe(env: Env) -> None:
    """The same crash for an agent that is not retry-safe: the attempt counts as interrupted, nothing runs."""
    crash_before_the_spawn(env, "NOSPAWN-2", max_attempts=3)
    d2 = env.daemon()
    result = env.wait_job("NOSPAWN-2", "failed")
    assert "attempt 1 was interrupted" in result["reason"], result["reason"]
    assert agent_starts(env) == []
    logs = env.root / "failed" / "NOSPAWN-2" / "attempts" / "1"
    assert (logs / "stdout.log").is_file() and (logs / "stderr.log").is_file()
    assert d2.stop() == 0


def test_kill9_during_retry_wait_resumes_with_the_next_attempt(env: Env) -> None:
    """A daemon killed while a job waits for its retry: the next start runs attempt 2, once."""
    env.configure(
        agents={"worker": env.agent("--fail-attempts", "1", retry_safe=True, max_attempts=2)},
        retry_delay=3,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("WAIT-1"))
    d.wait_event("job.retrying", job_id="WAIT-1")
    d.kill()
    assert [(j, a) for j, a, _p in agent_starts(env)] == [("WAIT-1", 1)]
    d2 = env.daemon()
    result = env.wait_job("WAIT-1", "done")
    assert [(j, a) for j, a, _p in agent_starts(env)] == [("WAIT-1", 1), ("WAIT-1", 2)]
    assert [a["n"] for a in result["attempts"]] == [1, 2]
    assert (env.root / "done" / "WAIT-1" / "attempts" / "1" / "receipt.json").is_file()
    assert d2.stop() == 0


def test_live_daemon_recovers_the_jobs_of_a_dead_one(env: Env) -> None:
    """A running daemon finds a kill -9ed daemon's job, ends its orphan and checks its receipt."""
    env.configure(
        agents={"worker": env.agent("--sleep-after", "30", "--fork-child", "68.9", concurrency=2)},
        rescan_interval=0.5,
        kill_grace=1,
    )
    first = env.daemon()
    first.wait_ready()
    env.drop(order("DEAD-1"))
    pid = wait_start(env, "DEAD-1")
    first.wait_event("agent.started", job_id="DEAD-1")
    wait_until((env.root / "active" / "DEAD-1" / "work" / "receipt.json").exists, 30, "receipt")
    second = env.daemon()
    second.wait_ready()
    first.kill()
    result = env.wait_job("DEAD-1", "done", timeout=30)
    assert not alive(pid)
    wait_gone(processes_with("time.sleep(68.9)"), [pid], timeout=5)
    assert check(result, "exit_ok")["ok"] is None
    assert [j for j, _a, _p in agent_starts(env)] == ["DEAD-1"]
    assert second.proc is not None and second.proc.poll() is None
    assert second.stop() == 0


def test_a_claimed_job_whose_folder_was_removed_by_hand_is_never_run_again_by_its_file(env: Env) -> None:
    """kill -9 of the daemon while X1 runs, its agent ended, active/X1 removed by hand, the same file dropped
    again: no power cut lost that folder (the dead daemon ran since this boot), so the file is refused as
    known and the agent never starts a second time (section 6: never run again by a new file)."""
    agent = env.agent("--sleep", "60")
    env.configure(agents={"worker": agent}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    body = order("GONE-1")
    env.drop(body)
    pid = wait_start(env, "GONE-1")
    d.kill()
    os.killpg(pid, signal.SIGKILL)
    wait_gone([pid], [pid])
    shutil.rmtree(env.root / "active" / "GONE-1")
    d2 = env.daemon()
    d2.wait_ready()
    env.drop(body)
    refused = env.wait_refused("GONE-1")
    assert "already known" in refused["reason"], refused["reason"]
    assert [a for job, a, _ in agent_starts(env) if job == "GONE-1"] == [1], "the agent ran again"
    assert d2.stop() == 0


def test_the_cost_an_agent_reported_before_its_daemon_died_is_counted_at_recovery(env: Env) -> None:
    """The agent prints its final JSON (with its cost), then its daemon is killed -9 while it still runs:
    the interrupted attempt keeps that agent_result, and the job's cost counts it (sections 5 and 14)."""
    printed = env.tmp / "printed"
    script = f'echo \'{{"total_cost_usd": 0.1, "session_id": "s-1"}}\'; touch {printed}; sleep 60'
    env.configure(agents={"worker": {"command": ["sh", "-c", script], "timeout": 100}}, kill_grace=1)
    d = env.daemon()
    d.wait_ready()
    env.drop(order("PAID-9"))
    wait_until(printed.exists, 30, "the agent's final JSON")
    d.kill()
    d2 = env.daemon()
    result = env.wait_job("PAID-9", "failed")
    assert "interrupted" in result["reason"], result["reason"]
    (first,) = result["attempts"]
    assert first["agent_result"]["total_cost_usd"] == 0.1, first
    assert result["cost_usd"] == 0.1
    assert d2.stop() == 0


def test_a_job_whose_folder_cannot_be_read_back_fails_like_any_failed_job(env: Env) -> None:
    """kill -9, then job.json torn: at restart the job fails saying why, with job.failed's figures (section 8), the
    finished count of the metrics (section 10) and the notification (section 11), and no traceback."""
    events = env.tmp / "events.txt"
    notify = ["sh", "-c", 'echo "$0 $1" >> "$2"', "{event}", "{job_id}", str(events)]
    metrics = env.tmp / "m.prom"
    env.configure(agents={"worker": env.agent("--sleep", "30")}, notify=notify, metrics_file=str(metrics))
    d = env.daemon()
    d.wait_ready()
    env.drop(order("TORN-1"))
    wait_start(env, "TORN-1")
    d.kill()
    (env.root / "active" / "TORN-1" / "job.json").write_text("{")
    d2 = env.daemon()
    result = env.wait_job("TORN-1", "failed", timeout=30)
    assert result["reason"].startswith("recovery: the job folder cannot be read back: "), result["reason"]
    failed = d2.wait_event("job.failed", job_id="TORN-1")
    assert failed["agent"] == "worker" and {"duration_s", "cost_usd", "chain_cost_usd"} <= set(failed), failed
    wait_until(lambda: events.exists() and "job.failed TORN-1" in events.read_text(), 20, "the notification")
    assert d2.stop() == 0
    assert 'dispatcher_jobs_finished_total{agent="worker",state="failed"} 1.0' in metrics.read_text()
    assert not [e for e in d2.events() if e.get("event") == "daemon.error"]


def test_an_attempt_cut_by_its_daemons_death_keeps_the_host_it_ran_on(env: Env) -> None:
    """A daemon dies while its agent runs; the next one records that attempt as interrupted with the host noted at
    its spawn (the dead daemon's: another host on a shared ledger), not its own, so `show` names where it ran."""
    env.configure(agents={"worker": env.agent("--sleep", "60")})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("HOST-1"))
    pid = wait_start(env, "HOST-1")
    log = env.root / "active" / "HOST-1" / "attempts" / "1" / "stdout.log"
    d.kill()
    os.killpg(pid, signal.SIGKILL)  # no orphan left: only the record is recovered
    wait_gone([pid], [pid], timeout=10)
    note = os.getxattr(log, "user.dispatcher.agent").decode().split()
    # pid, start on the boot clock, start on the wall clock, host, pid namespace, the inode of its slot lock
    assert len(note) == 6 and note[5].isdigit(), note
    os.setxattr(log, "user.dispatcher.agent", " ".join([*note[:3], "other-host", *note[4:]]).encode())  # another host
    d2 = env.daemon()
    result = env.wait_job("HOST-1", "failed", timeout=30)
    assert [(a["n"], a["host"], a.get("interrupted")) for a in result["attempts"]] == [(1, "other-host", True)]
    assert "host other-host" in env.cli("show", "HOST-1", check=True).stdout
    assert d2.stop() == 0


@pytest.mark.parametrize(("flags", "state"), [((), "done"), (("--exit", "1"), "failed")])
def test_a_jobs_end_is_logged_only_once_its_folder_is_in_done_or_failed(
    env: Env, flags: tuple[str, ...], state: str
) -> None:
    """`job.done` and `job.failed` mean the job's folder is in done/ or failed/ with its result.json: a daemon killed
    after the ledger recorded the end but before the move has not logged it (the line of the daemon that lands it is
    `job.recovered`), and a daemon's lines, read as they come, never name a job whose result.json is not there yet."""
    env.configure(agents={"worker": env.agent(*flags, max_attempts=1)})
    env.drop(order("LOG-1"))
    crashed = run_once_killed_at(env, "finish.recorded")
    assert (env.root / "active" / "LOG-1").is_dir()
    ends = [line for line in crashed.stdout.splitlines() if f'"job.{state}"' in line]
    assert ends == [], ends  # the old order: logged, then killed before the move, the job still in active/
    env.cli("run", "--once")
    assert env.result("LOG-1", state)["state"] == state
    proc = subprocess.Popen(
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "run"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=env.tmp,
        env=cli_env(),
    )
    try:
        assert proc.stdout is not None
        ids = [f"LOG-{n}" for n in range(2, 22)]
        missing: list[str] = []
        for line in proc.stdout:
            if '"daemon.ready"' in line:
                for job_id in ids:
                    env.drop(order(job_id))
            if f'"job.{state}"' in line:
                event = json.loads(line)
                if not (env.root / state / event["job_id"] / "result.json").is_file():  # read at once, as a tail does
                    missing.append(event["job_id"])
                ids.remove(event["job_id"])
                if not ids:
                    break
        assert missing == [] and ids == [], (missing, ids)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


@pytest.mark.parametrize("state", ["failed", "review"])
def test_a_job_landed_for_a_daemon_that_died_before_its_move_is_logged_notified_and_counted_once(
    env: Env, state: str
) -> None:
    """A daemon killed between the ledger's record of a failed (or review) job's end and the move told no one. The
    daemon that lands it logs `job.recovered`, then the job's `job.failed` (`job.review`) line, runs notify with its
    result.json, and counts it in its metrics: a job waiting for review was left with nobody told."""
    marks, prom = env.tmp / "notified.txt", env.tmp / "m.prom"
    agent = env.agent("--exit", "1", max_attempts=1) if state == "failed" else env.agent(review=True)
    env.configure(
        agents={"worker": agent},
        notify=["sh", "-c", 'echo "$1 $2 $3" >> "$0"', str(marks), "{event}", "{job_id}", "{result}"],
        metrics_file=str(prom),
    )
    env.drop(order("TOLD-1"))
    crashed = run_once_killed_at(env, "finish.recorded")
    assert not [line for line in crashed.stdout.splitlines() if f'"job.{state}"' in line]
    assert not marks.exists()
    proc = env.cli("run", "--once")
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    mine = [e["event"] for e in lines if e.get("job_id") == "TOLD-1"]
    assert mine == ["job.recovered", f"job.{state}"], mine
    where = env.root / state / "TOLD-1" / "result.json"
    assert where.is_file()
    wait_until(marks.exists, 20, "the notification")
    assert marks.read_text() == f"job.{state} TOLD-1 {where}\n"
    if state == "failed":
        text = prom.read_text()
        assert 'dispatcher_jobs_finished_total{agent="worker",state="failed"} 1.0' in text, text


@pytest.mark.parametrize(("flags", "state", "code"), [((), "done", 0), (("--exit", "1"), "failed", 1)])
def test_run_once_counts_a_job_it_lands_for_a_daemon_that_died_after_recording_it(
    env: Env, flags: tuple[str, ...], state: str, code: int
) -> None:
    """A daemon killed between the ledger's record of a job's end and the move of its folder leaves the job in
    active/; the next `run --once` lands it in done/ or failed/ and counts it among the jobs it finished: exit 1
    for a failed one, as for a job it ran itself (section 7), 0 for a done one."""
    env.configure(agents={"worker": env.agent(*flags, max_attempts=1)})
    env.drop(order("LAND-1"))
    run_once_killed_at(env, "finish.recorded")
    assert (env.root / "active" / "LAND-1" / ".result.json.staged").exists()  # recorded, not moved
    proc = env.cli("run", "--once")
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert env.result("LAND-1", state)["state"] == state
    assert not (env.root / "active" / "LAND-1").exists()
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    landed = [e for e in lines if e.get("event") == "job.recovered" and e.get("job_id") == "LAND-1"]
    assert [(e["step"], e["state"]) for e in landed] == [("land", state)]
    stopped = next(e for e in lines if e.get("event") == "daemon.stopped")
    assert stopped[state] == 1
    assert env.count_file.read_text().count("\n") == 1  # the agent ran once, in the daemon that died


@pytest.mark.parametrize("command", ["retry", "cancel", "approve", "land"])
def test_a_command_that_lands_a_dead_daemons_job_logs_it_to_the_log_file_and_notifies_it(
    env: Env, command: str
) -> None:
    """A command that finds a failed (review) job its dead daemon recorded but did not move lands it first: its
    `job.recovered` and end lines go to `log_file` (and to a running daemon), and notify runs once for it with its
    result.json, as the daemon that lands such a job does. They went to the terminal only, and nobody was told.
    A command that then acts on the job (`retry` of the failed job, `approve` of the one in review) runs no
    notify: its result.json moves on (approve's was gone when the notification ran: `{result}` named nothing)."""
    marks, log_file = env.tmp / "notified.txt", env.tmp / "d.log"
    agent = env.agent(review=True) if command == "approve" else env.agent("--exit", "1", max_attempts=1)
    env.configure(
        agents={"worker": agent},
        notify=["sh", "-c", 'echo "$1 $2 $3" >> "$0"', str(marks), "{event}", "{job_id}", "{result}"],
        log_file=str(log_file),
    )
    env.drop(order("CMD-1"))
    run_once_killed_at(env, "finish.recorded")
    state = "review" if command == "approve" else "failed"
    env.cli(command, "CMD-1")  # cancel and land refuse a failed job (exit 1), after landing it
    assert not (env.root / "active" / "CMD-1").exists()
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]
    mine = [e["event"] for e in lines if e.get("job_id") == "CMD-1"]
    assert f"job.{state}" not in mine[: mine.index("job.recovered")], mine  # the dead daemon logged no end
    assert mine[mine.index("job.recovered") :][:2] == ["job.recovered", f"job.{state}"], mine
    if command in ("retry", "approve"):
        time.sleep(2)  # a notification would come now
        assert not marks.exists(), marks.read_text()
        return
    wait_until(marks.exists, 20, "the notification")
    time.sleep(1)  # a second one would come now
    assert marks.read_text() == f"job.{state} CMD-1 {env.root / state / 'CMD-1' / 'result.json'}\n"


@pytest.mark.parametrize("command", ["retry", "approve", "land"])
def test_a_command_on_a_job_whose_dead_daemon_recorded_its_end_moves_it_first(env: Env, command: str) -> None:
    """A daemon killed between the ledger's record of a job's end and the move of its folder leaves it in active/,
    with no daemon running. `retry` (of a failed job), `approve` (of one in review) and `land` (of a done one) move
    it into its folder as the next daemon would, then act: they answered "is active" until a daemon started."""
    landed = env.tmp / "landed.txt"
    agents = {
        "retry": env.agent("--exit", "1", max_attempts=1),
        "approve": env.agent(review=True),
        "land": env.agent(land=["sh", "-c", 'echo "$DISPATCH_JOB_ID" >> "$0"', str(landed)]),
    }
    env.configure(agents={"worker": agents[command]})
    env.drop(order("END-1"))
    run_once_killed_at(env, "finish.recorded")
    assert (env.root / "active" / "END-1").is_dir()
    proc = env.cli(command, "END-1")
    assert proc.returncode == 0, proc.stderr
    assert not (env.root / "active" / "END-1").exists()
    if command == "retry":
        assert env.result("END-1", "failed")["state"] == "failed"
        env.cli("run", "--once")
        assert env.starts() == [("END-1", 1), ("END-1", 2)]
    elif command == "approve":
        assert proc.stdout == "END-1: approved; done\n" and env.result("END-1", "done")["state"] == "done"
    else:
        assert proc.stdout == "END-1: landed\n" and landed.read_text() == "END-1\n"
        assert env.result("END-1", "done")["state"] == "done"


def _children(pid: int) -> list[int]:
    """Return the pids whose parent is pid (this /proc's view)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                continue
    return out


@pytest.mark.parametrize("once", [False, True])
def test_a_dead_daemons_agent_in_a_sibling_pid_namespace_is_waited_for_not_run_twice(env: Env, once: bool) -> None:
    """Two daemons in pid namespaces of their own under this host's name (containers sharing it and the root, SQLite).
    The first is killed while its agent runs on in its namespace (its init lives on), where the second cannot see or
    end it: the second leaves the job alone while that agent holds its slot's lock, and takes it over once it has
    ended, so the agent never runs twice at once (here it ran once: its receipt was there). A second that is
    `run --once`, started after the kill, waits for that job as for any (it exited 0 at once, leaving it in active/)."""
    import shutil
    import subprocess

    agent = env.agent("--sleep", "6", retry_safe=True, max_attempts=3)
    env.configure(agents={"worker": agent}, rescan_interval=1)
    unshare = shutil.which("unshare")
    assert unshare is not None
    # the container's init (sh) outlives its daemon
    first = namespaced_daemon(env.config_path, env.tmp / "first.log", env.tmp, pid1=False, after="sleep 60")
    second: Any = None
    try:
        env.drop(order("NS-1"))
        wait_until(lambda: env.starts() == [("NS-1", 1)], 60, "the first daemon's agent to start")
        started = time.monotonic()
        if not once:
            second = namespaced_daemon(env.config_path, env.tmp / "second.log", env.tmp)
            wait_until(lambda: "daemon.ready" in (env.tmp / "second.log").read_text(), 30, "the second daemon")
        [sh] = _children(first.pid)
        [daemon] = [p for p in _children(sh) if b"dispatcher" in _cmdline(p)]
        os.kill(daemon, signal.SIGKILL)
        if once:
            drain = [unshare, "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-m", "dispatcher",
                     "--config", str(env.config_path), "run", "--once"]  # fmt: skip
            done = subprocess.run(drain, capture_output=True, text=True, timeout=120, env=cli_env(), cwd=env.tmp)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr
        result = env.wait_job("NS-1", "done", timeout=60)
        assert env.starts() == [("NS-1", 1)], env.starts()  # never started again beside the first agent
        assert time.monotonic() - started >= 5.0  # taken over only once that agent had ended
        assert [a["n"] for a in result["attempts"]] == [1]
    finally:
        for p in (first, second):
            if p is not None:
                p.send_signal(signal.SIGKILL)
                p.wait(30)


def _cmdline(pid: int) -> bytes:
    """Return pid's command line (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _descendants(pid: int) -> list[int]:
    """Return every process below pid (this /proc's view)."""
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


@pytest.mark.parametrize("bind", [False, True])
def test_a_daemon_in_a_pid_namespace_above_a_dead_daemons_ends_its_agent_at_once(env: Env, bind: bool) -> None:
    """The recovering daemon runs in a pid namespace that is not the kernel's first (the whole machine in a
    container), above the namespace of the daemon that died (a container inside it; with ``bind``, one that has the
    root bind-mounted at another path, as `-v /srv/x:/data` does, so its agent's DISPATCH_ORDER names another path).
    It sees the dead daemon's agent, which holds its slot lock; `/proc/locks` there cannot name the dead taker, yet
    the agent is one of its processes: it ends it (`agent.orphan_ended`) and takes the job over at once, never
    waiting for the agent's end."""
    import shutil
    import subprocess

    import yaml

    env.configure(agents={"worker": env.agent("--sleep", "20", retry_safe=True, max_attempts=3)}, rescan_interval=1)
    unshare = shutil.which("unshare")
    assert unshare is not None
    go = env.tmp / "go"
    inner = '"$0" -m dispatcher --config "$1" run; sleep 120'  # the inner container's init outlives its daemon
    if bind:
        mount = env.tmp / "mnt"
        mount.mkdir()
        config = yaml.safe_load(env.config_path.read_text()) | {"root": str(mount)}
        (env.tmp / "inner.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        inner = (
            f'mount --bind {env.root} {mount} && "$0" -m dispatcher --config {env.tmp / "inner.yaml"} run; sleep 120'
        )
    outer = (
        f'{unshare} --pid --fork --kill-child --mount-proc sh -c \'{inner}\' "$0" "$1" & '
        'while [ ! -e "$2" ]; do sleep 0.1; done; exec "$0" -m dispatcher --config "$1" run'
    )
    with open(env.tmp / "outer.log", "wb") as log:
        box = subprocess.Popen(
            [unshare, "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", outer, sys.executable,
             str(env.config_path), str(go)],
            stdout=log, stderr=subprocess.STDOUT, env=cli_env(), cwd=env.tmp,
        )  # fmt: skip
    try:
        env.drop(order("NEST-1"))
        wait_until(lambda: env.starts() == [("NEST-1", 1)], 60, "the inner daemon's agent to start")
        [daemon] = [p for p in _descendants(box.pid) if b"-m\x00dispatcher" in _cmdline(p)]
        os.kill(daemon, signal.SIGKILL)
        started = time.monotonic()
        go.touch()

        def ended() -> list[dict[str, Any]]:
            lines = [json.loads(x) for x in (env.tmp / "outer.log").read_text().splitlines() if x.startswith("{")]
            return [e for e in lines if e.get("event") == "agent.orphan_ended" and e.get("job_id") == "NEST-1"]

        wait_until(ended, 15, "the outer daemon to end the dead daemon's agent")
        assert time.monotonic() - started < 15  # not the agent's own end (it sleeps 20 s)
        result = env.wait_job("NEST-1", "done", timeout=60)
        assert [a["n"] for a in result["attempts"]] == [1, 2]
    finally:
        box.send_signal(signal.SIGKILL)
        box.wait(30)


def test_run_once_started_while_a_daemon_stops_runs_the_jobs_that_daemon_left_when_it_died(env: Env) -> None:
    """`kill -TERM` of a daemon, then `run --once` at once (section 7: --once recovers and waits for every job):
    the stopping daemon is alive at the start, so its jobs are its own; it dies while --once runs its own job,
    and --once, before it exits, takes over the jobs it left (retry_safe: run again) and exits 0 with all done.
    It exited 0 with them left in active/ (rescans are far apart here, as with the default interval)."""
    env.configure(
        agents={
            "slow": env.agent("--sleep", "8", retry_safe=True, concurrency=2, max_attempts=2),
            "own": env.agent("--sleep", "5"),
        },
        stop_timeout=2,
        rescan_interval=120,
    )
    d = env.daemon()
    d.wait_ready()
    for k in ("K1", "K2"):
        env.drop(order(k, to="slow"))
    for k in ("K1", "K2"):
        d.wait_event("agent.started", job_id=k)
    d.signal(signal.SIGTERM)
    d.wait_event("daemon.stopping")
    env.drop(order("OWN", to="own"))
    proc = env.cli("run", "--once", timeout=120)
    assert d.wait() == 0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the stopping daemon was alive at --once's start (not a start-up recovery of a daemon already dead)
    assert '"daemon.shared"' in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert os.listdir(env.root / "active") == []
    for k in ("K1", "K2", "OWN"):
        assert env.result(k, "done")["state"] == "done"
