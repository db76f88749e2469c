"""Claude Code as an agent: `claude -p --output-format json` run by the real daemon.

The stub `tests/agents/claude` (first on the agent's PATH through the config's `env`) plays
the CLI without a login; one test runs the real CLI from npm package
`@anthropic-ai/claude-code` with an empty HOME, so it is not logged in. Contract section 5:
the last JSON object an agent prints is recorded as the attempt's `agent_result`, and
neither the exit code nor the CLI's own `is_error` is the proof: the checks are.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Env, order, wait_until

REPO = Path(__file__).resolve().parent.parent
STUB = REPO / "tests" / "agents" / "claude"
CLAUDE_CONFIG = REPO / "config" / "agents.claude.yaml"
KOPI_ORDER = REPO / "examples" / "kopi" / "JOB-001.yaml"
# Where the real CLI is looked for, in this order (then `claude` on the test's PATH):
# .ci/run installs it with `npm install --no-save --prefix .ci/node @anthropic-ai/claude-code`.
REAL_CLAUDE_PLACES = [
    REPO / ".ci" / "node" / "node_modules" / ".bin" / "claude",
    REPO / "node_modules" / ".bin" / "claude",
]
SKIP_REAL = "DISPATCHER_SKIP_REAL_CLAUDE"
# Never let a login reach the CLI under test: these would log it in.
LOGIN_VARIABLES = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_OAUTH_TOKEN")


def stub_folder(tmp: Path) -> Path:
    """Return a folder whose `claude` is the stub (a launcher if the stub is not executable)."""
    assert STUB.is_file(), f"{STUB} is missing: the claude stub is part of this checkout"
    if os.access(STUB, os.X_OK):
        return STUB.parent
    folder = tmp / "stub-bin"
    folder.mkdir(exist_ok=True)
    launcher = folder / "claude"
    launcher.write_text(
        f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {str(STUB)!r}\n"
        f"runpy.run_path({str(STUB)!r}, run_name='__main__')\n"
    )
    launcher.chmod(0o755)
    return folder


def search_path(first: Path) -> str:
    """Return PATH with `first` in front and no other folder holding the stub."""
    rest = [p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep) if p]
    rest = [p for p in rest if Path(p).resolve() != STUB.parent]
    return os.pathsep.join([str(first), *rest])


def claude_agents(**env_vars: str) -> dict[str, dict[str, Any]]:
    """Return the agents of config/agents.claude.yaml with extra environment variables."""
    assert CLAUDE_CONFIG.is_file(), f"{CLAUDE_CONFIG} is missing"
    agents: dict[str, dict[str, Any]] = yaml.safe_load(CLAUDE_CONFIG.read_text())["agents"]
    for spec in agents.values():
        spec["env"] = {**(spec.get("env") or {}), **env_vars}
        spec["timeout"] = 120
    return agents


def agent_result(result: dict[str, Any]) -> dict[str, Any]:
    """Return the agent_result of the last attempt, failing clearly if none was recorded."""
    attempt = result["attempts"][-1]
    assert "agent_result" in attempt, f"no agent_result recorded in {attempt}"
    assert isinstance(attempt["agent_result"], dict), attempt["agent_result"]
    return attempt["agent_result"]


def assert_cli_fields(found: dict[str, Any], is_error: bool) -> None:
    """Assert the fields a headless run is known by: is_error, session_id, total_cost_usd."""
    assert found.get("is_error") is is_error, found
    assert isinstance(found.get("session_id"), str) and found["session_id"], found
    cost = found.get("total_cost_usd")
    assert isinstance(cost, int | float) and not isinstance(cost, bool) and cost >= 0, found


def finished(env: Env, job_id: str, state: str, timeout: float = 60) -> dict[str, Any]:
    """Wait for the job's result; fail at once, with the reason, if its file was refused."""

    def seen() -> bool:
        return bool(env.refusals()) or any(
            (env.job_dir(job_id, s) / "result.json").exists() for s in ("done", "failed")
        )

    wait_until(seen, timeout, f"job {job_id} to finish")
    refused = [json.loads((p / "result.json").read_text()) for p in env.refusals()]
    assert not refused, f"refused: {[r.get('reason') for r in refused]}"
    return env.wait_job(job_id, state, timeout=timeout)


def check(result: dict[str, Any], name: str) -> dict[str, Any]:
    """Return one named check of a result.json."""
    return next(c for c in result["checks"] if c["name"] == name)


def test_stub_claude_runs_the_kopi_chain_and_records_agent_result(env: Env) -> None:
    """The Kopi & Crumb chain through `claude` ends done, each attempt with cost and session id."""
    path = search_path(stub_folder(env.tmp))
    env.configure(agents=claude_agents(PATH=path))
    d = env.daemon()
    d.wait_ready()
    env.drop(KOPI_ORDER.read_bytes(), "JOB-001.yaml")

    intake = finished(env, "JOB-001", "done")
    assigner = env.wait_job("JOB-001.assign", "done")
    assert intake["children"] == ["JOB-001.assign"]
    assert assigner["parent"] == "JOB-001"
    for result in (intake, assigner):
        found = agent_result(result)
        assert_cli_fields(found, is_error=False)
        assert found.get("type") == "result" and isinstance(found.get("num_turns"), int)
    assert (env.job_dir("JOB-001.assign", "done") / "work" / "assignments.csv").is_file()
    assert d.stop() == 0


def test_stub_claude_that_did_nothing_fails_on_the_checks(env: Env) -> None:
    """A `claude` run that exits 0, is_error false, but writes no receipt fails receipt_present."""
    path = search_path(stub_folder(env.tmp))
    helper = {
        "command": ["claude", "-p", "{prompt}", "--output-format", "json"],
        "prompt": "You are the helper agent. Handle order {job_id}: {task}",
        "timeout": 60,
        "env": {"PATH": path},
    }
    env.configure(agents={"helper": helper, "worker": env.agent()})
    d = env.daemon()
    d.wait_ready()
    env.drop(order("CLAUDE-IDLE", to="helper"))

    result = finished(env, "CLAUDE-IDLE", "failed")
    assert check(result, "exit_ok")["ok"] is True
    assert result["reason"].startswith("receipt_present"), result["reason"]
    assert_cli_fields(agent_result(result), is_error=False)
    assert (
        (env.job_dir("CLAUDE-IDLE", "failed") / "work" / "prompt.md")
        .read_text()
        .startswith("You are the helper agent. Handle order CLAUDE-IDLE: ")
    )
    assert d.stop() == 0


def test_stub_claude_not_logged_in_fails_cleanly(env: Env) -> None:
    """`claude` without a login (is_error, exit 1) fails the job on exit_ok with its fields kept."""
    path = search_path(stub_folder(env.tmp))
    env.configure(agents=claude_agents(PATH=path, CLAUDE_STUB_MODE="not-logged-in"))
    d = env.daemon()
    d.wait_ready()
    env.drop(KOPI_ORDER.read_bytes(), "JOB-001.yaml")

    result = finished(env, "JOB-001", "failed")
    assert result["reason"].startswith("exit_ok"), result["reason"]
    assert len(result["attempts"]) == 1
    assert result["attempts"][0]["exit_code"] == 1
    found = agent_result(result)
    assert_cli_fields(found, is_error=True)
    assert found["total_cost_usd"] == 0
    assert result["children"] == []
    assert not env.job_dir("JOB-001.assign", "active").exists()
    assert d.stop() == 0


def real_claude() -> Path:
    """Return the real claude CLI, or fail (skip only when DISPATCHER_SKIP_REAL_CLAUDE=1)."""
    places = list(REAL_CLAUDE_PLACES)
    on_path = shutil.which("claude")
    if on_path:
        places.append(Path(on_path))
    for place in places:
        if place.exists() and os.access(place, os.X_OK) and place.resolve() != STUB.resolve():
            return place
    why = (
        "the real claude CLI is not installed: run `npm install --no-save --prefix .ci/node "
        "@anthropic-ai/claude-code` (looked in " + ", ".join(str(p) for p in places) + ")"
    )
    if os.environ.get(SKIP_REAL) == "1":
        pytest.skip(f"{SKIP_REAL}=1: {why}")
    pytest.fail(why)


@pytest.mark.claude
def test_real_claude_without_login_fails_cleanly(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real `claude` with an empty HOME fails the job on exit_ok, is_error and session kept."""
    binary = real_claude()
    home = env.tmp / "empty-home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # the daemon's HOME, passed on to the agent
    for name in LOGIN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    agents = claude_agents(PATH=search_path(binary.parent), HOME=str(home))
    env.configure(agents={**agents, "worker": env.agent()})
    d = env.daemon()
    d.wait_ready()
    env.drop(KOPI_ORDER.read_bytes(), "JOB-001.yaml")

    result = finished(env, "JOB-001", "failed", timeout=150)
    assert check(result, "exit_ok")["ok"] is False
    assert result["reason"].startswith("exit_ok"), result["reason"]
    assert len(result["attempts"]) == 1
    assert result["attempts"][0]["exit_code"] != 0
    assert_cli_fields(agent_result(result), is_error=True)
    assert result["children"] == []
    assert d.stop() == 0
