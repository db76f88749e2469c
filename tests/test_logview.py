"""Log lines for the journal and for people (contract sections 7 and 8).

Journal priorities are checked on a real daemon whose stdout is the file named
by `$JOURNAL_STREAM`; the console format on a real daemon whose stdout is a
terminal (a pty); `dispatcher logs` as a real process reading stdin, a file and
a file that logrotate renames or truncates under it.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from conftest import DEADLINE, Env, cli_env, order

from dispatcher import logs
from dispatcher.cli.printing import journal_unit
from dispatcher.logview import format_line

PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}


def journal_env(stream: Path) -> dict[str, str]:
    """Return the CLI environment with $JOURNAL_STREAM naming this file, as systemd names the service's stdout."""
    st = os.stat(stream)
    return cli_env() | {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}


def run_once(env: Env, out: Path, extra: dict[str, str]) -> int:
    """Run `dispatcher run --once` with stdout and stderr in out; return its exit code."""
    with out.open("ab") as fh:
        return subprocess.run(
            [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "run", "--once"],
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=env.tmp,
            env=extra,
            timeout=120,
        ).returncode


def logs_cmd(cwd: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `dispatcher logs ARGS` in cwd, which gets a config (every command but init needs one)."""
    config = cwd / "config" / "dispatcher.yaml"
    if not config.exists():
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text("root: ../dispatch\nagents: {}\n")
    return subprocess.run(
        [sys.executable, "-m", "dispatcher", "logs", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=cli_env(),
        timeout=60,
    )


def entry(event: str, level: str = "info", **extra: Any) -> dict[str, Any]:
    return {"timestamp": "2026-11-29T08:00:00.123456Z", "level": level, "event": event, **extra}


# -- the journal ---------------------------------------------------------------------------------


def test_lines_on_the_journal_start_with_their_syslog_priority(env: Env) -> None:
    """On the journal each line is `<N>` + one JSON object, N from its level; log_file stays plain JSON."""
    log_file = env.tmp / "d.log"
    env.configure(agents={"worker": env.agent(), "broken": env.agent("--exit", "3")}, log_file=str(log_file))
    env.drop(order("J-OK"))
    env.drop(order("J-BAD", to="broken"))
    env.drop(b"job_id: [", "torn.yaml")
    out = env.tmp / "journal.out"
    out.touch()
    assert run_once(env, out, journal_env(out)) == 1
    lines = out.read_text().splitlines()
    assert len(lines) > 10
    levels = set()
    for line in lines:
        m = re.fullmatch(r"<([0-7])>(\{.*\})", line)
        assert m, f"not <N>JSON: {line!r}"
        event = json.loads(m.group(2))
        assert int(m.group(1)) == PRIORITY[event["level"]], line
        levels.add(event["level"])
    assert {"info", "warning"} <= levels, "a failed job is a warning line"
    assert [json.loads(line) for line in log_file.read_text().splitlines()] == [
        json.loads(line[3:]) for line in lines
    ], "log_file gets the same JSON without the prefix"


def test_a_config_the_daemon_refuses_at_start_is_an_error_line_on_the_journal(env: Env) -> None:
    """`run` that stops at once on a bad config (exit 2, one line): on the journal that line is `<3>`, so that
    `journalctl -p err` finds why the service did not start; off the journal it stays plain."""
    env.config_path.write_text(env.config_path.read_text() + "bogus: 1\n")
    out = env.tmp / "journal.out"
    out.touch()
    assert run_once(env, out, journal_env(out)) == 2
    assert out.read_text() == f"<3>{env.config_path}: bogus: unknown key\n"
    plain = env.tmp / "plain.out"
    assert run_once(env, plain, journal_env(out)) == 2
    assert plain.read_text() == f"{env.config_path}: bogus: unknown key\n"


def test_a_daemon_crash_is_written_as_error_lines_on_the_journal(env: Env) -> None:
    """A crash of `run` (an error no code of the daemon expects, made here by a sitecustomize that breaks its
    serve): on the journal each line of its traceback is `<3>`, so that `journalctl -p err` shows it (it came as
    plain stderr lines, which the journal files as info); exit 1."""
    inject = env.tmp / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import dispatcher.core.daemon as d\n"
        "def boom(self):\n"
        "    raise RuntimeError('injected crash')\n"
        "d.Daemon.serve = boom\n"
    )
    out = env.tmp / "journal.out"
    out.touch()
    extra = journal_env(out)
    extra["PYTHONPATH"] = f"{inject}{os.pathsep}{extra['PYTHONPATH']}"
    assert run_once(env, out, extra) == 1
    lines = out.read_text().splitlines()
    crash = [line for line in lines if not line.startswith("<6>{")]  # the daemon's own JSON lines before it
    assert crash[0] == "<3>Traceback (most recent call last):", lines
    assert crash[-1] == "<3>RuntimeError: injected crash", lines
    assert all(line.startswith("<3>") for line in crash), crash


def test_journal_stream_of_another_file_adds_no_prefix(env: Env) -> None:
    """$JOURNAL_STREAM inherited with stdout sent elsewhere is not the journal: lines stay plain JSON."""
    other = env.tmp / "elsewhere"
    other.touch()
    out = env.tmp / "plain.out"
    env.drop(order("J-PLAIN"))
    assert run_once(env, out, journal_env(other)) == 0
    for line in out.read_text().splitlines():
        assert isinstance(json.loads(line), dict), line


def test_run_once_failing_with_stderr_on_its_stdout_writes_only_json_lines(env: Env) -> None:
    """`run --once 2>&1` that exits 1: its one-line note on stderr (section 7) stays out of the JSON stream, whose
    last line (daemon.stopped) carries the counts; every line is one JSON object."""
    env.configure(agents={"worker": env.agent(), "broken": env.agent("--exit", "3")})
    env.drop(order("M-BAD", to="broken"))
    out = env.tmp / "merged.out"
    assert run_once(env, out, cli_env()) == 1
    lines = out.read_text().splitlines()
    assert all(isinstance(json.loads(line), dict) for line in lines), lines
    assert json.loads(lines[-1])["event"] == "daemon.stopped", lines[-1]


@pytest.fixture
def journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Configure dispatcher.logs in-process with stdout as a journal file; restore logging after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    path = tmp_path / "stdout"
    with path.open("w") as fh:
        monkeypatch.setattr(logs.SINK, "console", fh)
        monkeypatch.setenv("JOURNAL_STREAM", "{0.st_dev}:{0.st_ino}".format(os.fstat(fh.fileno())))
        logs.configure(level=logging.DEBUG)
        yield path
    logs.SINK.open_file(None)
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_each_level_gets_its_priority(journal: Path) -> None:
    """debug <7>, info <6>, warning <4>, error <3>, critical <2>, a logged exception <3>, a stdlib warning <4>."""
    log = logs.get()
    log.debug("a.debug")
    log.info("a.info")
    log.warning("a.warning")
    log.error("a.error")
    log.critical("a.critical")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("a.exception")
    logging.getLogger("filelock").warning("stale lock")
    prefixes = [line[:3] for line in journal.read_text().splitlines()]
    assert prefixes == ["<7>", "<6>", "<4>", "<3>", "<2>", "<3>", "<4>"]


# -- one console format --------------------------------------------------------------------------


def test_console_format_shows_values_without_python_notation() -> None:
    """None is -, a list is `a, b`, 3.0 is 3, booleans are true/false, a mapping becomes dotted keys."""
    line = format_line(
        entry(
            "job.done",
            job_id="J-1",
            agent="worker",
            children=["J-1.a", "J-1.b"],
            parent=None,
            duration_s=3.0,
            cost_usd=0.25,
            forced=False,
            usage={"input_tokens": 12, "output_tokens": 3},
            empty=[],
        )
    )
    assert line == (
        "2026-11-29T08:00:00.123Z info    job.done           J-1 (worker) children=J-1.a, J-1.b parent=- "
        "duration_s=3 cost_usd=0.25 forced=false usage.input_tokens=12 usage.output_tokens=3 empty=-"
    )


def test_console_format_puts_a_logged_exception_below_its_line() -> None:
    """An exception logged as structlog's dicts prints as a traceback under the event, one frame a line."""
    exc = [{"exc_type": "RuntimeError", "exc_value": "no", "frames": [{"filename": "a.py", "lineno": 3, "name": "f"}]}]
    lines = format_line(entry("job.crashed", "error", job_id="J-2", exception=exc)).splitlines()
    assert lines[0].endswith("job.crashed        J-2")
    assert lines[1:] == ["  Traceback (most recent call last):", '    File "a.py", line 3, in f', "  RuntimeError: no"]


def read_pty(fd: int, proc: subprocess.Popen[bytes]) -> str:
    """Read a pty's output until the process has exited and nothing is left."""
    data = b""
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the other side is closed
                break
            if not chunk:
                break
            data += chunk
        elif proc.poll() is not None:
            break
    return data.decode().replace("\r\n", "\n")


def test_run_on_a_terminal_prints_what_logs_prints(env: Env) -> None:
    """`run` on a terminal and `dispatcher logs` of its log_file print the very same lines."""
    log_file = env.tmp / "d.log"
    env.configure(agents={"worker": env.agent(), "broken": env.agent("--exit", "3")}, log_file=str(log_file))
    env.drop(order("TTY-OK"))
    env.drop(order("TTY-BAD", to="broken"))
    (env.root / "inbox" / "a\u202eb.txt").write_text("x")  # a name that would read backwards: refused, escaped
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "run", "--once"],
            stdout=slave,
            stderr=subprocess.DEVNULL,
            cwd=env.tmp,
            env=cli_env(),
        )
        os.close(slave)
        terminal = read_pty(master, proc)
        assert proc.wait(DEADLINE) == 1
    finally:
        os.close(master)
    shown = env.cli("logs")
    assert shown.returncode == 0, shown.stderr
    assert terminal.splitlines() == shown.stdout.splitlines()
    assert any("job.failed" in line and "TTY-BAD (broken)" in line for line in terminal.splitlines())
    assert not re.search(r"\bNone\b|\['|\b\d+\.0\b", terminal), terminal
    assert "\u202e" not in terminal and "file=a\\u202eb.txt" in terminal, terminal  # as `logs` shows it too


# -- dispatcher logs -------------------------------------------------------------------------------


def test_logs_reads_stdin_and_takes_off_the_priority_prefix(tmp_path: Path) -> None:
    """`dispatcher logs -` reads `<N>`-prefixed or plain JSON lines from stdin, readably."""
    lines = [
        "<6>" + json.dumps(entry("daemon.started", pid=7)),
        json.dumps(entry("job.claimed", job_id="J-1", agent="worker")),
        "<4>" + json.dumps(entry("job.failed", "warning", job_id="J-1", agent="worker", reason="exit_ok: exit 3")),
    ]
    proc = logs_cmd(tmp_path, "-", stdin="\n".join(lines) + "\n")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert len(out) == 3 and not any("<" in line or "{" in line for line in out), out
    assert out[2] == format_line(json.loads(lines[2][3:]))


def test_logs_json_prints_the_matching_lines_unchanged(tmp_path: Path) -> None:
    """`logs --json --job ID -` prints exactly that job's JSON lines, byte for byte, without the prefix."""
    mine = [json.dumps(entry("job.claimed", job_id="J-1", agent="w")), json.dumps(entry("job.done", job_id="J-1"))]
    other = json.dumps(entry("job.claimed", job_id="J-2"))
    text = f"<6>{mine[0]}\n{other}\nnot json\n<6>{mine[1]}\n"
    proc = logs_cmd(tmp_path, "--json", "--job", "J-1", "-", stdin=text)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == mine[0] + "\n" + mine[1] + "\n"


def test_logs_shows_text_lines_from_the_journal_and_skips_torn_json(tmp_path: Path) -> None:
    """A plain text line (a traceback on the service's stream) is shown; a JSON line cut short is skipped."""
    text = json.dumps(entry("a.b")) + '\n{"timestamp": "2026-\nTraceback (most recent call last):\n'
    proc = logs_cmd(tmp_path, "-", stdin=text)
    assert proc.stdout.splitlines()[1:] == ["Traceback (most recent call last):"]


def test_logs_job_that_is_not_a_job_id_exits_2(tmp_path: Path) -> None:
    """`logs --job` with what cannot be a job id is bad usage: exit 2 and one line, not an empty listing."""
    text = json.dumps(entry("job.claimed", job_id="J-1", agent="w")) + "\n"
    proc = logs_cmd(tmp_path, "--job", "../J-1", "-", stdin=text)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "--job: ../J-1: not a job id (letters, digits, '.', '_', '-'; at most 128)"


def test_logs_of_a_missing_file_exits_2(tmp_path: Path) -> None:
    """`dispatcher logs FILE` with no such file exits 2 with one line naming it."""
    proc = logs_cmd(tmp_path, "nope.log")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "nope.log: no such log file"


@pytest.mark.parametrize("follow", [False, True], ids=["plain", "follow"])
def test_logs_reads_a_fifo_or_dev_stdin_as_a_file(tmp_path: Path, follow: bool) -> None:
    """`dispatcher logs FILE` reads a FILE that is a pipe as it reads a log file: a FIFO (as `<(...)` gives) and
    /dev/stdin from a pipe, with or without -f (a pipe ends when its writer closes it)."""
    lines = [json.dumps(entry("job.claimed", job_id=f"J-{i}", agent="w")) for i in range(3)]
    text = "\n".join(lines) + "\n"
    flag = ["-f"] if follow else []
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)

    def feed() -> None:
        with fifo.open("w") as w:
            w.write(text)

    writer = threading.Thread(target=feed)
    writer.start()
    proc = logs_cmd(tmp_path, *flag, "--json", str(fifo))
    writer.join(timeout=60)
    assert proc.returncode == 0 and proc.stdout.splitlines() == lines, proc.stderr
    proc = logs_cmd(tmp_path, *flag, "--json", "/dev/stdin", stdin=text)
    assert proc.returncode == 0 and proc.stdout.splitlines() == lines, proc.stderr
    proc = logs_cmd(tmp_path, *flag, str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.strip() == f"{tmp_path}: a folder, not a log file"


def test_logs_without_log_file_names_the_journal_command(env: Env) -> None:
    """With `log_file: null`, `logs` exits 2 with one line giving the journalctl command to pipe in; the reading half
    of it names the config when one was given (`logs -` needs a config too), and works as printed."""
    proc = env.cli("logs")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    hint = f"journalctl -o cat -u dispatcher | dispatcher --config {env.config_path} logs -"
    assert proc.stderr.strip().endswith(hint), proc.stderr
    line = '{"timestamp": "2026-12-01T10:00:00.000Z", "level": "info", "event": "job.done", "job_id": "J-1"}\n'
    reader = hint.partition(" | ")[2].split()
    assert reader[:3] == ["dispatcher", "--config", str(env.config_path)]
    shown = subprocess.run(
        [sys.executable, "-m", "dispatcher", *reader[1:]], input=line, capture_output=True, text=True, timeout=60,
        cwd=env.tmp.parent, env=cli_env(),
    )  # fmt: skip
    assert shown.returncode == 0 and "job.done" in shown.stdout and "J-1" in shown.stdout, shown.stderr
    found = subprocess.run(  # found without --config (./config/dispatcher.yaml): the hint needs none either
        [sys.executable, "-m", "dispatcher", "logs"], capture_output=True, text=True, timeout=60,
        cwd=_with_local_config(env), env=cli_env(),
    )  # fmt: skip
    assert found.returncode == 2 and found.stderr.strip().endswith("-u dispatcher | dispatcher logs -"), found.stderr


def _with_local_config(env: Env) -> Path:
    """Return a folder holding config/dispatcher.yaml: the env's config, found there without --config."""
    here = env.tmp / "here"
    (here / "config").mkdir(parents=True, exist_ok=True)
    (here / "config" / "dispatcher.yaml").write_text(env.config_path.read_text())
    return here


def test_the_journal_unit_follows_the_config_name() -> None:
    """/etc/dispatcher/dispatcher.yaml is unit dispatcher; /etc/dispatcher/NAME.yaml is dispatcher@NAME."""
    assert journal_unit(Path("/etc/dispatcher/dispatcher.yaml")) == "dispatcher"
    assert journal_unit(Path("/etc/dispatcher/billing.yaml")) == "dispatcher@billing"
    assert journal_unit(Path("/srv/x/config/dispatcher.yaml")) == "dispatcher"


class Follower:
    """A real `dispatcher logs -f FILE` process, read line by line with a deadline."""

    def __init__(self, path: Path) -> None:
        config = path.parent / "follower.yaml"  # every command but init needs a config
        config.write_text("root: ./dispatch\nagents: {}\n")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dispatcher", "--config", str(config), "logs", "-f", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=path.parent,
            env=cli_env(),
        )
        self.buf = b""

    def line(self, timeout: float = 20) -> str:
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            assert left > 0, f"no line within {timeout} s (got {self.buf!r})"
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                assert chunk, "logs -f ended"
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(DEADLINE)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def append(path: Path, event: str, mode: str = "a") -> None:
    with path.open(mode) as f:
        f.write(json.dumps(entry(event)) + "\n")


def test_logs_follow_goes_on_across_logrotate_rename(tmp_path: Path) -> None:
    """`logs -f` reads what the writer still appends to the renamed file, then the new file at the same path."""
    path = tmp_path / "d.log"
    append(path, "one.before")
    f = Follower(path)
    try:
        assert "one.before" in f.line()
        path.rename(tmp_path / "d.log.1")
        path.touch()  # logrotate's `create`: the new file exists before the daemon's SIGHUP
        append(tmp_path / "d.log.1", "two.late.in.old")  # the daemon has not reopened yet
        time.sleep(0.5)
        append(path, "three.in.new")
        assert "two.late.in.old" in f.line()
        assert "three.in.new" in f.line()
        append(path, "four.in.new")
        assert "four.in.new" in f.line()
    finally:
        f.close()


def test_logs_follow_waits_while_the_file_is_missing(tmp_path: Path) -> None:
    """`logs -f` of a log_file renamed away (no `create`) picks up the file the writer makes later."""
    path = tmp_path / "d.log"
    append(path, "one.before")
    f = Follower(path)
    try:
        assert "one.before" in f.line()
        path.rename(tmp_path / "d.log.1")
        time.sleep(0.6)
        append(path, "two.in.new", "w")
        assert "two.in.new" in f.line()
    finally:
        f.close()


def test_logs_follow_starts_over_after_copytruncate(tmp_path: Path) -> None:
    """`logs -f` sees a file truncated in place (copytruncate) and prints what is written after."""
    path = tmp_path / "d.log"
    for n in range(5):
        append(path, f"old.{n}")
    f = Follower(path)
    try:
        for n in range(5):
            assert f"old.{n}" in f.line()
        with path.open("r+") as fh:
            fh.truncate(0)
        time.sleep(0.5)
        append(path, "after.truncate")
        assert "after.truncate" in f.line()
    finally:
        f.close()


def test_logs_follow_loses_nothing_when_a_truncated_file_grows_back_past_where_it_was_read(tmp_path: Path) -> None:
    """copytruncate, then more bytes written at once than were read before, all between two looks: every new
    line is printed, the first included (the file's first line is not the one read from its top any more)."""
    path = tmp_path / "d.log"
    append(path, "e1")
    f = Follower(path)
    try:
        assert "e1" in f.line()
        time.sleep(0.5)  # at the end of the file, looking every 0.2 s
        with path.open("r+b") as fh:  # truncated and written again in one go, between two looks
            fh.truncate(0)
            fh.write("".join(json.dumps(entry(e)) + "\n" for e in ("e2", "e3")).encode())
        assert "e2" in f.line()
        assert "e3" in f.line()
    finally:
        f.close()


def test_a_log_file_that_cannot_be_opened_stops_run_with_one_line(env: Env) -> None:
    """`run` with an unusable log_file exits 2 with one line naming log_file, no traceback, and runs no agent."""
    blocker = env.tmp / "not-a-folder"
    blocker.write_text("")
    env.configure(log_file=str(blocker / "d.log"))
    env.drop(order("NOLOG-1"))
    proc = env.cli("run", "--once")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "log_file" in lines[0] and str(blocker / "d.log") in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert env.starts() == []


@pytest.mark.parametrize("where", ["/proc/dispatcher-no-such-folder/d.log", "/proc/d.log"])
def test_validate_refuses_a_log_file_that_run_could_not_create(env: Env, where: str) -> None:
    """A log_file in a folder no file can be made in, though access() says it may be written (root on /proc):
    `validate` exits 2 with one line naming log_file, as `run` does (README: validate refuses a log_file that
    cannot be opened), and leaves nothing behind."""
    env.configure(log_file=where)
    checked = env.cli("validate")
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert checked.stderr.count("\n") == 1 and "log_file" in checked.stderr and where in checked.stderr
    ran = env.cli("run", "--once")
    assert ran.returncode == 2 and "log_file" in ran.stderr


def test_console_mode_in_process_is_format_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In console mode the line printed is format_line of the very JSON written to log_file."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    console = io.StringIO()
    monkeypatch.setattr(logs.SINK, "console", console)
    path = tmp_path / "app.log"
    try:
        logs.configure(log_file=path, console=True)
        logs.get().info("job.done", job_id="J-4", agent="worker", children=["J-5"], cost_usd=None, attempts=1)
    finally:
        logs.SINK.open_file(None)
        structlog.reset_defaults()
        root.handlers[:] = handlers
        root.setLevel(level)
    assert console.getvalue() == format_line(json.loads(path.read_text())) + "\n"
    assert "children=J-5 cost_usd=- attempts=1" in console.getvalue()


def test_run_once_failing_with_stderr_closed_keeps_stdout_json(env: Env) -> None:
    """`run --once 2>&-` that exits 1: with no stderr the one-line note is dropped, never written to stdout,
    whose every line stays one JSON object."""
    env.configure(agents={"worker": env.agent(), "broken": env.agent("--exit", "3")})
    env.drop(order("C-BAD", to="broken"))
    out = env.tmp / "closed.out"
    with out.open("wb") as fh:
        proc = subprocess.run(
            ["sh", "-c", 'exec "$@" 2>&-', "sh", sys.executable, "-m", "dispatcher", "--config", str(env.config_path),
             "run", "--once"],
            stdout=fh, cwd=env.tmp, env=cli_env(), timeout=120,
        )  # fmt: skip
    assert proc.returncode == 1
    lines = out.read_text().splitlines()
    assert all(isinstance(json.loads(line), dict) for line in lines), lines[-3:]
