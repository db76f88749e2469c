"""Structured logs: one JSON object per line on stdout and in ``log_file``.

One processor chain serves structlog and stdlib records (watchdog's and
filelock's lines come out as the same JSON). JSON when stdout is not a
terminal, structlog's ConsoleRenderer when it is. Exceptions are rendered as
dicts without local variables (``show_locals=False``), so no secret held in a
local ends up in the journal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

import structlog
from structlog.tracebacks import ExceptionDictTransformer

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


_SHARED: list[Any] = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    _timestamper(),
]
_dicts = structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False))


class _DualRenderer:
    """Render the event as JSON for the file, and as JSON or console text for stdout."""

    def __init__(self, console: bool) -> None:
        self._json = structlog.processors.JSONRenderer(sort_keys=False)
        self._console = structlog.dev.ConsoleRenderer(colors=False) if console else None

    def __call__(self, logger: Any, name: str, event: Any) -> str:
        event.pop("_record", None)
        event.pop("_from_structlog", None)
        text = self._console(logger, name, dict(event)) if self._console else None
        as_json = str(self._json(logger, name, _dicts(logger, name, event)))
        SINK.write(str(text) if text is not None else as_json, as_json)
        raise structlog.DropEvent


def configure(*, log_file: Path | None = None, console: bool | None = None, level: int = logging.INFO) -> None:
    """Set up structlog and stdlib logging for the daemon and the CLI."""
    if console is None:
        console = sys.stdout.isatty() and os.environ.get("DISPATCHER_LOG_FORMAT") != "json"
    renderer = _DualRenderer(console)
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
    SINK.open_file(log_file)


def _quiet_watchdog_stop(record: logging.LogRecord) -> bool:
    """Drop watchdog's error about events queued while its thread stops (a clean stop, not a fault)."""
    return not (record.name.startswith("watchdog") and "called when the thread is inactive" in record.getMessage())


def _stdlib(record: logging.LogRecord, renderer: _DualRenderer) -> None:
    event: dict[str, Any] = {"event": record.getMessage(), "logger": record.name}
    event["level"] = record.levelname.lower()
    _timestamper()(None, "", event)
    with contextlib.suppress(structlog.DropEvent):
        renderer(None, record.levelname.lower(), event)


def get(**bound: Any) -> Any:
    """Return a structlog logger with these keys bound."""
    return structlog.get_logger("dispatcher").bind(**bound)
