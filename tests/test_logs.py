"""Logs (contract section 8): the JSON log file, `dispatcher logs`, SIGHUP reopening, no leaked locals.

One real daemon run with `log_file` set, a file rotated away mid-run the way
logrotate does it, then the `logs` command on what it wrote. `dispatcher.logs`
itself is also configured in-process to prove an exception is logged without
its local variables.
"""

from __future__ import annotations

import io
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import structlog
from conftest import DEADLINE, Env, cli_env, order

from dispatcher import logs

LEVELS = {"debug", "info", "warning", "error", "critical"}
JOBS = {"LOG-OK": "worker", "LOG-BAD": "broken", "LOG-AFTER": "worker"}


def read_entries(path: Path) -> list[dict[str, Any]]:
    """Return every line of a JSON log file, parsed; a line that is not a JSON object fails the test."""
    entries = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        entry = json.loads(line)
        assert isinstance(entry, dict), f"{path.name}:{n} is not a JSON object: {line}"
        entries.append(entry)
    return entries


def utc(text: str) -> datetime:
    """Parse an ISO 8601 timestamp and insist it is in UTC."""
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    assert when.utcoffset() == timedelta(0), text
    return when


@dataclass
class Run:
    """What one daemon run left: its stdout, the rotated log file and the current one."""

    env: Env
    stdout: Path
    rotated: Path
    current: Path
    exit_code: int


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """Run a daemon with log_file set: one job and one refusal, logrotate + SIGHUP, two more jobs, stop."""
    tmp = tmp_path_factory.mktemp("logs")
    env = Env(tmp=tmp, root=tmp / "dispatch", config_path=tmp / "dispatcher.yaml", count_file=tmp / "starts.txt")
    current = tmp / "var" / "dispatcher.log"  # its folder does not exist yet
    rotated = tmp / "var" / "dispatcher.log.1"
    env.configure(agents={"worker": env.agent(), "broken": env.agent("--exit", "3")}, log_file=str(current))
    try:
        d = env.daemon()
        d.wait_ready()
        env.drop(order("LOG-OK"))
        env.drop(b"job_id: [", "torn.yaml")
        env.wait_job("LOG-OK", "done")
        env.wait_refused("torn")
        d.wait_event("job.refused")
        d.wait_event("job.done", job_id="LOG-OK")  # the line comes just after the move to done/
        current.rename(rotated)
        d.signal(signal.SIGHUP)
        d.wait_event("config.reloaded")
        env.drop(order("LOG-BAD", to="broken"))
        env.drop(order("LOG-AFTER"))
        env.wait_job("LOG-BAD", "failed")
        env.wait_job("LOG-AFTER", "done")
        code = d.stop()
        yield Run(env, d.out, rotated, current, code)
    finally:
        for daemon in env._daemons:
            if daemon.proc is not None and daemon.proc.poll() is None:
                daemon.proc.kill()
                daemon.proc.wait(DEADLINE)
            daemon._fh.close()


def stdout_entries(run: Run) -> list[dict[str, Any]]:
    """Return the JSON objects the daemon printed on stdout (it is not a terminal)."""
    out = []
    for line in run.stdout.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


# -- the log file -------------------------------------------------------------------------------


def test_every_log_file_line_is_json_with_timestamp_level_and_event(run: Run) -> None:
    """Each line of log_file, before and after rotation, is a JSON object with UTC timestamp, level, event."""
    assert run.exit_code == 0
    entries = read_entries(run.rotated) + read_entries(run.current)
    assert len(entries) > 10
    for e in entries:
        utc(e["timestamp"])
        assert e["level"] in LEVELS, e
        assert isinstance(e["event"], str) and e["event"], e
    stamps = [utc(e["timestamp"]) for e in entries]
    assert stamps == sorted(stamps), "lines are written in time order"


def test_job_lines_in_the_file_carry_job_id_and_agent(run: Run) -> None:
    """Every file line about a job has its job_id and its agent, from claim to finish."""
    entries = read_entries(run.rotated) + read_entries(run.current)
    for job_id, agent in JOBS.items():
        mine = [e for e in entries if e.get("job_id") == job_id]
        assert {"job.claimed", "agent.started", "agent.exited", "job.verified"} <= {e["event"] for e in mine}
        assert all(e.get("agent") == agent for e in mine), [e for e in mine if e.get("agent") != agent]


def test_log_file_holds_exactly_the_stdout_lines(run: Run) -> None:
    """The rotated file followed by the new one hold the stdout lines, none lost or doubled by the rotation."""
    assert read_entries(run.rotated) + read_entries(run.current) == stdout_entries(run)


def test_sighup_moves_writing_to_a_new_file(run: Run) -> None:
    """After logrotate renames log_file, SIGHUP makes a new one: nothing after the reload goes to the old."""
    old = read_entries(run.rotated)
    new = read_entries(run.current)
    assert old[0]["event"] == "daemon.started"
    assert "job.refused" in {e["event"] for e in old}
    assert "config.reloaded" not in {e["event"] for e in old}
    assert not {"LOG-BAD", "LOG-AFTER"} & {e.get("job_id") for e in old}
    events = [e["event"] for e in new]
    assert "config.reloaded" in events and events[-1] in ("daemon.stopping", "daemon.stopped")
    assert "LOG-OK" not in {e.get("job_id") for e in new}


# -- `dispatcher logs` --------------------------------------------------------------------------


def test_logs_prints_one_readable_line_per_entry(run: Run) -> None:
    """`dispatcher logs` prints each entry of log_file as one line a person reads, not JSON, in order."""
    proc = run.env.cli("logs")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    entries = read_entries(run.current)
    assert len(lines) == len(entries)
    for line, e in zip(lines, entries, strict=True):
        with pytest.raises(json.JSONDecodeError):
            json.loads(line)
        assert line.startswith(e["timestamp"][:19]), (line, e)
        assert f" {e['event']}" in line and e["level"] in line
        if e.get("job_id"):
            assert f"{e['job_id']} ({e['agent']})" in line, line


def test_logs_job_shows_only_that_jobs_lines(run: Run) -> None:
    """`logs --job ID` prints exactly the lines about that job, with the fields that explain it."""
    proc = run.env.cli("logs", "--job", "LOG-BAD")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    want = [e for e in read_entries(run.current) if e.get("job_id") == "LOG-BAD"]
    assert len(lines) == len(want) >= 5
    assert all("LOG-BAD (broken)" in line for line in lines)
    failed = [line for line in lines if " job.failed " in line]
    assert len(failed) == 1 and "reason=exit_ok: exit 3" in failed[0], lines
    assert any(" agent.exited " in line and "exit_code=3" in line for line in lines), lines


def test_logs_without_log_file_exits_2(env: Env) -> None:
    """`logs` with no log_file in the config exits 2 with one line naming log_file."""
    proc = env.cli("logs")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "log_file" in proc.stderr, proc.stderr


def test_a_dropped_cancel_request_names_the_job_and_a_null_agent(env: Env) -> None:
    """Contract 8: a line about a job carries job_id and agent. `cancel` of a queued order whose file is then
    removed by hand: the next daemon drops the request (`cancel.dropped`) with agent null."""
    log_file = env.tmp / "d.log"
    env.configure(log_file=str(log_file))
    queued = env.drop(order("GONE-1"))
    env.cli("cancel", "GONE-1", check=True)
    queued.unlink()
    assert env.cli("run", "--once", timeout=120).returncode == 0
    events = [json.loads(line) for line in log_file.read_text().splitlines()]
    (dropped,) = [e for e in events if e["event"] == "cancel.dropped"]
    assert dropped["job_id"] == "GONE-1" and "agent" in dropped and dropped["agent"] is None
    assert all("agent" in e for e in events if "job_id" in e)


def _line(event: str, **extra: Any) -> str:
    return json.dumps({"timestamp": "2026-11-29T08:00:00.000001Z", "level": "info", "event": event, **extra}) + "\n"


def test_logs_escapes_a_file_names_byte_that_is_no_utf8(env: Env) -> None:
    """A file name with byte 0x9b (an 8-bit terminal's CSI) is logged as the escape "\\udc9b": `logs` prints \\x9b
    for it, as `show` does, never the raw byte."""
    log_file = env.tmp / "d.log"
    env.configure(log_file=str(log_file))
    log_file.write_text(_line("order.received", job_id="J-1", agent=None, file="a\udc9bb.json"))
    proc = subprocess.run(
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "logs"],
        capture_output=True, timeout=60, env=cli_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert b"\x9b" not in proc.stdout and b"file=a\\x9bb.json" in proc.stdout, proc.stdout


def test_logs_skips_a_torn_line(env: Env) -> None:
    """A line that is not JSON (a write cut short) is skipped; the lines around it still print."""
    log_file = env.tmp / "d.log"
    env.configure(log_file=str(log_file))
    log_file.write_text(_line("first.event") + '{"timestamp": "2026-\n' + _line("second.event", job_id="J-9"))
    proc = env.cli("logs")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and "first.event" in lines[0] and "second.event" in lines[1], lines


def test_logs_follow_prints_lines_as_they_are_appended(env: Env) -> None:
    """`logs -f` prints the file, then each line appended later, until it is stopped."""
    log_file = env.tmp / "d.log"
    env.configure(log_file=str(log_file))
    log_file.write_text(_line("before.follow"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dispatcher", "--config", str(env.config_path), "logs", "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=env.tmp,
        env=cli_env(),
    )
    assert proc.stdout is not None
    try:
        assert "before.follow" in _read_line(proc.stdout, 20)
        with log_file.open("a") as f:
            f.write(_line("after.follow", job_id="J-7", agent="worker"))
        line = _read_line(proc.stdout, 20)
        assert "after.follow" in line and "J-7 (worker)" in line
        assert proc.poll() is None, "logs -f returned instead of following"
    finally:
        proc.kill()
        proc.wait(DEADLINE)
        proc.stdout.close()
        assert proc.stderr is not None
        proc.stderr.close()


def _read_line(stream: Any, timeout: float) -> str:
    """Read one line from a pipe, failing after timeout instead of blocking forever."""
    end = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        left = end - time.monotonic()
        assert left > 0, f"no line within {timeout} s (got {data!r})"
        ready, _, _ = select.select([stream], [], [], left)
        if ready:
            chunk = os.read(stream.fileno(), 1)
            assert chunk, f"stream closed (got {data!r})"
            data += chunk
    return data.decode()


def test_sighup_with_a_bad_config_still_reopens_the_log_file(env: Env) -> None:
    """logrotate's SIGHUP reopens log_file even when the config on disk is broken (config.rejected)."""
    log_file = env.tmp / "d.log"
    env.configure(log_file=str(log_file))
    good = env.config_path.read_text()
    d = env.daemon()
    try:
        d.wait_ready()
        log_file.rename(env.tmp / "d.log.1")
        env.config_path.write_text(good + "max_jobz: 3\n")
        d.signal(signal.SIGHUP)
        d.wait_event("config.rejected")
        assert log_file.exists(), "after SIGHUP the daemon still writes to the renamed file"
        assert "config.rejected" in {e["event"] for e in read_entries(log_file)}
    finally:
        env.config_path.write_text(good)
        assert d.stop() == 0


def test_a_log_file_that_cannot_be_reopened_is_one_plain_line_naming_it(env: Env) -> None:
    """A SIGHUP whose log_file cannot be made again (its folder is now a file) logs `log_file.reopen_failed` with
    the path and the system's words, no Python notation (section 7), and the daemon writes on to the old file."""
    logs_dir = env.tmp / "logs"
    logs_dir.mkdir()
    env.configure(log_file=str(logs_dir / "d.log"))
    d = env.daemon()
    try:
        d.wait_ready()
        logs_dir.rename(env.tmp / "logs.old")
        logs_dir.write_text("x\n")
        d.signal(signal.SIGHUP)
        line = d.wait_event("log_file.reopen_failed")
        assert line["file"] == str(logs_dir / "d.log") or line["file"] == str(logs_dir), line
        assert line["error"] in ("Not a directory", "File exists"), line
        d.wait_event("config.reloaded")
        assert "log_file.reopen_failed" in {e["event"] for e in read_entries(env.tmp / "logs.old" / "d.log")}
    finally:
        assert d.stop() == 0


# -- dispatcher.logs in-process -----------------------------------------------------------------


@pytest.fixture
def configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, io.StringIO, Path]]:
    """Configure dispatcher.logs with a log file and a captured console; restore everything after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    console = io.StringIO()
    monkeypatch.setattr(logs.SINK, "console", console)
    path = tmp_path / "app.log"

    def setup(**kw: Any) -> None:
        logs.configure(log_file=path, **kw)

    yield setup, console, path
    logs.SINK.open_file(None)
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def _crash_with_a_secret() -> None:
    secret_token = "tok-5f3a9c-DO-NOT-LOG"  # noqa: S105 - the value the logs must never show
    raise RuntimeError("agent could not start: " + str(len(secret_token)))


@pytest.mark.parametrize("console", [False, True], ids=["json", "console"])
def test_logged_exception_shows_no_local_variables(configured: Any, console: bool) -> None:
    """An exception is logged with its type and frames but never the values of local variables."""
    setup, out, path = configured
    setup(console=console)
    try:
        _crash_with_a_secret()
    except RuntimeError:
        logs.get(job_id="J-1").exception("job.crashed")
    text = out.getvalue() + path.read_text()
    assert "DO-NOT-LOG" not in text
    [entry] = read_entries(path)
    [exc] = entry["exception"]
    assert exc["exc_type"] == "RuntimeError" and "could not start" in exc["exc_value"]
    assert [f["name"] for f in exc["frames"]][-1] == "_crash_with_a_secret"
    assert all("locals" not in f or not f["locals"] for f in exc["frames"])
    assert "RuntimeError" in out.getvalue()


def test_stdlib_records_come_out_as_the_same_json(configured: Any) -> None:
    """A warning from a library's stdlib logger (watchdog, filelock) is one JSON line like the others."""
    setup, out, path = configured
    setup(console=False)
    logging.getLogger("filelock").warning("lock %s is stale", "ledger.lock")
    [entry] = read_entries(path)
    assert entry["event"] == "lock ledger.lock is stale" and entry["level"] == "warning"
    assert entry["logger"] == "filelock"
    utc(entry["timestamp"])
    assert json.loads(out.getvalue()) == entry


def test_bound_job_id_and_agent_reach_every_line(configured: Any) -> None:
    """job_id and agent bound with contextvars in a job's thread appear on its lines, then go away."""
    setup, _out, path = configured
    setup(console=False)
    log = logs.get()
    with structlog.contextvars.bound_contextvars(job_id="J-3", agent="worker"):
        log.info("agent.started", attempt=1)
    log.info("daemon.idle")
    first, second = read_entries(path)
    assert first | {"timestamp": None} == {
        "event": "agent.started",
        "attempt": 1,
        "job_id": "J-3",
        "agent": "worker",
        "level": "info",
        "timestamp": None,
    }
    assert "job_id" not in second and second["timestamp"].endswith("Z")


def test_console_mode_is_readable_text_and_the_file_stays_json(configured: Any) -> None:
    """On a terminal the console gets readable text, while log_file still gets the JSON line."""
    setup, out, path = configured
    setup(console=True)
    logs.get().info("job.done", job_id="J-4", agent="worker")
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.getvalue())
    assert "job.done" in out.getvalue() and "J-4" in out.getvalue()
    [entry] = read_entries(path)
    assert entry["event"] == "job.done" and entry["job_id"] == "J-4"
