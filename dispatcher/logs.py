"""Structured logs: one JSON object per line on stdout and in ``log_file``.

One renderer serves structlog and stdlib records (watchdog's and filelock's
lines come out as the same JSON); it does in one pass what a chain of structlog
processors did, with the same bytes (tests/test_log_render.py pins them). JSON when stdout is not a
terminal, and `logview.format_line` (the console format `dispatcher logs` also
prints) when it is. When stdout is the journal, each JSON line starts with its
syslog priority (`<3>` error ... `<7>` debug), which journald takes off and
keeps as the entry's priority, so `journalctl -p err` finds errors. A credential
in any field (a ledger URL's password) is written as ``***``. Exceptions
are rendered as dicts without local variables (``show_locals=False``), so no
secret held in a local ends up in the journal.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
import json.encoder
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn, TextIO

import structlog
from structlog.contextvars import STRUCTLOG_KEY_PREFIX
from structlog.tracebacks import ExceptionDictTransformer

from dispatcher import fsutil
from dispatcher.logview import format_line
from dispatcher.text import is_count, may_hold_secret, redact

_lock = threading.Lock()


class _Sink:
    """Writes each rendered line to stdout and, when set, the log file (reopenable)."""

    def __init__(self) -> None:
        self.console: TextIO = sys.stdout
        self.file: TextIO | None = None
        self.path: Path | None = None
        #: look at log_file's path before each line and open it again once it was moved or removed (a
        #: process no one sends SIGHUP to at a rotation: the web view); the daemon reopens on SIGHUP
        self.follow = False
        #: a command's lines are also handed to the running daemon, for its stdout (the journal)
        self.relay: Callable[[str], None] | None = None

    def open_file(self, path: Path | None) -> None:
        """(Re)open the log file, for logrotate on SIGHUP; raise OSError and keep the old one on failure."""
        new = _open_log(path) if path is not None else None
        with _lock:
            old, self.file, self.path = self.file, new, path
        if old is not None:
            old.close()

    def _moved(self) -> None:
        """Open log_file again if its path no longer names the open file (rotated); keep the old one on failure."""
        if self.file is None or self.path is None:
            return
        try:
            st = os.stat(self.path)
            now = os.fstat(self.file.fileno())
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                return
        except FileNotFoundError:
            pass
        except (OSError, ValueError):
            return
        try:
            new = _open_log(self.path)
        except OSError:
            return
        old, self.file = self.file, new
        old.close()

    def write(self, line: str, json_line: str) -> None:
        with _lock:
            try:
                self.console.write(line + "\n")
                self.console.flush()
            except (OSError, ValueError):
                pass
            if self.follow:
                self._moved()
            if self.file is not None:
                with contextlib.suppress(OSError):
                    self.file.write(json_line + "\n")
            if self.relay is not None:
                with contextlib.suppress(OSError):
                    self.relay(json_line)

    def write_console(self, line: str) -> None:
        """Write a line on stdout only (a command's line relayed by the daemon: the command wrote log_file)."""
        with _lock, contextlib.suppress(OSError, ValueError):
            self.console.write(line + "\n")
            self.console.flush()


def _open_log(path: Path) -> TextIO:
    """Open log_file for appending, making its folder; never blocking.

    A named pipe without a reader is an error (ENXIO), not a process stuck in open()
    that no signal ends; a full one drops lines instead of stopping the loop.
    """
    fsutil.make_dir(os.fspath(path.parent))  # a missing folder is made, as metrics_file's
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o640)
    return open(fd, "a", buffering=1, encoding="utf-8")


SINK = _Sink()
_renderer: _Renderer | None = None  # the one configure() set up: relayed lines take its format


FIELD_MAX = 8192  # characters of one string field; journald splits lines over 48 KiB
NESTED_MAX = 4 * FIELD_MAX  # characters of a mapping's or list's JSON (an agent's usage): beyond, its cut text
LINE_MAX = 47 * 1024  # bytes of a line's JSON (ASCII): journald's LineMax is 48 KiB, the `<N>` prefix included

_stamped: tuple[int, str] = (-1, "")  # the last whole second and its ISO text, shared by all threads


def _stamp() -> str:
    """Return the time now as structlog's ``TimeStamper(fmt="iso", utc=True)`` writes it, for a fraction of the cost."""
    return _iso(time.time_ns())


def _iso(ns: int) -> str:
    """Return a time in nanoseconds since the epoch as ``datetime.isoformat`` in UTC writes it, with ``Z``.

    Like ``datetime.now`` the nanoseconds are floored to microseconds, and like
    ``isoformat`` the fraction is left out when it is zero
    (``2026-11-29T08:00:00Z``). The text up to the seconds is made once a second.
    """
    global _stamped
    micros = ns // 1000
    second, micro = micros // 1_000_000, micros % 1_000_000
    last = _stamped
    if last[0] != second:
        last = _stamped = (second, datetime.fromtimestamp(second, UTC).isoformat()[:19])
    return f"{last[1]}.{micro:06d}Z" if micro else f"{last[1]}Z"


def _cut(value: str, limit: int = FIELD_MAX) -> str:
    """Return a string field cut to limit, with a note saying how much was cut."""
    return f"{value[:limit]}… (cut, {len(value) - limit} more characters)"  # as a check's detail and a reason


_dicts = structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False))
_SCALARS = frozenset({int, float, bool, type(None)})
_OWN = frozenset({"event", "level", "timestamp"})  # written by the daemon itself: short, nothing to cut or hide


def scrub(value: Any) -> Any:
    """Return value with every credential in its strings shown as ``***`` (dicts and lists walked)."""
    cls = value.__class__
    if cls is str:
        return redact(value)
    if cls in _SCALARS:
        return value
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v) for v in value]
    return value


# syslog priorities (RFC 5424) for the journal's `<N>` line prefix (sd-daemon(3))
PRIORITY = {"debug": 7, "info": 6, "notice": 5, "warning": 4, "warn": 4, "error": 3, "exception": 3, "critical": 2}
_LEVEL_NAMES = {"warn": "warning", "exception": "error"}  # structlog's add_log_level names these so
_PREFIX = len(STRUCTLOG_KEY_PREFIX)


def is_journal(stream: TextIO) -> bool:
    """Return True when stream is the journal: `$JOURNAL_STREAM` is `dev:inode` of its file (systemd.exec(5)).

    systemd sets the variable for the service's own stdout; a child that
    inherits it with stdout sent elsewhere must not take that for the journal.
    """
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not (is_count(dev) and is_count(ino)):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def _json_fallback_handler(obj: Any) -> Any:
    """Return what JSONRenderer's default writes for a value JSON cannot hold: its ``__structlog__()``, else repr."""
    try:
        return obj.__structlog__()
    except AttributeError:
        return repr(obj)


def _encoder() -> Callable[[Any], str]:
    """Return what structlog's ``JSONRenderer`` calls, ``json.dumps(event, default=...)``, without its wrappers.

    ``JSONEncoder.encode`` builds the same C encoder for each call; calling it
    directly (with a fresh circular-reference memo each time) gives the same text.
    """
    make: Any = vars(json.encoder).get("c_make_encoder")  # not in typeshed; None without the C accelerator
    if make is None:  # no C accelerator: the pure-Python encoder, as json.dumps would use
        return json.JSONEncoder(default=_json_fallback_handler).encode
    ascii_str = json.encoder.encode_basestring_ascii  # what JSONEncoder uses with ensure_ascii=True

    def encode(event: Any) -> str:
        return "".join(make({}, _json_fallback_handler, ascii_str, None, ": ", ", ", False, False, True)(event, 0))

    return encode


class _Renderer:
    """Turn an event into its line: JSON for the file, and JSON (journal: with its priority) or console text for stdout.

    One pass does what structlog's chain of merge_contextvars, add_log_level,
    TimeStamper, a cut of long fields, ExceptionRenderer, a scrub and
    JSONRenderer did, with the same keys in the same order and the same bytes.
    """

    def __init__(self, console: bool, journal: bool) -> None:
        self._console = console
        self._journal = journal
        self._plain = not console and not journal  # stdout takes the JSON line as it is
        self._encode = _encoder()

    def emit(self, level: str, event: MutableMapping[str, Any]) -> None:
        """Write a structlog event: add the contextvars not already given, the level and the timestamp, cut, write."""
        for var, value in contextvars.copy_context().items():
            name = var.name
            if value is not Ellipsis and name.startswith(STRUCTLOG_KEY_PREFIX) and name[_PREFIX:] not in event:
                event[name[_PREFIX:]] = value
        event["level"] = level
        event["timestamp"] = _iso(time.time_ns())  # _stamp(), inline: one call a line fewer
        self.write(event, cut=True)

    def write(self, event: MutableMapping[str, Any], cut: bool) -> None:
        """Render the exception if any, cut (when asked) and scrub every field, encode and write the line.

        The usual line has nothing to cut or scrub, and its JSON says so: no longer than
        FIELD_MAX (no string field in it is longer) and nothing ``redact`` would hide. It
        is written as first encoded; any other line is cut and scrubbed field by field.
        """
        if "_record" in event or "_from_structlog" in event:
            event.pop("_record", None)
            event.pop("_from_structlog", None)
        if "exc_info" in event:
            event = _dicts(None, "", event)
        as_json = self._encode(event)
        if (cut and len(as_json) > FIELD_MAX) or may_hold_secret(as_json):
            as_json = self._scrubbed(event, cut)
        SINK.write(as_json if self._plain else self.line(event, as_json), as_json)

    def _scrubbed(self, event: MutableMapping[str, Any], cut: bool) -> str:
        """Cut (when asked) and scrub every field of event in place; return its JSON."""
        for key, value in event.items():  # only values change: safe while iterating
            cls = value.__class__
            if cls is str and cut and key in _OWN:  # a library's line (not cut) may carry anything in its event
                continue
            if cls is str:
                if cut and len(value) > FIELD_MAX:
                    value = _cut(value)
                event[key] = redact(value)
            elif cls not in _SCALARS:
                if cut and isinstance(value, str) and len(value) > FIELD_MAX:
                    value = _cut(value)
                value = scrub(value)
                if cut and not isinstance(value, str):  # a mapping or list (an agent's usage): cut as its JSON text
                    text = self._encode(value)
                    if len(text) > NESTED_MAX:
                        value = _cut(text, NESTED_MAX)
                event[key] = value
        as_json = self._encode(event)
        return self._fit(event, as_json) if cut and len(as_json) > LINE_MAX else as_json

    def _fit(self, event: MutableMapping[str, Any], as_json: str) -> str:
        """Cut the longest fields further until the line's JSON fits LINE_MAX; return it.

        Characters are cut by what they cost encoded (a quote or a control character takes
        two to six bytes), so that fields cut by characters alone, or several long ones
        together, still make one journald line.
        """
        for _ in range(len(event)):
            if len(as_json) <= LINE_MAX:
                break
            sizes = {key: len(self._encode(value)) for key, value in event.items() if key not in _OWN}
            if not sizes:
                break
            key = max(sizes, key=lambda k: sizes[k])
            value = event[key]
            text = value if isinstance(value, str) else self._encode(value)
            per_char = sizes[key] / max(1, len(text))
            over = len(as_json) - LINE_MAX + 64  # and the cut's own note
            event[key] = _cut(text, max(0, len(text) - int(over / per_char) - 1))
            as_json = self._encode(event)
        return as_json

    def line(self, event: Mapping[str, Any], as_json: str) -> str:
        """Return the stdout line of an event: console text, JSON with the journal's priority, or JSON."""
        if self._console:
            return format_line(event)
        if self._journal:
            return f"<{PRIORITY.get(str(event.get('level')), 6)}>{as_json}"
        return as_json

    def __call__(self, logger: Any, name: str, event: MutableMapping[str, Any]) -> NoReturn:
        """Write the event as structlog's processor chain (``log()`` and the async methods come this way)."""
        self.emit(_LEVEL_NAMES.get(name, name), event)
        raise structlog.DropEvent


def relay(json_line: str) -> None:
    """Write a command's JSON log line on this daemon's stdout, in its format (the command wrote log_file)."""
    try:
        event = json.loads(json_line)
    except ValueError:
        return
    if isinstance(event, dict) and _renderer is not None:
        SINK.write_console(_renderer.line(event, json_line.strip()))


def _interpolate(event: str, args: tuple[Any, ...]) -> str:
    """Return event % args as structlog's filtering logger does (one non-empty mapping: by name)."""
    if len(args) == 1 and isinstance(args[0], Mapping) and args[0]:
        return event % args[0]
    return event % args


def _level_method(renderer: _Renderer, name: str) -> Callable[..., Any]:
    """Return the logger method for one level: the event dict as structlog builds it, written by renderer.

    While the configured chain is not the renderer alone (a test's
    ``capture_logs`` swaps it in place), the call runs that chain as structlog would.
    """

    def method(self: Any, event: str, *args: Any, **kw: Any) -> Any:
        if args:
            event = _interpolate(event, args)
        procs = self._processors
        if not procs or procs[0] is not renderer:  # the chain was changed (structlog.testing.capture_logs): run it
            return self._proxy_to_logger(name, event, **kw)
        renderer.emit(name, {**self._context, **kw, "event": event})  # bound keys, the call's keys, the event
        return None

    method.__name__ = name
    return method


def _logger_class(renderer: _Renderer, level: int) -> type[Any]:
    """Return structlog's filtering logger for level with its enabled methods writing through renderer directly.

    The methods skip building a processor chain's arguments and the DropEvent
    that ends it; bind, new, log() and the async methods stay structlog's own.
    """
    base = structlog.make_filtering_bound_logger(level)
    methods = {
        name: _level_method(renderer, name)
        for number, name in ((10, "debug"), (20, "info"), (30, "warning"), (40, "error"), (50, "critical"))
        if number >= level
    }
    for alias, name in (("warn", "warning"), ("msg", "info"), ("fatal", "critical")):
        if name in methods:
            methods[alias] = methods[name]
    return type(base.__name__, (base,), methods)


def configure(*, log_file: Path | None = None, console: bool | None = None, level: int = logging.INFO) -> None:
    """Set up structlog and stdlib logging for the daemon and the CLI.

    Raise OSError (and log nothing to a file) when ``log_file`` cannot be opened.
    """
    SINK.open_file(log_file)  # first: a log_file that cannot be opened leaves logging as it was
    if console is None:
        console = SINK.console.isatty() and os.environ.get("DISPATCHER_LOG_FORMAT") != "json"
    global _renderer
    renderer = _renderer = _Renderer(console, journal=not console and is_journal(SINK.console))
    structlog.configure(
        processors=[renderer],
        wrapper_class=_logger_class(renderer, level),
        cache_logger_on_first_use=True,
    )
    handler = logging.Handler()
    handler.emit = lambda record: _stdlib(record, renderer)  # type: ignore[method-assign]
    handler.addFilter(_quiet_watchdog_stop)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)


def configure_for_command() -> None:
    """Log a command's warnings and errors on stderr in the console format of `run` and `logs`.

    Its stdout is the command's answer (JSON for `--json`): log lines never go there.
    """
    SINK.console = sys.stderr
    configure(console=True, level=logging.WARNING)


def _quiet_watchdog_stop(record: logging.LogRecord) -> bool:
    """Drop watchdog's error about events queued while its thread stops (a clean stop, not a fault)."""
    return not (record.name.startswith("watchdog") and "called when the thread is inactive" in record.getMessage())


def _stdlib(record: logging.LogRecord, renderer: _Renderer) -> None:
    event: dict[str, Any] = {"event": record.getMessage(), "logger": record.name}
    event["level"] = record.levelname.lower()
    if record.exc_info:
        event["exc_info"] = record.exc_info
    event["timestamp"] = _stamp()
    renderer.write(event, cut=False)  # a library's line is not cut, as before


_PROXY = type(structlog.get_logger())  # what structlog.get_logger gives: a lazy proxy
_LEVEL_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "msg", "log")


def settle(package: str = "dispatcher") -> None:
    """Resolve the logger of each imported module of package now: its lines then skip structlog's lazy proxy.

    A module's ``log = structlog.get_logger(...)`` is a proxy that looks the logger up at every
    line (``__getattr__``, then ``bind``); the level methods of the configured logger go on the
    proxy itself. For a process configured once (the daemon), after ``configure``: the loggers
    keep this configuration, as ``cache_logger_on_first_use`` keeps it after a first line.
    A module imported later keeps its proxy as it is.
    """
    prefix = package + "."
    for name, module in list(sys.modules.items()):
        proxy: Any = getattr(module, "log", None) if name.startswith(prefix) else None
        if type(proxy) is _PROXY:
            logger = proxy.bind()
            for method in _LEVEL_METHODS:
                setattr(proxy, method, getattr(logger, method))


def get(**bound: Any) -> Any:
    """Return a structlog logger with these keys bound."""
    return structlog.get_logger("dispatcher").bind(**bound)
