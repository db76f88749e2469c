"""The exact bytes of a log line (contract section 8): keys, key order, values, redaction, cutting, prefixes.

Each case logs through the real `dispatcher.logs` configuration into a real log
file and a captured console, and compares the whole line with the one pinned
here. Only the timestamp varies between runs: it is checked for its format
(structlog's ``TimeStamper(fmt="iso", utc=True)``) and for lying between the
clock readings taken around the call, then replaced by ``TS``.
"""

from __future__ import annotations

import asyncio
import enum
import io
import json
import logging
import re
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import structlog

from dispatcher import logs

_STAMP = re.compile(r'"timestamp": "(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{6})?Z)"')
_LINENO = re.compile(r'"lineno": \d+')
_FILENAME = re.compile(r'"filename": "[^"]*/([^/"]+\.py)"')


class Color(enum.StrEnum):
    """A StrEnum value, as the job states are, logged as its plain string."""

    RED = "red"


@dataclass
class Capture:
    """What one configuration wrote: the console stream and the log file."""

    console: io.StringIO
    path: Path

    def lines(self, call: Callable[[], None]) -> tuple[list[str], list[str]]:
        """Run call and return (console lines, file lines) it added, timestamps checked and replaced by TS."""
        before_console = len(self.console.getvalue())
        before_file = self.path.stat().st_size if self.path.exists() else 0
        start = datetime.now(UTC)
        call()
        end = datetime.now(UTC)
        console = self.console.getvalue()[before_console:]
        with self.path.open(encoding="utf-8") as f:
            f.seek(before_file)
            written = f.read()
        return _stamped(console, start, end), _stamped(written, start, end)


def _stamped(text: str, start: datetime, end: datetime) -> list[str]:
    """Return the lines of text with each timestamp checked (format, between start and end) and replaced by TS."""

    def check(m: re.Match[str]) -> str:
        when = datetime.fromisoformat(m.group(1).replace("Z", "+00:00"))
        assert start <= when <= end, (m.group(1), start, end)
        return '"timestamp": "TS"'

    return [_STAMP.sub(check, line) for line in text.splitlines()]


@pytest.fixture
def capture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Capture]]:
    """Configure dispatcher.logs on a captured console and a real log file; restore everything after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    console = io.StringIO()
    monkeypatch.setattr(logs.SINK, "console", console)
    path = tmp_path / "app.log"

    def setup(**kw: Any) -> Capture:
        logs.configure(log_file=path, **kw)
        return Capture(console, path)

    yield setup
    logs.SINK.open_file(None)
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def _log() -> Any:
    """Return a fresh logger the way the modules get theirs (a proxy bound on first use)."""
    return structlog.get_logger("dispatcher")


def _both(cap: Capture, call: Callable[[], None]) -> str:
    """Run call in JSON mode and return its one line, insisting the console and the file got the same."""
    console, written = cap.lines(call)
    assert len(written) == 1, written
    assert console == written
    return written[0]


def test_plain_values_keep_their_json_form_and_order(capture: Callable[..., Capture]) -> None:
    """Ints, floats, None, booleans, nested dicts, lists, tuples and odd objects come out in call order."""
    cap = capture(console=False)
    line = _both(
        cap,
        lambda: _log().info(
            "order.received",
            count=3,
            ratio=0.25,
            whole=3600.0,
            missing=None,
            ok=True,
            no=False,
            usage={"input_tokens": 3, "model": "m", "inner": {"x": [1, "a", None]}},
            argv=["agent", "--x"],
            pair=("a", 1),
            path=Path("/tmp/x"),
            color=Color.RED,
            big=10**20,
            neg=-1.5e-7,
        ),
    )
    assert line == (
        '{"count": 3, "ratio": 0.25, "whole": 3600.0, "missing": null, "ok": true, "no": false, '
        '"usage": {"input_tokens": 3, "model": "m", "inner": {"x": [1, "a", null]}}, "argv": ["agent", "--x"], '
        '"pair": ["a", 1], "path": "PosixPath(\'/tmp/x\')", "color": "red", "big": 100000000000000000000, '
        '"neg": -1.5e-07, "event": "order.received", "level": "info", "timestamp": "TS"}'
    )


def test_positional_arguments_are_interpolated_into_the_event(capture: Callable[..., Capture]) -> None:
    """`log.info("a %s", x)` writes the interpolated event, as structlog's filtering logger does."""
    cap = capture(console=False)
    line = _both(cap, lambda: _log().info("order.received %s of %d", "one", 2))
    assert line == '{"event": "order.received one of 2", "level": "info", "timestamp": "TS"}'


def test_bound_keys_and_contextvars_take_their_places(capture: Callable[..., Capture]) -> None:
    """Bound keys come first, then the call's keys, the event, contextvars not already given, level, timestamp."""
    cap = capture(console=False)

    def call() -> None:
        with structlog.contextvars.bound_contextvars(job_id="J-1", agent="worker", via="web"):
            _log().bind(host="h1", attempt=9).info("agent.started", attempt=1, via="cli")

    line = _both(cap, call)
    with structlog.contextvars.bound_contextvars(job_id="J-1", agent="worker", via="web"):
        order = [k for k in structlog.contextvars.get_contextvars() if k != "via"]  # the context's own order
    bound = {"job_id": "J-1", "agent": "worker"}
    merged = ", ".join(f'"{k}": "{bound[k]}"' for k in order)
    assert line == (
        f'{{"host": "h1", "attempt": 1, "via": "cli", "event": "agent.started", {merged}, "level": "info", '
        '"timestamp": "TS"}'
    )
    after = _both(cap, lambda: _log().info("daemon.idle"))
    assert after == '{"event": "daemon.idle", "level": "info", "timestamp": "TS"}'


def test_a_long_string_field_is_cut_at_field_max(capture: Callable[..., Capture]) -> None:
    """A top-level string over FIELD_MAX is cut with a note; one of exactly FIELD_MAX and nested ones are not."""
    cap = capture(console=False)
    n = logs.FIELD_MAX
    line = _both(cap, lambda: _log().info("big.field", text="x" * (n + 808), inner={"y": "y" * (n + 5)}, edge="a" * n))
    assert line == (
        '{"text": "' + "x" * n + '\\u2026 (cut, 808 more characters)", "inner": {"y": "' + "y" * (n + 5) + '"}, '
        '"edge": "' + "a" * n + '", "event": "big.field", "level": "info", "timestamp": "TS"}'
    )


def test_short_fields_longer_than_field_max_together_are_written_whole(capture: Callable[..., Capture]) -> None:
    """A line longer than FIELD_MAX made of short fields, some non-ASCII, keeps every field as given."""
    cap = capture(console=False)
    half = logs.FIELD_MAX // 2 + 1
    line = _both(cap, lambda: _log().info("two.halves", a="a" * half, b="\u00e9" * half, n=1))
    assert line == (
        '{"a": "' + "a" * half + '", "b": "' + "\\u00e9" * half + '", "n": 1, '
        '"event": "two.halves", "level": "info", "timestamp": "TS"}'
    )


def test_a_cut_happens_before_redaction(capture: Callable[..., Capture]) -> None:
    """A credential after the cut is gone with the cut; one before it is still shown as ***."""
    cap = capture(console=False)
    n = logs.FIELD_MAX
    url = "postgresql://u:pw@db/x"
    line = _both(cap, lambda: _log().info("big.url", head=url + "z" * n))
    assert line == (
        '{"head": "postgresql://u:***@db/x' + "z" * (n - len(url)) + f'\\u2026 (cut, {len(url)} more characters)", '
        '"event": "big.url", "level": "info", "timestamp": "TS"}'
    )


def test_credentials_are_redacted_at_every_depth(capture: Callable[..., Capture]) -> None:
    """A ledger URL's password and password= values show as *** at the top, in dicts, lists and tuples."""
    cap = capture(console=False)
    line = _both(
        cap,
        lambda: _log().warning(
            "daemon.started",
            ledger="postgresql://dispatcher:s3cret@db/dispatcher",
            config={"ledger": "postgres://u:pw@h:5/d", "opts": ["host=h password=abc port=5", ("PASSWORD='x y'",)]},
        ),
    )
    assert line == (
        '{"ledger": "postgresql://dispatcher:***@db/dispatcher", "config": {"ledger": "postgres://u:***@h:5/d", '
        '"opts": ["host=h password=*** port=5", ["PASSWORD=***"]]}, "event": "daemon.started", '
        '"level": "warning", "timestamp": "TS"}'
    )
    assert "s3cret" not in cap.path.read_text() and "s3cret" not in cap.console.getvalue()


def test_levels_are_named_as_structlog_names_them(capture: Callable[..., Capture]) -> None:
    """warning, warn, error, critical, exception (as error) and msg (as info) carry those level names."""
    cap = capture(console=False)
    log = _log()
    got = [
        _both(cap, lambda: log.warning("a.warning")),
        _both(cap, lambda: log.warn("a.warn")),
        _both(cap, lambda: log.error("an.error", code=3)),
        _both(cap, lambda: log.critical("a.critical")),
        _both(cap, lambda: log.msg("a.msg")),
        _both(cap, lambda: log.exception("no.exception")),
    ]
    assert got == [
        '{"event": "a.warning", "level": "warning", "timestamp": "TS"}',
        '{"event": "a.warn", "level": "warning", "timestamp": "TS"}',
        '{"code": 3, "event": "an.error", "level": "error", "timestamp": "TS"}',
        '{"event": "a.critical", "level": "critical", "timestamp": "TS"}',
        '{"event": "a.msg", "level": "info", "timestamp": "TS"}',
        '{"event": "no.exception", "level": "error", "timestamp": "TS"}',
    ]


def test_levels_below_the_configured_one_write_nothing(capture: Callable[..., Capture]) -> None:
    """At INFO a debug call writes nothing; at WARNING an info call writes nothing either."""
    cap = capture(console=False)
    assert cap.lines(lambda: _log().debug("not.shown")) == ([], [])
    cap = capture(console=False, level=logging.WARNING)
    assert cap.lines(lambda: _log().info("not.shown")) == ([], [])
    assert _both(cap, lambda: _log().warning("shown")) == '{"event": "shown", "level": "warning", "timestamp": "TS"}'


def _inner() -> None:
    raise OSError("cannot reach postgresql://u:pw@db/x")


def _outer() -> None:
    try:
        _inner()
    except OSError as e:
        raise RuntimeError("agent could not start") from e


_CHAIN = (
    '"exception": [{"exc_type": "RuntimeError", "exc_value": "agent could not start", "exc_notes": [], '
    '"syntax_error": null, "is_cause": false, "frames": [{"filename": "test_log_render.py", "lineno": 0, '
    '"name": "call"}, {"filename": "test_log_render.py", "lineno": 0, "name": "_outer"}], "is_group": false, '
    '"exceptions": []}, {"exc_type": "OSError", "exc_value": "cannot reach postgresql://u:***@db/x", '
    '"exc_notes": [], "syntax_error": null, "is_cause": true, "frames": [{"filename": "test_log_render.py", '
    '"lineno": 0, "name": "_outer"}, {"filename": "test_log_render.py", "lineno": 0, "name": "_inner"}], '
    '"is_group": false, "exceptions": []}]'
)


def _no_lines(line: str) -> str:
    """Return line with line numbers as 0 and file paths as their base names."""
    return _FILENAME.sub(r'"filename": "\1"', _LINENO.sub('"lineno": 0', line))


def test_an_exception_is_a_list_of_dicts_without_locals(capture: Callable[..., Capture]) -> None:
    """log.exception writes the chain as dicts (type, value redacted, frames) after the timestamp, no locals."""
    cap = capture(console=False)

    def call() -> None:
        try:
            _outer()
        except RuntimeError:
            _log().exception("job.crashed", attempt=2)

    line = _no_lines(_both(cap, call))
    assert line == '{"attempt": 2, "event": "job.crashed", "level": "error", "timestamp": "TS", ' + _CHAIN + "}"


def test_exc_info_given_by_value_is_rendered_the_same(capture: Callable[..., Capture]) -> None:
    """error(..., exc_info=exc) renders that exception; exc_info=False renders none and drops the key."""
    cap = capture(console=False)

    def call() -> BaseException:
        try:
            _outer()
        except RuntimeError as e:
            return e
        raise AssertionError("no exception")

    err = call()
    line = _no_lines(_both(cap, lambda: _log().error("job.crashed", exc_info=err, attempt=2)))
    assert line == '{"attempt": 2, "event": "job.crashed", "level": "error", "timestamp": "TS", ' + _CHAIN + "}"
    assert _both(cap, lambda: _log().error("x", exc_info=False)) == (
        '{"event": "x", "level": "error", "timestamp": "TS"}'
    )


def test_stdlib_records_take_the_same_path(capture: Callable[..., Capture]) -> None:
    """A library's stdlib warning or error (filelock, watchdog) is the same JSON, redacted, never cut."""
    cap = capture(console=False)
    warn = _both(cap, lambda: logging.getLogger("filelock").warning("lock %s is stale", "postgresql://u:pw@h/db"))
    assert warn == (
        '{"event": "lock postgresql://u:***@h/db is stale", "logger": "filelock", "level": "warning", '
        '"timestamp": "TS"}'
    )
    long = "w" * (logs.FIELD_MAX + 3)
    assert _both(cap, lambda: logging.getLogger("watchdog").error(long)) == (
        '{"event": "' + long + '", "logger": "watchdog", "level": "error", "timestamp": "TS"}'
    )

    def call() -> None:
        try:
            _outer()
        except RuntimeError:
            logging.getLogger("watchdog.observers").error("boom", exc_info=True)

    line = _no_lines(_both(cap, call))
    assert line == (
        '{"event": "boom", "logger": "watchdog.observers", "level": "error", "timestamp": "TS", ' + _CHAIN + "}"
    )
    assert cap.lines(lambda: logging.getLogger("filelock").info("not shown")) == ([], [])


def test_journal_lines_start_with_the_priority(
    capture: Callable[..., Capture], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When stdout is the journal, each console line is `<N>` and the JSON; the file has the JSON alone."""
    journal = (tmp_path / "journal").open("w+", encoding="utf-8")
    st = Path(journal.name).stat()
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    monkeypatch.setattr(logs.SINK, "console", journal)
    try:
        cap = capture(console=None, level=logging.DEBUG)
        log = _log()
        start = datetime.now(UTC)
        log.debug("a.debug")
        log.info("an.info", n=1)
        log.warning("a.warning")
        log.error("an.error")
        log.critical("a.critical")
        logging.getLogger("filelock").warning("stale")
        end = datetime.now(UTC)
        journal.seek(0)
        console = _stamped(journal.read(), start, end)
        written = _stamped(cap.path.read_text(), start, end)
    finally:
        journal.close()
    assert written == [
        '{"event": "a.debug", "level": "debug", "timestamp": "TS"}',
        '{"n": 1, "event": "an.info", "level": "info", "timestamp": "TS"}',
        '{"event": "a.warning", "level": "warning", "timestamp": "TS"}',
        '{"event": "an.error", "level": "error", "timestamp": "TS"}',
        '{"event": "a.critical", "level": "critical", "timestamp": "TS"}',
        '{"event": "stale", "logger": "filelock", "level": "warning", "timestamp": "TS"}',
    ]
    assert console == [f"<{p}>{line}" for p, line in zip([7, 6, 4, 3, 2, 4], written, strict=True)]


def test_console_mode_prints_format_line_and_the_file_keeps_json(capture: Callable[..., Capture]) -> None:
    """On a terminal the console gets logview.format_line text (redacted), the file the JSON line."""
    cap = capture(console=True)

    def call() -> None:
        with structlog.contextvars.bound_contextvars(job_id="J-1", agent="worker"):
            _log().info(
                "agent.exited",
                exit_code=0,
                usage={"input_tokens": 3, "list": ["a", "b"]},
                cost_usd=0.1235,
                missing=None,
                flag=True,
                whole=3600.0,
                url="postgresql://u:pw@db/x",
            )

    start = datetime.now(UTC)
    console, written = cap.lines(call)
    [text] = console
    stamp = text.split(" ", 1)[0]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", stamp) and stamp[:19] >= start.isoformat()[:19]
    assert text[len(stamp) :] == (
        " info    agent.exited       J-1 (worker) exit_code=0 usage.input_tokens=3 usage.list=a, b "
        "cost_usd=0.1235 missing=- flag=true whole=3600 url=postgresql://u:***@db/x"
    )
    [line] = written
    assert line.startswith('{"exit_code": 0, "usage": {"input_tokens": 3, "list": ["a", "b"]}, "cost_usd": 0.1235, ')
    assert '"url": "postgresql://u:***@db/x", "event": "agent.exited", ' in line


def test_console_mode_prints_an_exception_as_traceback_lines(capture: Callable[..., Capture]) -> None:
    """In console mode an exception follows the line as indented traceback lines, redacted."""
    cap = capture(console=True)

    def call() -> None:
        try:
            _outer()
        except RuntimeError:
            _log().exception("job.crashed")

    console, _written = cap.lines(call)
    body = [re.sub(r"line \d+", "line N", re.sub(r'File "[^"]*/', 'File "', c)) for c in console[1:]]
    assert console[0].endswith(" error   job.crashed       ")
    assert body == [
        "  Traceback (most recent call last):",
        '    File "test_log_render.py", line N, in call',
        '    File "test_log_render.py", line N, in _outer',
        "  RuntimeError: agent could not start",
        "  Traceback (most recent call last):",
        '    File "test_log_render.py", line N, in _outer',
        '    File "test_log_render.py", line N, in _inner',
        "  OSError: cannot reach postgresql://u:***@db/x",
    ]


def test_log_and_async_methods_write_the_same_line(capture: Callable[..., Capture]) -> None:
    """log.log(level, ...) and the async methods (ainfo) write what the level methods write."""
    cap = capture(console=False)
    log = _log()
    assert _both(cap, lambda: log.log(logging.WARNING, "a.log", n=1)) == (
        '{"n": 1, "event": "a.log", "level": "warning", "timestamp": "TS"}'
    )

    async def call() -> None:
        with structlog.contextvars.bound_contextvars(job_id="J-5"):
            await log.ainfo("an.ainfo", n=2)

    assert _both(cap, lambda: asyncio.run(call())) == (
        '{"n": 2, "event": "an.ainfo", "job_id": "J-5", "level": "info", "timestamp": "TS"}'
    )
    assert cap.lines(lambda: log.log(logging.DEBUG, "not.shown")) == ([], [])


def test_a_circular_value_still_raises_as_json_dumps_does(capture: Callable[..., Capture]) -> None:
    """A value that contains itself raises json's ValueError and writes nothing, as structlog's renderer did."""
    cap = capture(console=False)
    loop: list[Any] = []
    loop.append(loop)

    def call() -> None:
        with pytest.raises((ValueError, RecursionError)):
            _log().info("a.loop", value={"v": loop})

    assert cap.lines(call) == ([], [])


@pytest.mark.parametrize(
    "ns",
    [
        0,
        1,
        999,
        1_000,
        999_999_999,
        1_000_000_000,
        1_764_600_000_000_000_000,
        1_764_600_000_123_456_789,
        1_709_164_800_000_001_000,
        4_102_444_799_999_999_999,
    ],
)
def test_the_timestamp_text_is_what_datetime_isoformat_gives(ns: int) -> None:
    """The log timestamp for a clock reading is isoformat's UTC text with Z, whole seconds without a fraction."""
    second, micro = divmod(ns // 1000, 1_000_000)
    want = datetime.fromtimestamp(second, UTC).replace(microsecond=micro).isoformat().replace("+00:00", "Z")
    assert logs._iso(ns) == want
    assert logs._iso(ns) == want  # the second time from the cached seconds


def test_the_timestamp_now_lies_between_structlogs_own_stamps() -> None:
    """A timestamp taken now sorts between two of structlog's TimeStamper taken just before and after."""
    stamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    for _ in range(1000):
        before = stamper(None, "", {})["timestamp"]
        now = logs._stamp()
        after = stamper(None, "", {})["timestamp"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?Z", now), now
        parse = datetime.fromisoformat
        assert parse(before.replace("Z", "+00:00")) <= parse(now.replace("Z", "+00:00"))
        assert parse(now.replace("Z", "+00:00")) <= parse(after.replace("Z", "+00:00"))


def test_keys_named_like_ours_keep_their_place_and_get_our_values(capture: Callable[..., Capture]) -> None:
    """A call's own level or timestamp key keeps its place in the line but carries the real level and time."""
    cap = capture(console=False)
    line = _both(cap, lambda: _log().info("x", level="bogus", name="n", timestamp="never", logger="mine"))
    assert line == '{"level": "info", "name": "n", "timestamp": "TS", "logger": "mine", "event": "x"}'


def test_capture_logs_still_captures_after_configure(capture: Callable[..., Capture]) -> None:
    """structlog.testing.capture_logs, used by tests, gets the events and nothing is written meanwhile."""
    cap = capture(console=False)
    log = _log()
    _both(cap, lambda: log.info("before"))  # the logger is bound and cached with the configured chain

    def call() -> None:
        with structlog.testing.capture_logs() as entries:
            log.warning("captured", n=1)
            logs.get(job_id="J-8").info("captured.too")
        assert entries == [
            {"n": 1, "event": "captured", "log_level": "warning"},
            {"job_id": "J-8", "event": "captured.too", "log_level": "info"},
        ]

    assert cap.lines(call) == ([], [])
    assert _both(cap, lambda: log.info("after")) == '{"event": "after", "level": "info", "timestamp": "TS"}'


@pytest.mark.parametrize("console", [False, True])
def test_a_settled_module_logger_writes_what_its_proxy_did(
    capture: Callable[..., Capture], monkeypatch: pytest.MonkeyPatch, console: bool
) -> None:
    """logs.settle gives a module's logger the configured methods: same lines, bound keys, capture_logs too."""
    cap = capture(console=console)
    module = types.ModuleType("settled_pkg.mod")
    module.log = _log()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "settled_pkg.mod", module)
    logs.settle("settled_pkg")
    settled = module.log  # type: ignore[attr-defined]
    assert "info" in vars(settled)  # looked up once, not at every line

    def call(log: Any) -> Callable[[], None]:
        def run() -> None:
            with structlog.contextvars.bound_contextvars(job_id="J-9", agent="worker"):
                log.info("job.done", n=1, cost_usd=None)
                log.warning("agent.exited", exit_code=3)
            log.bind(k="v").error("x", path=Path("/a/b"))

        return run

    def lines(log: Any) -> tuple[list[str], list[str]]:
        console, written = cap.lines(call(log))
        return [line.split(" ", 1)[1] for line in console], written  # the console's own timestamp differs

    assert lines(settled) == lines(_log())
    with structlog.testing.capture_logs() as entries:
        settled.info("captured", n=1)
    assert entries == [{"n": 1, "event": "captured", "log_level": "info"}]


def test_a_huge_nested_field_is_cut_as_its_json_text(capture: Callable[..., Capture]) -> None:
    """A mapping whose JSON passes NESTED_MAX (an agent's `usage` of 60 long keys) becomes its JSON text cut there:
    the line stays far below journald's 48 KiB, where journalctl would split it; a smaller one stays a mapping."""
    cap = capture(console=False)
    usage = {f"k{i}": "x" * 1000 for i in range(60)}
    small = {"input_tokens": 10}
    line = _both(cap, lambda: _log().info("agent.exited", usage=usage, small=small))
    assert len(line) < 40_000, len(line)
    text = json.dumps(usage)
    cut = text[: logs.NESTED_MAX] + f"… (cut, {len(text) - logs.NESTED_MAX} more characters)"
    assert json.loads(line) == {"usage": cut, "small": small, "event": "agent.exited", "level": "info",
                                "timestamp": "TS"}  # fmt: skip


def test_list_columns_line_up_as_a_terminal_shows_them() -> None:
    """`list` pads by what a terminal shows: an escaped bidi control (`\\u202e`, six columns), a wide CJK id (two
    columns a character) and costs longer than the usual column keep STATE, COST and REASON in their columns."""
    from dispatcher.cli.render import columns, render_list

    rows = [
        {"job_id": "X\u202eY", "state": "refused", "agent": None, "age_s": 1, "cost_usd": None, "reason": "r"},
        {"job_id": "日本語", "state": "refused", "agent": None, "age_s": 1, "cost_usd": None, "reason": "r"},
        {"job_id": "CF-2", "state": "failed", "agent": "c", "age_s": 1, "cost_usd": 12345.6789, "reason": "x"},
        {"job_id": "CF-1", "state": "failed", "agent": "c", "age_s": 1, "cost_usd": 0.00001234, "reason": "x"},
        {"job_id": "OK-1", "state": "done", "agent": "c", "age_s": 1, "cost_usd": 0.5, "reason": None},
    ]
    lines = list(render_list(rows))
    assert "\u202e" not in "".join(lines) and "X\\u202eY" in lines[1]
    state_at = columns(lines[0][: lines[0].index("STATE")])
    starts = {columns(line[: line.index(" " + r["state"]) + 1]) for line, r in zip(lines[1:], rows, strict=True)}
    assert starts == {state_at}, lines
    reasons = [columns(line[: line.rindex(" ") + 1]) for line in lines[1:4]]
    assert len(set(reasons)) == 1, lines  # REASON starts in one column
    costs = [columns(line[: line.index("USD") + 3]) for line in lines if "USD" in line]
    assert len(set(costs)) == 1, lines  # costs end in one column


def test_a_line_never_passes_journalds_line_limit(capture: Callable[..., Capture]) -> None:
    """Fields that encode long (quotes, backslashes and control characters take two to six bytes each), or several
    long fields together, are cut further by their encoded size: every line stays within LINE_MAX (below
    journald's 48 KiB LineMax) and is one JSON object, with each cut field noted. A usage full of quotes made an
    agent.exited line of 65 KB."""
    cap = capture(console=False)
    quoted = {"k": '"' * 20000}
    controls = "\x01" * (logs.FIELD_MAX - 1)
    many = {f"f{i}": "x" * (logs.FIELD_MAX - 1) for i in range(8)}
    for name, fields in (("quotes", {"usage": quoted}), ("controls", {"a": controls, "b": controls}), ("many", many)):
        line = _both(cap, lambda n=name, f=fields: _log().info("agent.exited", name=n, **f))  # type: ignore[misc]
        assert len(line.encode()) <= logs.LINE_MAX < 48 * 1024, (name, len(line))
        entry = json.loads(line)
        assert entry["event"] == "agent.exited" and entry["name"] == name
        assert any("… (cut, " in str(v) for v in entry.values()), name
