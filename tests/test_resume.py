"""`resume:` (contract section 14): later attempts go on with the session an earlier one reported."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, order
from test_claude import LOGIN_VARIABLES, real_claude

HEADLESS = Path(__file__).resolve().parent / "agents" / "headless.py"


def test_a_resumed_session_costs_only_its_own_part(env: Env) -> None:
    """Attempt 2 runs `resume` with the session of attempt 1; its cost is the session's total minus 0.25."""
    plan = env.tmp / "plan.json"
    plan.write_text(json.dumps({"cost_usd": 0.25}))
    flag = env.tmp / "checked-once"
    base = [sys.executable, str(HEADLESS), "--count", str(env.count_file), "--plan", str(plan)]
    check = "import os, sys; p = sys.argv[1]; ok = os.path.exists(p); open(p, 'a').close(); sys.exit(0 if ok else 1)"
    spec: dict[str, Any] = {
        "command": base,
        "resume": [*base, "--resume", "{session_id}"],
        "timeout": 30,
        "writes": ["out.csv"],
        "retry_safe": True,
        "repair": True,
        "max_attempts": 2,
        "checks": [{"name": "tests", "command": [sys.executable, "-c", check, str(flag)]}],
    }
    env.configure(agents={"worker": spec})
    env.daemon().wait_ready()
    env.drop(order("RESUME-1"))
    result = env.wait_job("RESUME-1", "done")
    first, second = result["attempts"]
    session = first["agent_result"]["session_id"]
    assert first["argv"] == base and second["argv"] == [*base, "--resume", session]
    assert second["agent_result"]["session_id"] == session
    assert second["agent_result"]["total_cost_usd"] == pytest.approx(0.5)
    assert first["cost_usd"] == pytest.approx(0.25) and second["cost_usd"] == pytest.approx(0.25)
    assert result["cost_usd"] == pytest.approx(0.5)


@pytest.mark.claude
def test_the_real_claude_accepts_resume_in_its_argv(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real `claude -p --resume SESSION` (no login) takes the argv, goes on with that session, fails cleanly."""
    binary = real_claude()
    home = env.tmp / "empty-home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in LOGIN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    base = [str(binary), "-p", "--output-format", "json"]
    spec: dict[str, Any] = {
        "command": [*base, "Write receipt.json for the order in order.json."],
        "resume": [*base, "--resume", "{session_id}", "Go on where you stopped."],
        "timeout": 120,
        "retry_safe": True,
        "max_attempts": 2,
        "env": {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    }
    env.configure(agents={"worker": spec}, retry_delay=0.1)
    env.daemon().wait_ready()
    env.drop(order("REAL-RESUME"))
    result = env.wait_job("REAL-RESUME", "failed", timeout=240)
    first, second = result["attempts"]
    session = first["agent_result"]["session_id"]
    assert second["argv"][:6] == [*base, "--resume", session]
    assert second["exit_code"] == 1
    found = second["agent_result"]  # the CLI saved attempt 1's session under HOME and resumed it
    assert found["is_error"] is True and found["session_id"] == session, found
    assert found["result"] == "Not logged in · Please run /login"
    stderr = (env.root / "failed" / "REAL-RESUME" / "attempts" / "2" / "stderr.log").read_text()
    assert "unknown option" not in stderr, stderr
    assert result["reason"].startswith("exit_ok: exit 1")


def test_session_id_is_replaced_in_the_resume_argv_only_not_inside_the_prompt(env: Env) -> None:
    """`{session_id}` is a placeholder of the `resume` argv (section 14): a task that says `{session_id}` reaches
    attempt 2 in its `{prompt}` as written, as in prompt.md (section 3: other text passes unchanged)."""
    agent = env.tmp / "once.py"
    agent.write_text('import json\nprint(json.dumps({"session_id": "abc123"}))\nraise SystemExit(1)\n')
    base = [sys.executable, str(agent)]
    spec: dict[str, Any] = {
        "command": [*base, "{prompt}"],
        "resume": [*base, "--resume", "{session_id}", "{prompt}"],
        "prompt": "{task}",
        "timeout": 30,
        "retry_safe": True,
        "max_attempts": 2,
    }
    env.configure(agents={"worker": spec})
    env.daemon().wait_ready()
    task = "print the text {session_id} literally"
    env.drop(order("SESSION-TEXT", task=task))
    result = env.wait_job("SESSION-TEXT", "failed")
    first, second = result["attempts"]
    assert first["argv"] == [*base, task]
    assert second["argv"] == [*base, "--resume", "abc123", task]
    assert (env.job_dir("SESSION-TEXT", "failed") / "work" / "prompt.md").read_text() == task


BAD_SESSION = """import json, os, subprocess, sys
if os.environ["DISPATCH_ATTEMPT"] == "1":
    sid = {"nul": "abc\\u0000", "long": "s" * 200_000, "newline": "abc\\ndef"}[sys.argv[1]]
    print(json.dumps({"type": "result", "session_id": sid, "total_cost_usd": 0.1}))
    sys.exit(1)
sys.exit(subprocess.run(sys.argv[2:]).returncode)
"""


@pytest.mark.parametrize("kind", ["nul", "long", "newline"])
def test_a_session_id_no_argv_can_carry_is_no_session_and_the_retry_runs_command(env: Env, kind: str) -> None:
    """An agent's final JSON names a session id with a NUL byte, one of 200,000 characters or one with a line
    break: that is no session (as a number or an empty id is), so the retry runs `command`, not a `resume` argv no
    program can be started with (before: the job failed `config: agent worker cannot start`)."""
    script = env.tmp / "bad_session.py"
    script.write_text(BAD_SESSION)
    work = env.agent()["command"]
    spec = {
        **env.agent(retry_safe=True, max_attempts=2),
        "command": [sys.executable, str(script), kind, *work],
        "resume": [sys.executable, str(script), kind, *work, "{session_id}"],
    }
    env.configure(agents={"worker": spec})
    env.daemon().wait_ready()
    env.drop(order("BADSID"))
    result = env.wait_job("BADSID", "done")
    assert [a["argv"] for a in result["attempts"]] == [spec["command"], spec["command"]]
