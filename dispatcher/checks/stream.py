"""Read an accept.output file record by record into an OutputSummary, in bounded memory.

Read whole and turned into a list of dicts, a 40 MB CSV of tiny rows took the
daemon to gigabytes. Here the file is decoded in chunks and each record is
summarised and dropped at once: memory stays at a few chunks, one record and the
summary, whatever the file's size. One record larger than ``RECORD_MAX``
characters is an error, not an allocation. A ``.json`` list is parsed element by
element with ``JSONDecoder.raw_decode`` over a refilled buffer, never with
``json.loads`` of the whole file; ``.csv`` (with a header row) and ``.jsonl`` are
read a bounded line at a time.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

from dispatcher.checks.facts import Doc
from dispatcher.checks.summary import Summariser
from dispatcher.spec.order import Order

RECORD_MAX = 1 << 20
_RECORD_MAX_TEXT = "1 MiB"
# the csv module's own bound on a field is 128 KiB: a record's bound is RECORD_MAX, counted as it is read
csv.field_size_limit(max(csv.field_size_limit(), RECORD_MAX + 1))
CHUNK = 1 << 16
_WS = re.compile(r"[ \t\n\r]*")
_VALUE_STARTS = frozenset('{"-0123456789tfnNI')
_DECODER = json.JSONDecoder()


class Unusable(Exception):
    """The output cannot be summarised; the message says why, as a detail after the file name."""


class _Capped(io.RawIOBase):
    """The raw bytes of an open file, refused past ``limit`` (a file that grows while read)."""

    def __init__(self, fd: int, limit: int) -> None:
        super().__init__()
        self._fd = fd
        self._left = limit
        self._limit = limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = os.readv(self._fd, [buffer])
        self._left -= n
        if self._left < 0:
            raise Unusable(f"larger than {self._limit} bytes")
        return n

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def summarise_fd(fd: int, fmt: str, order: Order, limit: int) -> Doc:
    """Summarise the open output file fd (``fmt``: csv, json or jsonl); take ownership of fd.

    Return ``Doc(value=OutputSummary)``, or ``Doc(error=...)`` saying why the
    file cannot be used (its detail follows the file's name).
    """
    raw = _Capped(fd, limit)
    summariser = Summariser(order.item_ids, order.accept, text=fmt == "csv")
    newline = None if fmt == "jsonl" else ""  # JSON Lines: any line ending; CSV: the csv module's own
    try:
        with io.TextIOWrapper(io.BufferedReader(raw, CHUNK), encoding="utf-8-sig", newline=newline) as text:
            reader = _csv_records if fmt == "csv" else _jsonl_records if fmt == "jsonl" else _json_records
            for record in reader(text):
                summariser.add(record)
    except Unusable as exc:
        return Doc(error=str(exc))
    except (UnicodeDecodeError, json.JSONDecodeError, csv.Error, RecursionError) as exc:
        return Doc(error=f"cannot be parsed ({exc})")
    except ValueError as exc:  # an integer longer than int() converts (sys.get_int_max_str_digits)
        return Doc(error=f"cannot be parsed ({_int_too_long(exc)})")
    except OSError as exc:
        return Doc(error=f"cannot be read: {exc.strerror}")
    finally:
        raw.close()
    return Doc(value=summariser.result())


def _int_too_long(exc: ValueError) -> str:
    """Say what int() refused, without its advice to the Python programmer."""
    return f"a number has more than {sys.get_int_max_str_digits()} digits" if "digits" in str(exc) else str(exc)


def _too_large(n: int) -> Unusable:
    return Unusable(f"record {n} is larger than {_RECORD_MAX_TEXT}")


def _csv_records(text: io.TextIOBase) -> Iterator[dict[Any, Any]]:
    """Yield the rows of a CSV file with a header row as dicts, as csv.DictReader makes them."""
    pending = n = 0

    def lines() -> Iterator[str]:
        # csv.reader pulls lines until a row is whole: count what one row has pulled.
        nonlocal pending
        readline = text.readline
        while line := readline(RECORD_MAX + 1):
            pending += len(line)
            if pending > RECORD_MAX:
                if n == 0:
                    raise Unusable(f"the header row is larger than {_RECORD_MAX_TEXT}")
                raise _too_large(n)
            yield line

    reader = csv.reader(lines())
    header = next(reader, None)
    if header is None:
        return
    width = len(header)
    pending, n = 0, 1
    for row in reader:
        pending = 0
        if not row:
            continue  # a blank line is no record (DictReader skips it too)
        record: dict[Any, Any] = dict(zip(header, row, strict=False))  # rows may be short or long
        if len(row) > width:
            record[None] = row[width:]
        elif len(row) < width:
            for name in header[len(row) :]:
                record[name] = None
        yield record
        n += 1


def _jsonl_records(text: io.TextIOBase) -> Iterator[dict[Any, Any]]:
    """Yield the objects of a JSON Lines file, one a line; blank lines are skipped."""
    n = lineno = 0
    while line := text.readline(RECORD_MAX + 1):
        lineno += 1
        if len(line) > RECORD_MAX:
            raise _too_large(n + 1)
        if not line.strip():
            continue
        n += 1
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise Unusable(f"cannot be parsed (line {lineno}: {exc.msg}, column {exc.colno})") from None
        except ValueError as exc:
            raise Unusable(f"cannot be parsed (line {lineno}: {_int_too_long(exc)})") from None
        if not isinstance(record, dict):
            raise Unusable("holds a record that is not an object")
        yield record


class _Chars:
    """A window on a text stream: ``buf[pos:]`` is unread; ``more()`` refills it."""

    def __init__(self, text: io.TextIOBase) -> None:
        self.text = text
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.base = 0  # offset in the file of buf[0]
        self.lines = 0  # line breaks before buf[0]
        self.line_start = 0  # offset in the file where the line holding buf[0] starts

    def more(self, want: int = 0) -> bool:
        """Drop what was read, add at least ``want`` characters; return False at the end."""
        if self.eof:
            return False
        done = self.buf[: self.pos]
        breaks = done.count("\n")
        if breaks:
            self.lines += breaks
            self.line_start = self.base + done.rfind("\n") + 1
        self.base += self.pos
        new = self.text.read(max(want, CHUNK))
        self.buf = self.buf[self.pos :] + new
        self.pos = 0
        self.eof = not new
        return bool(new)

    def next_char(self) -> str:
        """Skip JSON whitespace; return the next character, or "" at the end."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def where(self, pos: int) -> str:
        """Return ``line L column C (char P)`` for a position in buf, as json's errors say it."""
        before = self.buf[:pos]
        breaks = before.count("\n")
        start = self.base + before.rfind("\n") + 1 if breaks else self.line_start
        offset = self.base + pos
        return f"line {self.lines + breaks + 1} column {offset - start + 1} (char {offset})"

    def fail(self, message: str, pos: int | None = None) -> Unusable:
        return Unusable(f"cannot be parsed ({message}: {self.where(self.pos if pos is None else pos)})")

    def value(self, n: int) -> Any:
        """Decode the JSON value at pos (record n), refilling while it may go on; move past it."""
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                # Cut off by the buffer's end (an open string, or an error at the very end)?
                cut_off = exc.msg.startswith("Unterminated string") or exc.pos >= len(self.buf) - 6
                if self.eof or not cut_off:
                    raise self.fail(exc.msg, exc.pos) from None
                self._refill(n)
                continue
            except ValueError as exc:
                raise self.fail(_int_too_long(exc)) from None
            if end == len(self.buf) and not self.eof:  # a number or literal may go on
                self._refill(n)
                continue
            if end - self.pos > RECORD_MAX:
                raise _too_large(n)
            self.pos = end
            return value

    def _refill(self, n: int) -> None:
        pending = len(self.buf) - self.pos
        if pending > RECORD_MAX:
            raise _too_large(n)
        self.more(pending)  # doubling: a long record is decoded O(log) times, not once per chunk


def _json_records(text: io.TextIOBase) -> Iterator[dict[Any, Any]]:
    """Yield the objects of a JSON list, element by element."""
    chars = _Chars(text)
    first = chars.next_char()
    if first != "[":
        if first in _VALUE_STARTS:
            raise Unusable("is not a JSON list of objects")
        raise chars.fail("Expecting value")
    chars.pos += 1
    n = 0
    if chars.next_char() == "]":
        chars.pos += 1
    else:
        while True:
            n += 1
            record = chars.value(n)
            if not isinstance(record, dict):
                raise Unusable("holds a record that is not an object")
            yield record
            sep = chars.next_char()
            chars.pos += 1
            if sep == "]":
                break
            if sep != ",":
                raise chars.fail("Expecting ',' delimiter", chars.pos - 1)
            if chars.next_char() == "]":
                raise chars.fail("Expecting value")
    if chars.next_char():
        raise chars.fail("Extra data")
