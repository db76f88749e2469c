"""The agent process, unit by unit: placeholders, environment, agent_result, and `runner.run`.

`render`, `build_env` and `parse_agent_result` are pure; `runner.run` is driven
with real tiny processes (sh, env, python) and real signals, with timeouts and
grace periods shrunk to fractions of a second.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dispatcher import procs, runner
from dispatcher.runner import Abort, Outcome, build_env, parse_agent_result, render

ARGV_VALUES = {
    "job_id": "JOB-1",
    "order": "/r/active/JOB-1/work/order.json",
    "workspace": "/r/active/JOB-1/work",
    "receipt": "/r/active/JOB-1/work/receipt.json",
    "prompt": "Do the task.",
    "prompt_file": "/r/active/JOB-1/work/prompt.md",
}
PROMPT_VALUES = {
    "job_id": "JOB-1",
    "from": "tester",
    "to": "worker",
    "task": "Sort.",
    "items_json": '[{"id": "R1"}]',
    "writes": "out.csv",
    "accept_json": '{"output": "out.csv"}',
    "order": ARGV_VALUES["order"],
    "workspace": ARGV_VALUES["workspace"],
    "receipt": ARGV_VALUES["receipt"],
}
DISPATCH = {
    "DISPATCH_JOB_ID": "JOB-1",
    "DISPATCH_ORDER": ARGV_VALUES["order"],
    "DISPATCH_WORKSPACE": ARGV_VALUES["workspace"],
    "DISPATCH_RECEIPT": ARGV_VALUES["receipt"],
    "DISPATCH_ATTEMPT": "1",
}


# -- render -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ARGV_VALUES))
def test_argv_placeholder_is_replaced(name: str) -> None:
    """Each argv placeholder is replaced inside an element, with text around it kept."""
    assert render(f"--x={{{name}}}!", ARGV_VALUES) == f"--x={ARGV_VALUES[name]}!"


@pytest.mark.parametrize("name", sorted(PROMPT_VALUES))
def test_prompt_placeholder_is_replaced(name: str) -> None:
    """Each prompt-template placeholder is replaced, every time it occurs."""
    assert render(f"a {{{name}}} b {{{name}}}", PROMPT_VALUES, prompt=True) == (
        f"a {PROMPT_VALUES[name]} b {PROMPT_VALUES[name]}"
    )


@pytest.mark.parametrize(
    "text",
    [
        "{}",
        "{0}",
        "{JOB_ID}",
        "{ job_id }",
        "{job_id",
        "job_id}",
        "{job-id}",
        "{jobid}",
        "{job_id_x}",
        "{items_json}",
        "{from}",
        "{task}",
        "${HOME}",
        '{"a": 1}',
        "%(job_id)s",
        "$job_id",
    ],
)
def test_argv_leaves_other_braces_alone(text: str) -> None:
    """In argv, anything but the six exact names passes unchanged, braces included."""
    assert render(text, ARGV_VALUES | PROMPT_VALUES) == text


@pytest.mark.parametrize("text", ["{prompt}", "{prompt_file}", "{Task}", '{"output": "x"}', "{ task}"])
def test_prompt_leaves_other_braces_alone(text: str) -> None:
    """In a prompt template, {prompt}, {prompt_file}, JSON and near-misses pass unchanged."""
    assert render(text, ARGV_VALUES | PROMPT_VALUES, prompt=True) == text


def test_doubled_braces_are_not_an_escape() -> None:
    """`{{job_id}}` is not str.format escaping: the inner placeholder is replaced, outer braces stay."""
    assert render("{{job_id}}", ARGV_VALUES) == "{JOB-1}"
    assert render("{{{job_id}}}", ARGV_VALUES) == "{{JOB-1}}"


def test_values_are_not_substituted_again() -> None:
    """A value that itself holds a placeholder (a task naming {job_id}) is inserted literally."""
    values = PROMPT_VALUES | {"task": "print {job_id} and {workspace}", "from": "{to}"}
    assert render("{task} / {from} / {job_id}", values, prompt=True) == "print {job_id} and {workspace} / {to} / JOB-1"
    argv_values = ARGV_VALUES | {"prompt": "see {prompt_file} for {job_id}"}
    assert render("{prompt}", argv_values) == "see {prompt_file} for {job_id}"


def test_values_with_regex_replacement_syntax_are_literal() -> None:
    r"""Backslashes and \g<0> in a value are text, not regex replacement escapes."""
    values = ARGV_VALUES | {"prompt": r"C:\new \1 \g<0> \\"}
    assert render("{prompt}", values) == r"C:\new \1 \g<0> \\"


# -- build_env ----------------------------------------------------------------------------------

LEAKY = {
    "NOTIFY_SOCKET": "/run/systemd/notify",
    "WATCHDOG_USEC": "1000000",
    "WATCHDOG_PID": "1",
    "DISPATCHER_CONFIG": "/etc/dispatcher.yaml",
    "AWS_SECRET_ACCESS_KEY": "hunter2",
    "LC_ALL": "C",
    "PYTHONPATH": "/x",
    "TERM": "xterm",
}


@pytest.fixture
def daemon_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give this process a daemon-like environment full of things agents must not see."""
    monkeypatch.setenv("PATH", "/usr/local/bin:/usr/bin:/bin")
    monkeypatch.setenv("HOME", "/home/dispatcher")
    monkeypatch.setenv("LANG", "C.UTF-8")
    for key, value in LEAKY.items():
        monkeypatch.setenv(key, value)


@pytest.mark.usefixtures("daemon_env")
def test_env_has_only_path_home_lang_agent_env_and_dispatch() -> None:
    """The agent's environment is PATH, HOME, LANG, its own env and DISPATCH_*, nothing else."""
    got = build_env({"TOKEN": "abc"}, DISPATCH)
    assert got == {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/home/dispatcher",
        "LANG": "C.UTF-8",
        "TOKEN": "abc",
        **DISPATCH,
    }


@pytest.mark.usefixtures("daemon_env")
def test_env_never_passes_notify_socket_or_watchdog() -> None:
    """NOTIFY_SOCKET and WATCHDOG_* of a systemd service never reach an agent."""
    got = build_env({}, DISPATCH)
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(got)


def test_env_leaves_out_what_the_daemon_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without LANG in the daemon's environment the agent gets no LANG (not an empty one)."""
    monkeypatch.delenv("LANG", raising=False)
    assert "LANG" not in build_env({}, DISPATCH)


@pytest.mark.usefixtures("daemon_env")
def test_dispatch_variables_win_over_agent_env() -> None:
    """An agent's env cannot set DISPATCH_* to lie about the job; its own PATH does apply."""
    got = build_env({"DISPATCH_JOB_ID": "OTHER", "PATH": "/opt/agent/bin"}, DISPATCH)
    assert got["DISPATCH_JOB_ID"] == "JOB-1"
    assert got["PATH"] == "/opt/agent/bin"


# -- parse_agent_result -------------------------------------------------------------------------

RESULT = {"type": "result", "is_error": False, "total_cost_usd": 0.01, "session_id": "s-1", "usage": {"in": 3}}


@pytest.mark.parametrize(
    "stdout",
    [
        json.dumps(RESULT),
        "working...\nstill working\n" + json.dumps(RESULT) + "\n",
        "log line\n" + json.dumps(RESULT, indent=2) + "\n\n  \n",
        "log line\r\n" + json.dumps(RESULT) + "\r\n",
        "   " + json.dumps(RESULT) + "   ",
        "\xff\xfe not utf-8 \n" + json.dumps(RESULT),
        '{"half": \n' + json.dumps(RESULT, indent=4),
    ],
    ids=["alone", "after-text", "pretty", "crlf", "indented", "bad-bytes-before", "broken-object-before"],
)
def test_final_object_is_taken_whole(stdout: str) -> None:
    """When the last non-blank text is one JSON object, on one line or many, it is returned whole."""
    assert parse_agent_result(stdout.encode("latin-1" if "\xff" in stdout else "utf-8")) == RESULT


def test_object_with_nested_lines_starting_with_a_brace() -> None:
    """A pretty-printed object whose inner lines start with `{` is still taken whole, not its last part."""
    value = {"result": [{"a": 1}, {"b": {"c": [{"d": 2}]}}], "usage": {"x": 1}}
    assert parse_agent_result(("text\n" + json.dumps(value, indent=2)).encode()) == value


def test_deep_nesting_is_kept() -> None:
    """A moderately deep object (40 levels) is returned as it is."""
    value: dict[str, Any] = {"leaf": True}
    for _ in range(40):
        value = {"x": value}
    assert parse_agent_result(json.dumps(value).encode()) == value


def test_pathologically_deep_nesting_does_not_raise() -> None:
    """An object nested 200 000 levels deep yields no agent_result instead of crashing the attempt."""
    text = '{"x":' * 200_000 + "1" + "}" * 200_000
    assert parse_agent_result(text.encode()) is None


@pytest.mark.parametrize(
    "stdout",
    [
        "",
        "   \n\n",
        "all done\n",
        json.dumps(RESULT) + "\nall done\n",
        json.dumps([RESULT]),
        json.dumps([RESULT], indent=2),
        '"a string"',
        "42",
        "null",
        "result: " + json.dumps(RESULT),
        json.dumps(RESULT) + " " + json.dumps(RESULT),
        '{"a": 1',
        '{"a": 1}}',
        "{not json}",
    ],
    ids=[
        "empty",
        "blank",
        "text",
        "text-after",
        "list",
        "pretty-list",
        "string",
        "number",
        "null",
        "prefixed",
        "two-objects",
        "unclosed",
        "extra-brace",
        "not-json",
    ],
)
def test_no_result_unless_stdout_ends_with_one_object(stdout: str) -> None:
    """Text after the object, a list, a scalar or anything not one whole object gives no agent_result."""
    assert parse_agent_result(stdout.encode()) is None


SUMMARY_KEYS = {"total_cost_usd", "session_id", "num_turns", "is_error", "duration_ms", "usage"}


def big_result(filler: str, n: int) -> dict[str, Any]:
    return {
        "type": "result",
        "result": filler * n,
        "total_cost_usd": 0.5,
        "session_id": "s-9",
        "num_turns": 7,
        "is_error": False,
        "duration_ms": 1234,
        "usage": {"input_tokens": 10, "output_tokens": 20},
        "permission_denials": [],
    }


def test_large_object_keeps_only_the_named_keys() -> None:
    """An object over 64 KiB keeps only total_cost_usd, session_id, num_turns, is_error, duration_ms, usage."""
    value = big_result("x", 70_000)
    got = parse_agent_result(("log\n" + json.dumps(value)).encode())
    assert got == {k: value[k] for k in SUMMARY_KEYS}


def test_large_object_does_not_invent_missing_keys() -> None:
    """Cut down, an object keeps only the named keys it had."""
    got = parse_agent_result(json.dumps({"result": "x" * 70_000, "is_error": True}).encode())
    assert got == {"is_error": True}


def test_object_under_64_kib_is_whole() -> None:
    """An object just under 64 KiB is kept whole, with every key."""
    value = big_result("x", 1)
    value["result"] = "x" * (64 * 1024 - len(json.dumps(value)) - 10)
    assert parse_agent_result(json.dumps(value).encode()) == value


def test_large_pretty_object_with_many_inner_objects_keeps_the_named_keys() -> None:
    """A pretty-printed final object holding thousands of objects (one per line) is still found and cut down."""
    value = {"is_error": False, "session_id": "s-2", "messages": [{"i": i} for i in range(2500)]}
    got = parse_agent_result(("log\n" + json.dumps(value, indent=2)).encode())
    assert got is not None, "the final object was not found"
    assert got == {"is_error": False, "session_id": "s-2"}


def test_size_limit_counts_bytes() -> None:
    """The 64 KiB limit is in bytes: 25 000 three-byte characters (75 kB) are over it."""
    value = big_result("€", 25_000)
    data = json.dumps(value, ensure_ascii=False).encode()
    assert len(data) > 64 * 1024
    got = parse_agent_result(data)
    assert got is not None
    assert sorted(got) == sorted(SUMMARY_KEYS), "an object over 64 KiB of UTF-8 was kept whole"


# -- run: real processes ------------------------------------------------------------------------


@pytest.fixture
def abort() -> Iterator[Abort]:
    a = Abort()
    yield a
    a.close()


@pytest.fixture
def spawn(tmp_path: Path, abort: Abort) -> Any:
    """Return a function that runs argv with runner.run in tmp_path/work, logs in tmp_path/logs."""
    work = tmp_path / "work"
    logs = tmp_path / "logs"
    work.mkdir()
    logs.mkdir()

    def go(argv: list[str], **kw: Any) -> Outcome:
        options: dict[str, Any] = {
            "cwd": work,
            "env": {"PATH": os.environ["PATH"], "LANG": "C.UTF-8"},
            "timeout_s": 20.0,
            "kill_grace_s": 0.5,
            "log_dir": logs,
            "max_log_bytes": 1 << 20,
            "abort": abort,
        }
        options.update(kw)
        return runner.run(argv, **options)

    return go


def log(tmp_path: Path, name: str) -> bytes:
    return (tmp_path / "logs" / name).read_bytes()


def test_run_records_exit_code_and_streams(spawn: Any, tmp_path: Path) -> None:
    """A process that exits 3 gives exit_code 3, not timed out or aborted, with its streams in the logs."""
    out = spawn(["sh", "-c", "echo to-out; echo to-err >&2; exit 3"], log_prefix="1-")
    assert (out.exit_code, out.timed_out, out.aborted) == (3, False, None)
    assert log(tmp_path, "1-stdout.log") == b"to-out\n"
    assert log(tmp_path, "1-stderr.log") == b"to-err\n"
    assert not out.stdout_cut and not out.stderr_cut
    assert 0 <= out.duration_ms < 10_000


def test_run_uses_work_dir_and_devnull_stdin(spawn: Any, tmp_path: Path) -> None:
    """The agent runs in work/ and reads end of file at once from stdin (/dev/null)."""
    out = spawn(["sh", "-c", "pwd; cat; echo end"])
    assert out.exit_code == 0
    assert log(tmp_path, "stdout.log").decode().splitlines() == [str(tmp_path / "work"), "end"]


def test_run_gets_exactly_the_given_environment(spawn: Any, tmp_path: Path) -> None:
    """No variable of the test process (HOME, NOTIFY_SOCKET ...) reaches the agent unless given."""
    env = {"DISPATCH_JOB_ID": "JOB-1", "LANG": "C.UTF-8"}
    code = "import os, json; print(json.dumps(dict(os.environ)))"
    out = spawn([sys.executable, "-I", "-c", code], env=env)
    assert out.exit_code == 0
    assert out.agent_result == env


def test_run_leads_its_own_process_group(spawn: Any, tmp_path: Path) -> None:
    """The agent leads a new process group and session: its pgid is its pid, not the daemon's group."""
    code = "import os, json; print(json.dumps({'pid': os.getpid(), 'pgid': os.getpgid(0), 'sid': os.getsid(0)}))"
    started: list[int] = []
    out = spawn([sys.executable, "-c", code], on_start=started.append)
    got = out.agent_result
    assert got is not None
    assert got["pid"] == out.pid == started[0]
    assert got["pgid"] == got["pid"] == got["sid"]
    assert got["pgid"] != os.getpgid(0)


def test_timeout_ends_a_process_that_ignores_sigterm(spawn: Any) -> None:
    """An agent that ignores SIGTERM is killed at timeout + kill_grace, and its attempt says timed out."""
    t0 = time.monotonic()
    out = spawn(["sh", "-c", 'trap "" TERM; sleep 30 & wait; sleep 30'], timeout_s=0.5, kill_grace_s=0.5)
    elapsed = time.monotonic() - t0
    assert out.timed_out is True and out.aborted is None
    assert out.exit_code == -signal.SIGKILL
    assert 0.9 <= elapsed < 0.5 + 0.5 + 1.5, elapsed


def test_timeout_with_a_polite_process_needs_no_grace(spawn: Any) -> None:
    """An agent that obeys SIGTERM ends at the timeout, without waiting for kill_grace."""
    t0 = time.monotonic()
    out = spawn(["sleep", "30"], timeout_s=0.3, kill_grace_s=10)
    assert out.timed_out and out.exit_code == -signal.SIGTERM
    assert time.monotonic() - t0 < 3


def test_leftover_children_in_the_group_are_ended(spawn: Any, tmp_path: Path) -> None:
    """After the agent exits, a child it left behind in its group (ignoring SIGTERM) is killed."""
    t0 = time.monotonic()
    out = spawn(["sh", "-c", '(trap "" TERM; exec sleep 30) >/dev/null 2>&1 & echo $!; exit 0'], kill_grace_s=0.5)
    assert out.exit_code == 0 and not out.timed_out
    child = int(log(tmp_path, "stdout.log").split()[0])
    assert not procs.is_alive(child)
    assert time.monotonic() - t0 < 5


def test_abort_ends_the_agent_at_once(spawn: Any, abort: Abort) -> None:
    """abort.trigger wakes the attempt: the group is ended and the outcome names the reason."""

    def cancel_soon(pid: int) -> None:
        threading.Timer(0.2, abort.trigger, ("cancelled",)).start()

    t0 = time.monotonic()
    out = spawn(["sleep", "30"], on_start=cancel_soon)
    assert out.aborted == "cancelled" and out.timed_out is False
    assert out.exit_code == -signal.SIGTERM
    assert time.monotonic() - t0 < 5


def test_abort_before_start_ends_the_agent_promptly(spawn: Any, abort: Abort) -> None:
    """An abort already triggered (a stop during the spawn) ends the agent as soon as it runs."""
    abort.trigger("stopped")
    abort.trigger("cancelled")
    t0 = time.monotonic()
    out = spawn(["sleep", "30"])
    assert out.aborted == "stopped"
    assert time.monotonic() - t0 < 5


def test_stdout_over_max_log_bytes_is_cut_with_a_line_saying_so(spawn: Any, tmp_path: Path) -> None:
    """A stream over max_log_bytes keeps its first bytes and ends with a line naming the cut."""
    code = "import sys; sys.stdout.write('a' * 5000); sys.stderr.write('b' * 999)"
    out = spawn([sys.executable, "-c", code], max_log_bytes=1000)
    assert out.stdout_cut and not out.stderr_cut
    assert log(tmp_path, "stdout.log") == b"a" * 1000 + b"\n[dispatcher: stdout cut at 1000 bytes (max_log_bytes)]\n"
    assert log(tmp_path, "stderr.log") == b"b" * 999


def test_stderr_cut_and_exact_size_not_cut(spawn: Any, tmp_path: Path) -> None:
    """stderr is capped the same way; a stream of exactly max_log_bytes is not cut."""
    code = "import sys; sys.stdout.write('a' * 1000); sys.stderr.write('b' * 3000)"
    out = spawn([sys.executable, "-c", code], max_log_bytes=1000)
    assert not out.stdout_cut and out.stderr_cut
    assert log(tmp_path, "stdout.log") == b"a" * 1000
    assert log(tmp_path, "stderr.log").endswith(b"\n[dispatcher: stderr cut at 1000 bytes (max_log_bytes)]\n")


def test_agent_result_survives_a_cut_log(spawn: Any) -> None:
    """The final JSON object is found even when stdout.log was cut long before it."""
    code = "import sys, json; sys.stdout.write('x' * 200000 + '\\n'); print(json.dumps({'is_error': False}))"
    out = spawn([sys.executable, "-c", code], max_log_bytes=100)
    assert out.stdout_cut
    assert out.agent_result == {"is_error": False}


def test_program_that_cannot_start_raises_oserror(spawn: Any, tmp_path: Path) -> None:
    """A missing program raises OSError (the caller's config error), not a failed attempt."""
    with pytest.raises(OSError):
        spawn([str(tmp_path / "no-such-agent")])
