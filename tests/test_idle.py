"""idle_timeout (contract section 14): an agent silent and idle that long is ended as timed out."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from conftest import Env, order

HEADLESS = Path(__file__).resolve().parent / "agents" / "headless.py"


def agent(env: Env, name: str, plan: dict[str, Any], **settings: Any) -> dict[str, Any]:
    plan_file = env.tmp / f"plan-{name}.json"
    plan_file.write_text(json.dumps(plan))
    spec: dict[str, Any] = {
        "command": [sys.executable, str(HEADLESS), "--count", str(env.count_file), "--plan", str(plan_file)],
        "timeout": 30,
        "writes": ["out.csv", "notes-*.txt"],
        "idle_timeout": 2,
    }
    spec.update(settings)
    return spec


def test_an_idle_agent_is_ended_and_a_busy_one_with_the_same_timeout_is_not(env: Env) -> None:
    """Same idle_timeout 2: silent for 20 s is ended ("idle 2 s"); printing or writing files for 5 s is not."""
    env.configure(
        agents={
            "idle": agent(env, "idle", {"silent_s": 20}),
            "busy": agent(env, "busy", {"busy_s": 5}),
            "writer": agent(env, "writer", {"quiet_work_s": 5}),
        },
        max_jobs=3,
    )
    d = env.daemon()
    d.wait_ready()
    for job_id, to in (("IDLE-1", "idle"), ("BUSY-1", "busy"), ("WRITER-1", "writer")):
        env.drop(order(job_id, to=to))
    idle = env.wait_job("IDLE-1", "failed")
    assert idle["reason"].startswith("exit_ok: timed out: idle 2 s")
    first = idle["attempts"][0]
    assert first["timed_out"] is True and first["idle_s"] == 2 and first["duration_ms"] < 10_000
    busy = env.wait_job("BUSY-1", "done")
    assert busy["attempts"][0]["duration_ms"] >= 5000
    writer = env.wait_job("WRITER-1", "done")
    assert writer["attempts"][0]["duration_ms"] >= 5000


def test_an_idle_attempt_is_retried_under_the_usual_rules(env: Env) -> None:
    """A retry-safe agent ended as idle runs again (the retry rules apply as for any timeout)."""
    env.configure(agents={"worker": agent(env, "w", {"silent_s": 20}, retry_safe=True, max_attempts=2)})
    env.daemon().wait_ready()
    env.drop(order("IDLE-2"))
    result = env.wait_job("IDLE-2", "failed")
    assert [a["n"] for a in result["attempts"]] == [1, 2]
    assert result["reason"].startswith("exit_ok: timed out: idle 2 s") and "no attempts left" in result["reason"]


# silent; rewrites its receipt in the job's work/ (not in its worktree) every 0.4 s for 4 s
WORKS_IN_WORK = """import json, os, time
receipt = {"job_id": os.environ["DISPATCH_JOB_ID"], "input_ids": ["R1"], "output_ids": [], "status": "done"}
end = time.time() + 4
while time.time() < end:
    json.dump({**receipt, "at": time.time()}, open(os.environ["DISPATCH_RECEIPT"], "w"))
    time.sleep(0.4)
"""


def test_changes_in_work_count_as_activity_for_an_agent_in_a_worktree(env: Env, tmp_path: Path) -> None:
    """README, idle_timeout: a changed modification time of anything under work/ counts as activity, also for an
    agent with a workspace, whose own folder is its worktree."""
    from git_helpers import code_order, coder, make_repo

    repo = make_repo(tmp_path / "shop")
    script = tmp_path / "works.py"
    script.write_text(WORKS_IN_WORK)
    spec = coder(env, repo, command=[sys.executable, str(script)], idle_timeout=1.5)
    env.configure(agents={"coder": spec})
    env.daemon().wait_ready()
    env.drop(code_order("WORKING-1"))
    result = env.wait_job("WORKING-1", "done")
    assert result["attempts"][0]["duration_ms"] >= 4000 and not result["attempts"][0]["timed_out"]


def test_an_agent_that_ended_in_time_while_the_daemon_was_stalled_is_judged_by_its_exit(env: Env) -> None:
    """The daemon is stopped (SIGSTOP) for 6 s while two agents run: one with timeout 3 s, one with idle_timeout 2 s
    and a line of output every 0.5 s; both end on their own within 1.5 s, before the daemon runs again. Neither is
    taken for timed out (section 5: exit_ok is an exit 0 within the timeout; section 14: output is activity): both
    jobs are done, with one attempt each."""
    env.configure(
        agents={
            "short": agent(env, "short", {"busy_s": 1}, timeout=3, idle_timeout=None),
            "chatty": agent(env, "chatty", {"busy_s": 1.5}),
        },
        max_jobs=2,
    )
    d = env.daemon()
    d.wait_ready()
    env.drop(order("STALL-T", to="short"))
    env.drop(order("STALL-I", to="chatty"))
    d.wait_event("agent.started", job_id="STALL-T")
    d.wait_event("agent.started", job_id="STALL-I")
    d.signal(signal.SIGSTOP)
    time.sleep(6)
    d.signal(signal.SIGCONT)
    for job_id in ("STALL-T", "STALL-I"):
        result = env.wait_job(job_id, "done", timeout=60)
        assert [a["timed_out"] for a in result["attempts"]] == [False], result["attempts"]
    assert d.stop() == 0
