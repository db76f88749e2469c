"""The agent process, unit by unit: placeholders, environment, and `AgentProcess` on an event loop.

`render` and `build_env` are pure; `AgentProcess` is driven on a real asyncio loop
with real tiny processes (sh, env, python) and real signals, with timeouts and
grace periods shrunk to fractions of a second. The agent's final JSON is tested
in test_agent_result.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dispatcher import procs
from dispatcher.job import attempt
from dispatcher.job.agent_result import parse_agent_result
from dispatcher.job.runner import AgentExit, AgentProcess, agent_environ, build_env, dispatch_env, encode_env
from dispatcher.spec.jobspec import JobSpec, render
from dispatcher.spec.settings import Agent

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


@pytest.mark.usefixtures("daemon_env")
@pytest.mark.parametrize(
    ("agent_env", "pass_env", "workspace"),
    [
        ({}, (), None),
        ({"DISPATCH_JOB_ID": "OTHER", "PATH": "/opt/agent/bin", "T\u00e9": "\udcff"}, ("TERM", "NOPE", "HOME"), None),
        ({"TOKEN": "abc"}, (), Path("/r/ws/JOB-1")),
    ],
)
def test_the_bytes_popen_gets_are_build_env_fsencoded(
    agent_env: dict[str, str], pass_env: tuple[str, ...], workspace: Path | None
) -> None:
    """An attempt's environment made as bytes is what build_env makes, in its order, each name and value fsencoded."""
    work = "/r/active/JOB-1/w\u00f6rk"
    want = build_env(agent_env, dispatch_env("JOB-1", work, 3, workspace), pass_env)
    got = agent_environ(agent_env, dispatch_env("JOB-1", work, 3, workspace), pass_env)
    assert list(got.items()) == [(os.fsencode(k), os.fsencode(v)) for k, v in want.items()]
    assert got == encode_env(want)


@dataclass
class Run:
    """One finished agent process: its exit, and its result parsed like the daemon does."""

    out: AgentExit
    agent_result: Any

    def __getattr__(self, name: str) -> Any:
        return getattr(self.out, name)


@pytest.fixture
def spawn(tmp_path: Path) -> Any:
    """Return a function that runs argv as an AgentProcess in tmp_path/work, logs in tmp_path/logs."""
    work = tmp_path / "work"
    logs = tmp_path / "logs"
    work.mkdir()
    logs.mkdir()

    def go(
        argv: list[str],
        *,
        on_start: Callable[[int], None] | None = None,
        abort_after: float | None = None,
        abort_before: list[str] | None = None,
        **kw: Any,
    ) -> Run:
        options: dict[str, Any] = {
            "cwd": work,
            "env": {"PATH": os.environ["PATH"], "LANG": "C.UTF-8"},
            "timeout_s": 20.0,
            "kill_grace_s": 0.5,
            "log_dir": logs,
            "max_log_bytes": 1 << 20,
        }
        options.update(kw)
        prefix = options.get("log_prefix", "")
        for name in ("stdout.log", "stderr.log"):
            (logs / f"{prefix}{name}").touch()

        async def main() -> AgentExit:
            proc = AgentProcess(argv, **options)
            proc.start()
            for reason in abort_before or []:
                proc.abort(reason)
            if on_start is not None:
                on_start(proc.pid)
            if abort_after is not None:
                asyncio.get_running_loop().call_later(abort_after, proc.abort, "cancelled")
            return await proc.wait()

        out = asyncio.run(main())
        return Run(out, parse_agent_result(out.stdout_tail))

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


def test_group_gone_reaps_our_zombie_and_sees_a_live_group() -> None:
    """procs.group_gone: False while a process of the group runs; True once it exited, our zombie reaped."""
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert not procs.group_gone(proc.pid)
        proc.kill()
        deadline = time.monotonic() + 5
        while procs.is_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert procs.group_gone(proc.pid)
        with pytest.raises(ChildProcessError):  # reaped by group_gone
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG)
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_left_the_group_holding_a_pipe_delays_the_end_by_the_drain_only(
    spawn: Any, tmp_path: Path
) -> None:
    """An agent's child in a session of its own keeps stdout open: the output before the exit is kept,
    and the agent ends a second after its exit (the drain), not when that child does."""
    t0 = time.monotonic()
    out = spawn(["sh", "-c", "setsid sleep 5 & sleep 0.3; echo before-exit; exit 0"])
    assert out.exit_code == 0 and not out.timed_out
    assert log(tmp_path, "stdout.log") == b"before-exit\n"
    assert 1.2 < time.monotonic() - t0 < 4


def test_abort_ends_the_agent_at_once(spawn: Any) -> None:
    """An abort wakes the attempt: the group is ended and the outcome names the reason."""
    t0 = time.monotonic()
    out = spawn(["sleep", "30"], abort_after=0.2)
    assert out.aborted == "cancelled" and out.timed_out is False
    assert out.exit_code == -signal.SIGTERM
    assert time.monotonic() - t0 < 5


def test_first_abort_reason_wins(spawn: Any) -> None:
    """Two aborts (a stop, then a cancel) end the agent once, and the first reason is recorded."""
    t0 = time.monotonic()
    out = spawn(["sleep", "30"], abort_before=["stopped", "cancelled"])
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


def test_many_agents_share_one_thread(tmp_path: Path) -> None:
    """Two hundred agents run at once on one event loop: the process gains no thread per agent."""
    logs = tmp_path / "logs"
    logs.mkdir()
    counts: list[int] = []
    before = len(os.listdir(f"/proc/{os.getpid()}/task"))  # other tests may have left threads behind

    async def main() -> list[AgentExit]:
        procs_ = []
        for i in range(200):
            (logs / f"{i}-stdout.log").touch()
            (logs / f"{i}-stderr.log").touch()
            p = AgentProcess(
                ["sh", "-c", "sleep 1; echo done"],
                cwd=tmp_path,
                env={"PATH": os.environ["PATH"]},
                timeout_s=30,
                kill_grace_s=1,
                log_dir=logs,
                max_log_bytes=1000,
                log_prefix=f"{i}-",
            )
            p.start()
            procs_.append(p)
        await asyncio.sleep(0.5)
        counts.append(len(os.listdir(f"/proc/{os.getpid()}/task")))
        return [await p.wait() for p in procs_]

    outs = asyncio.run(main())
    assert [o.exit_code for o in outs] == [0] * 200
    assert all((logs / f"{i}-stdout.log").read_bytes() == b"done\n" for i in range(200))
    assert counts[0] - before < 3, (before, counts[0])


def test_a_reader_that_fails_is_reported_and_the_others_still_run() -> None:
    """Agents' readers share one epoll: one that raises goes to the loop's handler, the next one still runs."""
    import contextvars

    from dispatcher.job.readers import readers

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="none")
    heard: list[str] = []
    reported: list[BaseException] = []

    def failing(fd: int) -> None:
        os.read(fd, 10)
        raise RuntimeError("boom")

    def reading(fd: int) -> None:
        heard.append(f"{os.read(fd, 10).decode()} in {var.get()}")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx["exception"]))
        (r1, w1), (r2, w2) = os.pipe(), os.pipe()
        watch = readers()
        watch.add(r1, failing, r1)
        var.set("its context")
        watch.add(r2, reading, r2)
        os.write(w1, b"x")
        os.write(w2, b"y")
        for _ in range(100):
            await asyncio.sleep(0.01)
            if heard and reported:
                break
        for fd in (r1, r2):
            watch.remove(fd)
        for fd in (r1, w1, r2, w2):
            os.close(fd)

    asyncio.run(main())
    assert heard == ["y in its context"]
    assert [str(e) for e in reported] == ["boom"]


# -- notifications at a stop ------------------------------------------------------------------
def _notifications(tmp_path: Path) -> tuple[Any, Path]:
    """Notifications whose command marks its start in tmp/started-<event> and then hangs."""
    from dispatcher.core.notify import Notifications
    from dispatcher.spec.config import build_config

    marks = tmp_path / "marks"
    marks.mkdir()
    hang = f'import pathlib, sys, time; pathlib.Path("{marks}", sys.argv[1]).touch(); time.sleep(60)'
    body = {
        "kill_grace": 1,
        "notify": [sys.executable, "-c", hang, "{event}"],
        "agents": {"worker": {"command": ["true"], "writes": []}},
    }
    config = build_config(body, None, root=tmp_path / "root")
    return Notifications(lambda: config, tmp_path), marks


def test_a_notification_not_yet_started_when_the_stop_deadline_comes_never_starts(tmp_path: Path) -> None:
    """Fired, then the stop's deadline at once: its command is not started after the daemon gave up on it."""
    notes, marks = _notifications(tmp_path)

    async def body() -> float:
        notes.fire("job.failed", "N1", "worker", "exit 1", None)  # queued as a task, not started yet
        began = time.monotonic()
        await notes.close(until=time.monotonic())  # the stop's deadline has come
        return time.monotonic() - began

    took = asyncio.run(body())
    time.sleep(0.5)  # a command started late would mark itself by now
    assert list(marks.iterdir()) == [], "a notify command started after the stop gave up on it"
    assert took < 3, took


def test_an_event_fired_while_notifications_close_is_dropped(tmp_path: Path) -> None:
    """An event of the stop's last moments starts no command: it would outlive the daemon."""
    notes, marks = _notifications(tmp_path)

    async def body() -> None:
        closing = asyncio.get_running_loop().create_task(notes.close(until=time.monotonic() + 0.3))
        await asyncio.sleep(0)  # close() has begun
        notes.fire("job.done", "N2", "worker", None, None)
        await closing

    asyncio.run(body())
    time.sleep(0.5)
    assert list(marks.iterdir()) == []


# -- {parents}: a join's placeholder -------------------------------------------------------------


def _spec(after: list[str] | None, prompt: str | None = None) -> JobSpec:
    body: dict[str, Any] = {"job_id": "J-1", "from": "me", "to": "worker", "task": "t", "items": [{"id": "A"}]}
    if after is not None:
        body["after"] = after
    return JobSpec(
        job_id="J-1",
        source="J-1.json",
        received=1796252481.25,
        parent=None,
        hops=0,
        agent=Agent("worker", ("x",), prompt=prompt),
        timeout_s=60.0,
        max_attempts=1,
        budget=1,
        writes=(),
        given={},
        order=body,
    )


def test_parents_is_replaced_for_a_join_and_passes_unchanged_elsewhere() -> None:
    """`{parents}` is the path of a joined job's parents.json (section 16); in a job without `after` it is no
    placeholder, and passes unchanged as other braces do (section 3), in argv and in the prompt alike."""
    command = ("agent", "--parents={parents}", "{job_id}")
    joined = attempt.argv(_spec(["P-1"], prompt="read {parents}"), "/r/active/J-1/work", command)
    assert joined == ["agent", "--parents=/r/active/J-1/work/parents.json", "J-1"]
    plain = attempt.argv(_spec(None, prompt="read {parents}"), "/r/active/J-1/work", command)
    assert plain == ["agent", "--parents={parents}", "J-1"]
    joined_prompt = attempt.values(_spec(["P-1"], prompt="read {parents}"), "/r/active/J-1/work")["prompt"]
    assert joined_prompt == "read /r/active/J-1/work/parents.json"
    assert attempt.values(_spec(None, prompt="read {parents}"), "/r/active/J-1/work")["prompt"] == "read {parents}"
