"""`validate` of the config itself, `pass_env`, and output without Python notation (contract 3, 6, 7)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import cli_env, order

from dispatcher.errors import OrderError
from dispatcher.spec import schema
from dispatcher.spec.config import STARTER_CONFIG, build_config, load_config
from dispatcher.spec.settings import Agent


def validate(cfg: Path, *files: str) -> subprocess.CompletedProcess[str]:
    """Run `dispatcher validate --config CFG FILES` in the config's folder."""
    return subprocess.run(
        [sys.executable, "-m", "dispatcher", "validate", "--config", cfg.name, *files],
        capture_output=True,
        text=True,
        cwd=cfg.parent,
        env=cli_env(),
        timeout=60,
    )


def config(tmp_path: Path, agents: dict[str, dict[str, Any]], **top: Any) -> Path:
    """Write dispatcher.yaml in tmp_path with these agents."""
    path = tmp_path / "dispatcher.yaml"
    path.write_text(yaml.safe_dump({"root": "dispatch", "agents": agents, **top}))
    return path


def stderr_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.strip()]


# -- programs -------------------------------------------------------------------------------------


def test_an_agent_program_that_does_not_exist_is_an_error_naming_it(tmp_path: Path) -> None:
    """A command whose program is missing exits 2: `<config>: agents.NAME.command: program '...' not found`."""
    cfg = config(tmp_path, {"gone": {"command": ["agents/gone.sh", "{order}"]}})
    proc = validate(cfg)
    assert proc.returncode == 2
    assert stderr_lines(proc) == [
        f"dispatcher.yaml: agents.gone.command: program '{tmp_path / 'agents' / 'gone.sh'}' not found"
    ]
    assert proc.stdout == ""


def test_a_program_that_is_not_executable_is_shown_like_a_missing_one(tmp_path: Path) -> None:
    """A program without the execute bit is an error naming the same absolute path a missing one would."""
    script = tmp_path / "agents" / "noexec.sh"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    cfg = config(tmp_path, {"noexec": {"command": ["agents/noexec.sh"]}})
    proc = validate(cfg)
    assert proc.returncode == 2
    assert stderr_lines(proc) == [f"dispatcher.yaml: agents.noexec.command: program '{script}' is not executable"]


def test_a_bare_program_name_is_looked_up_on_path(tmp_path: Path) -> None:
    """A bare name not on PATH is `not found`; one on PATH (python3) is fine; a probe is checked the same way."""
    cfg = config(
        tmp_path,
        {
            "nowhere": {"command": ["no-such-program-4f1c"]},
            "fine": {"command": ["python3", "-c", "pass"], "probe": ["no-such-probe-4f1c", "{job_id}"]},
        },
    )
    proc = validate(cfg)
    assert proc.returncode == 2
    assert sorted(stderr_lines(proc)) == [
        "dispatcher.yaml: agents.fine.probe: program 'no-such-probe-4f1c' not found",
        "dispatcher.yaml: agents.nowhere.command: program 'no-such-program-4f1c' not found",
    ]


def test_resume_user_checks_and_notify_programs_are_checked_too(tmp_path: Path) -> None:
    """A missing program of `resume`, of a user check or of `notify` is an error naming its field; a check's
    relative path is the workspace's own, where it runs, so it is not looked for beside the config."""
    cfg = config(
        tmp_path,
        {
            "coder": {
                "command": ["python3", "-c", "pass"],
                "resume": ["no-such-resume-4f1c", "--resume", "{session_id}"],
                "checks": [
                    {"name": "tests", "command": ["no-such-check-4f1c", "-q"]},
                    {"name": "lint", "command": ["scripts/lint.sh"]},
                    {"name": "fine", "command": ["python3", "-c", "pass"]},
                ],
            }
        },
        notify=["/no/such/notify-4f1c", "{event}", "{job_id}"],
    )
    proc = validate(cfg)
    assert proc.returncode == 2
    assert sorted(stderr_lines(proc)) == [
        "dispatcher.yaml: agents.coder.checks[0].command: program 'no-such-check-4f1c' not found",
        "dispatcher.yaml: agents.coder.resume: program 'no-such-resume-4f1c' not found",
        "dispatcher.yaml: notify: program '/no/such/notify-4f1c' not found",
    ]
    fixed = yaml.safe_load(cfg.read_text())
    fixed["agents"]["coder"]["resume"][0] = "python3"
    fixed["agents"]["coder"]["checks"][0]["command"][0] = "python3"
    fixed["notify"][0] = sys.executable
    cfg.write_text(yaml.safe_dump(fixed))
    proc = validate(cfg)
    assert proc.returncode == 0, proc.stderr


def test_an_executable_program_and_a_placeholder_pass(tmp_path: Path) -> None:
    """An executable script path and a program built from a placeholder are not errors."""
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    cfg = config(tmp_path, {"a": {"command": ["./run.sh"]}, "b": {"command": ["{workspace}/tool"]}})
    proc = validate(cfg)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "dispatcher.yaml: ok (2 agents)\n"


# -- repair warning and plain output ------------------------------------------------------------------


def test_repair_without_retry_safe_or_probe_is_a_warning_not_an_error(tmp_path: Path) -> None:
    """`repair: true` alone warns on stderr and exits 0; with retry_safe or a probe it says nothing."""
    cfg = config(
        tmp_path,
        {
            "lonely": {"command": ["python3"], "repair": True},
            "safe": {"command": ["python3"], "repair": True, "retry_safe": True},
            "probed": {"command": ["python3"], "repair": True, "probe": ["python3", "-c", "1"]},
        },
    )
    proc = validate(cfg)
    assert proc.returncode == 0, proc.stderr
    assert stderr_lines(proc) == ["dispatcher.yaml: agents.lonely.repair: has no effect without retry_safe or probe"]
    assert proc.stdout == "dispatcher.yaml: ok (3 agents)\n"


def test_a_name_in_both_env_and_pass_env_is_a_warning_that_says_which_wins(tmp_path: Path) -> None:
    """A variable both set in `env` and named in `pass_env` warns (env's value wins) and exits 0."""
    cfg = config(tmp_path, {"both": {"command": ["python3"], "env": {"X1": "a", "Y": "b"}, "pass_env": ["X1", "Z"]}})
    proc = validate(cfg)
    assert proc.returncode == 0, proc.stderr
    assert stderr_lines(proc) == ["dispatcher.yaml: agents.both.pass_env: X1 also set in env: env's value wins"]
    assert proc.stdout == "dispatcher.yaml: ok (1 agent)\n"


def test_one_agent_is_counted_in_the_singular(tmp_path: Path) -> None:
    """A config with one agent validates as `ok (1 agent)`."""
    proc = validate(config(tmp_path, {"only": {"command": ["python3"]}}))
    assert proc.stdout == "dispatcher.yaml: ok (1 agent)\n", proc.stderr


def test_timeout_errors_show_numbers_as_written_not_as_floats(tmp_path: Path) -> None:
    """`max_timeout: 3600` reads back as 3600 (never 3600.0) in the agent's and the order's timeout errors."""
    cfg = config(tmp_path, {"w": {"command": ["python3"], "timeout": 3601}}, max_timeout=3600)
    proc = validate(cfg)
    assert proc.returncode == 2
    assert stderr_lines(proc) == ["dispatcher.yaml: agents.w.timeout: 3601 is above max_timeout (3600)"]
    cfg = config(tmp_path, {"w": {"command": ["python3"]}}, max_timeout=3600)
    (tmp_path / "o.json").write_text(json.dumps(order("T-1", to="w", timeout=4000.0)))
    proc = validate(cfg, "o.json")
    assert stderr_lines(proc) == ["o.json: timeout: 4000 is above max_timeout (3600)"]


def test_a_max_timeout_below_the_default_agent_timeout_caps_it_and_an_explicit_one_above_is_one_line(
    tmp_path: Path,
) -> None:
    """An agent without a timeout has 600 s, at most max_timeout: `max_timeout: 100` gives it 100 s and the config
    loads; an agent's own `timeout: 600` above it is refused in one line, exit 2, no traceback (section 3)."""
    cfg = config(tmp_path, {"w": {"command": ["python3"]}}, max_timeout=100)
    (tmp_path / "dispatch").mkdir()
    assert validate(cfg).returncode == 0
    assert load_config(cfg).agents["w"].timeout_s == 100
    cfg = config(tmp_path, {"w": {"command": ["python3"], "timeout": 600}}, max_timeout=100)
    for args in (["validate", "--config", cfg.name], ["--config", cfg.name, "status"], ["--config", cfg.name, "list"]):
        proc = subprocess.run(
            [sys.executable, "-m", "dispatcher", *args], capture_output=True, text=True, cwd=tmp_path, env=cli_env()
        )
        assert proc.returncode == 2, (args, proc.stderr)
        assert stderr_lines(proc) == ["dispatcher.yaml: agents.w.timeout: 600 is above max_timeout (100)"]


def test_order_errors_quote_values_without_python_escapes(tmp_path: Path) -> None:
    """An unknown agent or a repeated item id is quoted plainly, even when it holds a quote character."""
    cfg = config(tmp_path, {"w": {"command": ["python3"]}})
    (tmp_path / "o.json").write_text(json.dumps(order("T-1", to="bob's")))
    assert stderr_lines(validate(cfg, "o.json")) == ["o.json: to: no agent 'bob's' is defined in the config"]


# -- pass_env -----------------------------------------------------------------------------------------


def test_pass_env_loads_as_a_tuple_of_names(tmp_path: Path) -> None:
    """`pass_env: [ANTHROPIC_API_KEY, HTTPS_PROXY]` becomes Agent.pass_env; without it the agent passes nothing."""
    path = config(
        tmp_path,
        {
            "llm": {"command": ["python3"], "pass_env": ["ANTHROPIC_API_KEY", "HTTPS_PROXY"]},
            "plain": {"command": ["x"]},
        },
    )
    cfg = load_config(path)
    assert cfg.agents["llm"].pass_env == ("ANTHROPIC_API_KEY", "HTTPS_PROXY")
    assert cfg.agents["plain"].pass_env == ()


def test_pass_env_survives_the_job_snapshot_and_old_snapshots_still_load() -> None:
    """Agent.to_json keeps pass_env; from_json of a snapshot written before pass_env existed gives ()."""
    agent = Agent(name="llm", command=("claude", "-p"), pass_env=("ANTHROPIC_API_KEY",))
    snap = json.loads(json.dumps(agent.to_json()))
    assert snap["pass_env"] == ["ANTHROPIC_API_KEY"]
    assert Agent.from_json(snap) == agent
    del snap["pass_env"]
    assert Agent.from_json(snap).pass_env == ()


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (["1KEY"], "environment variable name"),
        (["A-B"], "environment variable name"),
        (["A B"], "environment variable name"),
        ("ANTHROPIC_API_KEY", "a list"),
        ([5], "a string"),
        (["NOTIFY_SOCKET"], "never passed"),
        (["WATCHDOG_USEC"], "never passed"),
        (["DISPATCH_JOB_ID"], "never passed"),
    ],
)
def test_pass_env_rejects_what_is_not_a_variable_name_it_may_pass(value: Any, words: str) -> None:
    """pass_env is a list of environment variable names, never one the daemon keeps for itself or sets per job."""
    with pytest.raises(OrderError) as info:
        build_config({"agents": {"a": {"command": ["x"], "pass_env": value}}}, None)
    assert info.value.field is not None and info.value.field.startswith("agents.a.pass_env")
    assert words in info.value.message


@pytest.mark.parametrize(
    ("env", "field", "words"),
    [
        ({"A=B": "y"}, "agents.w.env.A=B", "environment variable name"),
        ({"": "y"}, "agents.w.env.", "environment variable name"),
        ({"1A": "y"}, "agents.w.env.1A", "environment variable name"),
        ({"A": "x\0y"}, "agents.w.env.A", "NUL"),
    ],
)
def test_env_that_no_process_could_get_is_a_config_error(
    tmp_path: Path, env: dict[str, str], field: str, words: str
) -> None:
    """An `env:` name or value an agent could never be started with fails `validate` (exit 2, the field named),
    not every job of the agent later."""
    path = tmp_path / "dispatcher.yaml"
    path.write_text(json.dumps({"root": "dispatch", "agents": {"w": {"command": ["/bin/true"], "env": env}}}))
    proc = validate(path)
    assert proc.returncode == 2
    (line,) = stderr_lines(proc)
    assert line.startswith(f"dispatcher.yaml: {field}: ") and words in line


@pytest.mark.parametrize(
    ("branch", "words"), [("work/x", "must hold {job_id}"), ("-x{job_id}", "must not start with -")]
)
def test_a_workspace_branch_git_could_not_take_is_a_config_error(tmp_path: Path, branch: str, words: str) -> None:
    """A branch template without {job_id}, or one git would read as an option, fails `validate` naming the field."""
    path = config(tmp_path, {"c": {"command": ["/bin/true"], "workspace": {"git": str(tmp_path), "branch": branch}}})
    proc = validate(path)
    assert proc.returncode == 2
    (line,) = stderr_lines(proc)
    assert line.startswith("dispatcher.yaml: agents.c.workspace.branch: ") and words in line


def test_env_with_usual_names_and_values_loads(tmp_path: Path) -> None:
    path = config(tmp_path, {"w": {"command": ["/bin/true"], "env": {"HOME": "/h", "_X1": "a=b c", "lower": ""}}})
    assert load_config(path).agents["w"].env == {"HOME": "/h", "_X1": "a=b c", "lower": ""}


def test_schema_file_declares_pass_env() -> None:
    """The published config schema (for editors) has pass_env as a list of variable-name strings."""
    spec = schema.load("config")["$defs"]["agent"]["properties"]["pass_env"]
    assert spec["type"] == "array" and spec["items"]["type"] == "string"
    assert "pattern" in spec["items"]


def test_starter_config_has_pass_env_and_loads(tmp_path: Path) -> None:
    """The config `init` writes lists pass_env with the agent's keys, and it loads as a valid config."""
    path = tmp_path / "dispatcher.yaml"
    path.write_text(STARTER_CONFIG.format(root="dispatch"))
    assert "pass_env: []" in STARTER_CONFIG
    cfg = load_config(path)
    assert [a.pass_env for a in cfg.agents.values()] == [()]


def test_relative_sandbox_writable_paths_resolve_against_the_configs_folder(tmp_path: Path) -> None:
    """sandbox_writable: a relative path is the config folder's (as every path of the config); ~ and absolute stay."""
    folder = tmp_path / "cfg"
    folder.mkdir()
    path = folder / "dispatcher.yaml"
    writable = ["state", "../shared/out", "~/.claude", "/srv/cache"]
    path.write_text(yaml.safe_dump({"agents": {"coder": {"command": ["true"], "sandbox_writable": writable}}}))
    got = load_config(path).agents["coder"].repo.sandbox_writable
    assert got == (str(folder / "state"), str(tmp_path / "shared" / "out"), "~/.claude", "/srv/cache")


@pytest.mark.parametrize(
    ("hook", "field", "message"),
    [
        (["sleep", 1], "agents.w.before[1]", "must be a string, not an integer"),
        ({"command": ["git", 2]}, "agents.w.before.command[1]", "must be a string, not an integer"),
        ({"command": ["true"], "timeout": "x"}, "agents.w.before.timeout", "must be a number, not a string"),
        (7, "agents.w.before", "not an integer"),
    ],
)
def test_a_bad_hook_is_named_where_it_went_wrong(tmp_path: Path, hook: Any, field: str, message: str) -> None:
    """A hook (argv, or {command, timeout}) with a bad part names that part, not the form it did not take."""
    path = config(tmp_path, {"w": {"command": ["true"], "before": hook}})
    proc = validate(path)
    assert proc.returncode == 2 and f"{field}: " in proc.stderr and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", ["DISPATCH_JOB_ID", "NOTIFY_SOCKET", "WATCHDOG_USEC"])
def test_env_may_not_set_what_the_daemon_sets_or_never_passes(tmp_path: Path, name: str) -> None:
    """An agent's env naming DISPATCH_* (set per attempt) or the daemon's systemd variables is an error naming it."""
    path = config(tmp_path, {"w": {"command": ["true"], "env": {name: "x"}}})
    proc = validate(path)
    assert proc.returncode == 2 and f"agents.w.env.{name}: " in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1


@pytest.mark.parametrize("key", ["log_file", "metrics_file"])
def test_an_empty_file_path_is_an_error_not_none(tmp_path: Path, key: str) -> None:
    """`log_file: ''` names no file: an error naming the field, not a silent "no log file" (null says that)."""
    cfg = config(tmp_path, {"a": {"command": ["true"]}}, **{key: ""})
    proc = validate(cfg)
    assert proc.returncode == 2
    assert stderr_lines(proc) == [f"dispatcher.yaml: {key}: must not be empty"]


@pytest.mark.parametrize(
    ("top", "agent", "field"),
    [
        ({"log_file": "d\0.log"}, {}, "log_file"),
        ({"metrics_file": "m\0.prom"}, {}, "metrics_file"),
        ({"notify": ["true", "a\0b"]}, {}, "notify[1]"),
        ({}, {"command": ["true", "a\0b"]}, "agents.a.command[1]"),
        ({}, {"prompt": "hi\0"}, "agents.a.prompt"),
        ({}, {"checks": [{"name": "t", "command": ["true", "\0"]}]}, "agents.a.checks[0].command[1]"),
    ],
)
def test_a_nul_in_a_path_argv_or_prompt_is_a_config_error(
    tmp_path: Path, top: dict[str, Any], agent: dict[str, Any], field: str
) -> None:
    """A NUL no path, argument or prompt can hold: one line naming the field, exit 2 (it crashed a job, the
    daemon's stop or the log's opening before)."""
    cfg = tmp_path / "dispatcher.json"
    cfg.write_text(json.dumps({"root": "dispatch", "agents": {"a": {"command": ["true"], **agent}}, **top}))
    proc = validate(cfg)
    assert proc.returncode == 2
    assert stderr_lines(proc) == [f"dispatcher.json: {field}: must not hold a NUL character"], proc.stderr


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("make test", "agents.a.before: must be a list or a mapping, not a string"),
        (5, "agents.a.before: must be a list or a mapping, not an integer"),
        ([], "agents.a.before: must not be empty"),
        (["sleep", 1], "agents.a.before[1]: must be a string, not an integer"),
    ],
)
def test_a_hooks_bad_value_names_the_forms_it_may_take(tmp_path: Path, value: Any, message: str) -> None:
    """`before` (like `after` and `land`) is an argv list or a mapping with `command`: a value of neither type is
    told so, not sent to the mapping form alone; an empty list is told it is empty (section 3: file and field)."""
    proc = validate(config(tmp_path, {"a": {"command": ["/bin/true"], "before": value}}))
    assert proc.returncode == 2
    assert stderr_lines(proc) == [f"dispatcher.yaml: {message}"]
