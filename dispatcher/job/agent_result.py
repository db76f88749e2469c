"""Find the JSON object that ends an agent's stdout (contract section 5: ``agent_result``).

Headless agent CLIs end their stdout with one JSON object, on one line
(``claude -p --output-format json``) or pretty-printed over many. The tail an
attempt keeps is up to a few MiB of text the agent controls, so the search is
bounded: only lines that start with ``{`` at the indentation of the last line
(column 0 for every CLI we know) or at column 0 can open the object, and only the
last few of each are tried. Stdout made of a million ``{"a":[`` lines then costs a few
failed parses, not a million. A line whose ``{`` follows a ``[`` or a ``,`` (the text
before it, blanks aside) is an element of a list far more often than the start of the
final object: such lines are tried after the others, so that an object printed with
its inner objects at column 0 too (``json.dumps(indent=0)``) is found whatever their
number.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import deque
from typing import Any

AGENT_RESULT_MAX = 64 * 1024
AGENT_RESULT_KEYS = (
    "total_cost_usd",
    "session_id",
    "num_turns",
    "is_error",
    "duration_ms",
    "usage",
)
# Each try parses at most the rest of the tail, so the work is at most this many passes over it.
MAX_TRIES = 8


def _finite(text: str) -> float | None:
    """A JSON number beyond a float's range (1e400) is no number to record: null."""
    value = float(text)
    return value if math.isfinite(value) else None


def _integer(text: str) -> int | None:
    """A JSON integer longer than Python converts (``sys.get_int_max_str_digits``) is no number to record: null."""
    try:
        return int(text)
    except ValueError:
        return None


# NaN and Infinity are not JSON, and a number that overflows would print as one: both read as null; so does an
# integer too long to convert, which would otherwise lose the whole object (and its cost)
_DECODER = json.JSONDecoder(parse_float=_finite, parse_int=_integer, parse_constant=lambda _name: None)


def parse_agent_result(tail: bytes) -> dict[str, Any] | None:
    """Return the JSON object that ends stdout, as headless agent CLIs print it, or None.

    The last non-blank text must be one JSON object, on one line or many. An
    object larger than ``AGENT_RESULT_MAX`` bytes keeps only ``AGENT_RESULT_KEYS``.
    The work is linear in the size of ``tail`` whatever it holds.
    """
    text = tail.decode("utf-8", errors="replace").rstrip()
    if not text.endswith("}"):
        return None
    last_line = text[text.rfind("\n") + 1 :]
    indent = last_line[: len(last_line) - len(last_line.lstrip(" \t"))]
    # An object's closing brace sits at the indentation of the line that opens it (pretty
    # printers), or on that very line (one-line objects): inner objects are never candidates.
    # An object opened at column 0 whose later lines are indented (``{"a": 1,\n "b": 2}``) is
    # tried too: its last line's indentation says nothing of where it began.
    starts: set[int] = set()
    for lead in {indent, ""}:
        opener = re.compile(r"(?m)^" + re.escape(lead) + r"\{")
        starts.update(m.end() - 1 for m in opener.finditer(text))
    tops: deque[int] = deque(maxlen=MAX_TRIES)
    elements: deque[int] = deque(maxlen=MAX_TRIES)
    for pos in sorted(starts):  # the text looked back at between two starts is theirs alone: linear
        (elements if _char_before(text, pos) in ("[", ",") else tops).append(pos)
    tried = [*reversed(tops), *reversed(elements)]
    for pos in tried:
        found = _object_at(text, pos)
        if found is not None:
            return found
    # the object's own start was not among the starts tried (it follows a line ending in `,`, and more than
    # MAX_TRIES inner objects open at its indentation): found by its brackets, read back from its end
    start = _start_of_last_object(text)
    if start is not None and start not in tried:
        found = _object_at(text, start)
        if found is not None:
            return found
    if len(last_line) > AGENT_RESULT_MAX:  # one object longer than the tail kept: its start is cut off
        return _keys_of_cut_object(last_line)
    return None


def _object_at(text: str, pos: int) -> dict[str, Any] | None:
    """Return the JSON object that starts at pos if it ends the text (its large form cut to its keys), else None."""
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None
    if end != len(text) or not isinstance(value, dict):
        return None
    if "\\u" in text[pos:]:  # an escape may spell a lone surrogate, which no UTF-8 file can hold
        value = {_whole(k): _whole(v) for k, v in value.items()}
    if len(text[pos:].encode()) > AGENT_RESULT_MAX:
        return {k: value[k] for k in AGENT_RESULT_KEYS if k in value}
    return value


_BRACKETS = re.compile(r'[{}\[\]"]')


def _start_of_last_object(text: str) -> int | None:
    """Return where the object that ends text opens, by its brackets read back from its end (strings skipped), or None.

    Only an object that opens a line (after blanks) and lies within the last ``AGENT_RESULT_MAX`` characters is
    found, so the work stays bounded whatever the text holds: each bracket and quote there is looked at once,
    each backslash before a quote once.
    """
    depth, in_string = 0, False
    scan_from = max(0, len(text) - AGENT_RESULT_MAX)
    for match in reversed(list(_BRACKETS.finditer(text, scan_from))):
        pos, char = match.start(), match.group()
        if char == '"':
            slashes = 0
            while pos - slashes - 1 >= 0 and text[pos - slashes - 1] == "\\":
                slashes += 1
            if slashes % 2 == 0:
                in_string = not in_string
            continue
        if in_string:
            continue
        depth += 1 if char in "}]" else -1
        if depth == 0:
            opens_line = not text[text.rfind("\n", 0, pos) + 1 : pos].strip()
            return pos if char == "{" and opens_line else None
        if depth < 0:
            return None
    return None


def with_cut_start(tail: bytes, result: dict[str, Any] | None, log_path: str, kept: int) -> dict[str, Any] | None:
    """Return result with the keys its object holds before the kept tail, when that object's start was cut off.

    An object longer than the ``kept`` bytes of stdout held in memory (``tail``) starts in
    stdout.log only: ``{"total_cost_usd": 0.5, "padding": "<5 MB>"}`` has its cost there. Its
    start is read from the log (``keys_before_tail``) when the log holds the whole stream; keys
    the tail has win. Anything else: ``result`` as it is.
    """
    end = tail.rstrip()
    if len(tail) < kept or not end.endswith(b"}") or b"\n" in end:
        return result  # the tail holds the whole last line (or no object ends it): nothing was cut off
    head = keys_before_tail(log_path, tail)
    if not head:
        return result
    return {**head, **(result or {})}


def keys_before_tail(log_path: str, tail: bytes, head_max: int = AGENT_RESULT_MAX) -> dict[str, Any] | None:
    """Return ``AGENT_RESULT_KEYS`` from the start of stdout.log's last line, which began before ``tail``, or None.

    Only when the log ends with ``tail`` (the log was not cut by ``max_log_bytes``). The line's
    start is found by reading back from the tail a MiB at a time; its first ``head_max`` bytes
    are read for the keys.
    """
    try:
        fd = os.open(log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        end = size - len(tail)
        if end <= 0 or os.pread(fd, len(tail[-256:]), size - len(tail[-256:])) != tail[-256:]:
            return None
        start = 0
        pos = end
        while pos > 0:
            at = max(0, pos - _BACK_CHUNK)
            newline = os.pread(fd, pos - at, at).rfind(b"\n")
            if newline >= 0:
                start = at + newline + 1
                break
            pos = at
        head = os.pread(fd, min(head_max, end - start), start)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not head.lstrip(b" \t").startswith(b"{"):
        return None
    return _keys_of_cut_object(head.decode("utf-8", errors="replace"), first=True)


_BACK_CHUNK = 1 << 20


def _char_before(text: str, pos: int) -> str:
    """Return the last character before ``pos`` that is not a blank, or "" at the start."""
    i = pos - 1
    while i >= 0 and text[i] in " \t\r\n":
        i -= 1
    return text[i] if i >= 0 else ""


_KEY_AT = {key: re.compile(r'"' + key + r'"\s*:\s*') for key in AGENT_RESULT_KEYS}


def _keys_of_cut_object(line: str, *, first: bool = False) -> dict[str, Any] | None:
    """Return ``AGENT_RESULT_KEYS`` read from the end of an object whose start was cut off, or None.

    A CLI's final JSON of many MB (a long ``result``) keeps its cost all the same: each key's
    last occurrence is decoded where it stands (a key inside a string would have its quotes
    escaped, so it never matches). ``first``: each key's first occurrence, for the object's
    start read apart (``keys_before_tail``).
    """
    out: dict[str, Any] = {}
    for key, pattern in _KEY_AT.items():
        if first:
            hit = pattern.search(line)
            found = deque([hit] if hit else [])
        else:
            found = deque(pattern.finditer(line), maxlen=1)  # its last occurrence
        if not found:
            continue
        try:
            value, _end = _DECODER.raw_decode(line, found[0].end())
        except (ValueError, RecursionError):
            continue
        out[key] = _whole(value)
    return out or None


_LONE = re.compile("[\ud800-\udfff]")


def _whole(value: Any) -> Any:
    """Return value with every lone surrogate (``"\\ud800"``) in its strings and keys made U+FFFD."""
    if isinstance(value, str):
        return _LONE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_whole(k): _whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return value
