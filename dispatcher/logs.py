"""Structured logs: one JSON object per line on stdout and in ``log_file``.

One processor chain serves structlog and stdlib records (watchdog's and
filelock's lines come out as the same JSON). JSON when stdout is not a
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
import io
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

import structlog
from structlog.tracebacks import ExceptionDictTransformer

from dispatcher.logview import format_line
from dispatcher.text import redact

_lock = threading.Lock()


class _Sink:
    """Writes each rendered line to stdout and, when set, the log file (reopenable)."""

    def __init__(self) -> None:
        self.console: TextIO = sys.stdout
        self.file: TextIO | None = None

    def open_file(self, path: Path | None) -> None:
        """(Re)open the log file, for logrotate on SIGHUP; raise OSError and keep the old one on failure."""
        new: TextIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            new = path.open("a", buffering=1, encoding="utf-8")
        with _lock:
            old, self.file = self.file, new
        if old is not None:
            old.close()

    def write(self, line: str, json_line: str) -> None:
        with _lock:
            try:
                self.console.write(line + "\n")
                self.console.flush()
            except (OSError, ValueError):
                pass
            if self.file is not None:
                with contextlib.suppress(OSError):
                    self.file.write(json_line + "\n")


SINK = _Sink()


def _timestamper() -> structlog.types.Processor:
    return structlog.processors.TimeStamper(fmt="iso", utc=True)


FIELD_MAX = 8192  # characters of one string field; journald splits lines over 48 KiB


def _cut_fields(logger: Any, name: str, event: dict[str, Any]) -> dict[str, Any]:
    """Cut any string field longer than FIELD_MAX, with a note saying how much was cut."""
    for key, value in event.items():
        if isinstance(value, str) and len(value) > FIELD_MAX:
            event[key] = f"{value[:FIELD_MAX]}... (cut, {len(value) - FIELD_MAX} more characters)"
    return event


_SHARED: list[Any] = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    _timestamper(),
    _cut_fields,
]
_dicts = structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False))


def scrub(value: Any) -> Any:
    """Return value with every credential in its strings shown as ``***`` (dicts and lists walked)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v) for v in value]
    return value


# syslog priorities (RFC 5424) for the journal's `<N>` line prefix (sd-daemon(3))
PRIORITY = {"debug": 7, "info": 6, "notice": 5, "warning": 4, "warn": 4, "error": 3, "exception": 3, "critical": 2}


def is_journal(stream: TextIO) -> bool:
    """Return True when stream is the journal: `$JOURNAL_STREAM` is `dev:inode` of its file (systemd.exec(5)).

    systemd sets the variable for the service's own stdout; a child that
    inherits it with stdout sent elsewhere must not take that for the journal.
    """
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


class _DualRenderer:
    """Render the event as JSON for the file, and as JSON (journal: with its priority) or console text for stdout."""

    def __init__(self, console: bool, journal: bool) -> None:
        self._json = structlog.processors.JSONRenderer(sort_keys=False)
        self._console = console
        self._journal = journal

    def __call__(self, logger: Any, name: str, event: Any) -> str:
        event.pop("_record", None)
        event.pop("_from_structlog", None)
        event = scrub(_dicts(logger, name, event))
        as_json = str(self._json(logger, name, event))
        if self._console:
            line = format_line(event)
        elif self._journal:
            line = f"<{PRIORITY.get(str(event.get('level')), 6)}>{as_json}"
        else:
            line = as_json
        SINK.write(line, as_json)
        raise structlog.DropEvent


def configure(*, log_file: Path | None = None, console: bool | None = None, level: int = logging.INFO) -> None:
    """Set up structlog and stdlib logging for the daemon and the CLI.

    Raise OSError (and log nothing to a file) when ``log_file`` cannot be opened.
    """
    SINK.open_file(log_file)  # first: a log_file that cannot be opened leaves logging as it was
    if console is None:
        console = SINK.console.isatty() and os.environ.get("DISPATCHER_LOG_FORMAT") != "json"
    renderer = _DualRenderer(console, journal=not console and is_journal(SINK.console))
    structlog.configure(
        processors=[*_SHARED, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
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


def _stdlib(record: logging.LogRecord, renderer: _DualRenderer) -> None:
    event: dict[str, Any] = {"event": record.getMessage(), "logger": record.name}
    event["level"] = record.levelname.lower()
    if record.exc_info:
        event["exc_info"] = record.exc_info
    _timestamper()(None, "", event)
    with contextlib.suppress(structlog.DropEvent):
        renderer(None, record.levelname.lower(), event)


def get(**bound: Any) -> Any:
    """Return a structlog logger with these keys bound."""
    return structlog.get_logger("dispatcher").bind(**bound)
