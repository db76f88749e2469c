"""Log lines for people: the one console format, and reading logs back (`dispatcher logs`).

`format_line` is the only console format: `dispatcher run` on a terminal and
`dispatcher logs` both print events with it. `read_file` follows a log file the
way ``tail -F`` does, across logrotate's rename and copytruncate.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from dispatcher.errors import DispatchError, oneline, printable
from dispatcher.text import escape_bidi, plain

_FIRST = ("timestamp", "level", "event", "job_id", "agent", "exception")
# journald's stream prefix (contract 8); `journalctl -o cat` strips it, a raw capture may not
_PRIORITY = re.compile(r"<[0-7]>")
POLL_S = 0.2
SWITCH_QUIET_S = 1.0  # a rotated file this long without a new line is done with
HEAD_BYTES = 256  # how much of a followed file's first line is kept to see it rewritten


def format_line(event: Mapping[str, Any]) -> str:
    """Return one log event as `time level event job (agent) key=value ...`.

    Values are plain text (`-`, `a, b`, `3`), never Python or JSON notation; a
    mapping value becomes dotted keys (`usage.input_tokens=3`). An exception
    (structlog's dict form) follows as indented traceback lines.
    """
    stamp = str(event.get("timestamp") or "-")
    head = [
        stamp[:23] + ("Z" if len(stamp) > 23 and stamp.endswith("Z") else ""),
        f"{plain(event.get('level')):<7}",
        f"{plain(event.get('event')):<18}",
    ]
    job, agent = event.get("job_id"), event.get("agent")
    if job and agent:
        head.append(f"{plain(job)} ({plain(agent)})")
    elif job or agent:
        head.append(plain(job) if job else f"({plain(agent)})")
    rest = [f"{key}={plain(value)}" for key, value in _flat(event) if key not in _FIRST]
    text = escape_bidi(printable(" ".join(head + rest)))  # `run` on a terminal writes this too, unwrapped
    if event.get("exception"):
        text += "\n" + "\n".join("  " + line for line in _traceback(event["exception"]))
    return text


def _flat(event: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in event.items():
        if isinstance(value, Mapping) and value and not (prefix == "" and key in _FIRST):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _traceback(exc: Any) -> list[str]:
    """Return traceback lines from structlog's exception dicts (or a preformatted string)."""
    if isinstance(exc, str):
        return exc.rstrip("\n").splitlines()
    lines: list[str] = []
    for one in exc if isinstance(exc, list) else [exc]:
        if not isinstance(one, Mapping):
            lines.append(plain(one))
            continue
        lines.append("Traceback (most recent call last):")
        for frame in one.get("frames") or ():
            where = f'File "{frame.get("filename", "?")}", line {frame.get("lineno", "?")}, in {frame.get("name", "?")}'
            lines.append("  " + oneline(where))
        lines.append(oneline(f"{one.get('exc_type', 'Exception')}: {one.get('exc_value', '')}"))
    return lines


def strip_priority(line: str) -> str:
    """Return a line without its trailing newline and without journald's `<N>` priority prefix."""
    text = line.rstrip("\r\n")
    return text[3:] if _PRIORITY.match(text) else text


def parse(line: str) -> tuple[str, dict[str, Any]] | None:
    """Return a log line's JSON text (journald priority prefix removed) and its object, or None."""
    text = strip_priority(line)
    try:
        event = json.loads(text)
    except ValueError:
        return None
    return (text, event) if isinstance(event, dict) else None


def show(lines: Iterable[str], *, job: str | None, as_json: bool, flush: bool, out: IO[str] | None = None) -> int:
    """Print log lines for a person (or, with as_json, the matching JSON lines unchanged); return 0.

    A line that is not JSON is printed as it is when it does not look like JSON
    (a traceback on the journal's stream), and skipped when it does (a write cut
    short), unless a job or JSON output was asked for.
    """
    out = out or sys.stdout
    for line in lines:
        parsed = parse(line)
        if parsed is None:
            text = strip_priority(line)
            if job is None and not as_json and text.strip() and not text.lstrip().startswith("{"):
                out.write(oneline(text) + "\n")
            continue
        raw, event = parsed
        if job is not None and event.get("job_id") != job:
            continue
        out.write((raw if as_json else format_line(event)) + "\n")
        if flush:
            out.flush()
    return 0


def read_stream(stream: IO[bytes]) -> Iterator[str]:
    """Yield the lines of a byte stream (stdin) as text."""
    for raw in stream:
        yield raw.decode("utf-8", "replace")


def read_file(path: Path, *, follow: bool) -> Iterator[str]:
    """Yield the complete lines of a log file; with follow, keep going like ``tail -F``.

    Following waits while the path is missing, starts from the top when the
    file shrank (copytruncate), and moves to a new file at the path (logrotate's
    rename and create) once the old one has been quiet for `SWITCH_QUIET_S`:
    the daemon writes to the old file until logrotate's SIGHUP reaches it, and
    those lines are read too. A line is yielded only once its newline is written.
    """
    f = _open(path)
    if f is None and not follow:
        return
    partial = b""
    head = b""  # the file's first line as read from its top: another one there later means truncated and rewritten
    last_data = time.monotonic()
    try:
        while True:
            if f is None:
                time.sleep(POLL_S)
                f = _open(path)
                continue
            top = f.tell() == 0
            chunk = f.readline()
            if chunk:
                last_data = time.monotonic()
            if top and chunk.endswith(b"\n"):
                head = chunk[:HEAD_BYTES]
            if chunk.endswith(b"\n"):
                yield (partial + chunk).decode("utf-8", "replace")
                partial = b""
                continue
            partial += chunk
            if not follow:
                if partial:
                    yield partial.decode("utf-8", "replace")
                return
            change = _change(f, path, head)
            if change == "replaced" and time.monotonic() - last_data >= SWITCH_QUIET_S:
                f.close()
                f, partial, head = _open(path), b"", b""
            elif change == "truncated":
                f.seek(0)
                partial, head = b"", b""
            else:
                time.sleep(POLL_S)
                if head and os.pread(f.fileno(), len(head), 0) != head:  # truncated and written again meanwhile
                    f.seek(0)
                    partial, head = b"", b""
    finally:
        if f is not None:
            f.close()


def _open(path: Path) -> IO[bytes] | None:
    """Open the log file; None while it is missing. DispatchError (one line) when it cannot be read."""
    try:
        return path.open("rb")
    except FileNotFoundError:
        return None
    except OSError as exc:  # not readable by this user, a folder: said in one line, not a traceback
        raise DispatchError(f"{path}: cannot read: {exc.strerror}") from None


def _change(f: IO[bytes], path: Path, head: bytes = b"") -> str | None:
    """Return 'replaced' (a new file at path), 'truncated' (this file shrank, or its first line is not ``head``
    any more: truncated and written past where it was read to between two looks) or None."""
    mine = os.fstat(f.fileno())
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return None  # renamed away and not made again yet: the writer may still append to the old one
    if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
        return "replaced"
    if mine.st_size < f.tell() or (head and os.pread(f.fileno(), len(head), 0) != head):
        return "truncated"
    return None
