"""Parse and validate work orders (contract section 2).

An order is untrusted input: it is size-limited, parsed with the strict loader,
checked against ``schemas/order.schema.json`` and then against the rules a
schema cannot say (unique item ids, a known agent, the timeout ceiling). It can
never choose a command to run: it only names an agent from the config.
"""

from __future__ import annotations

import json
import json.scanner
import re
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Any

from dispatcher.errors import OrderError
from dispatcher.fsutil import json_text, plain_rel
from dispatcher.spec import schema
from dispatcher.spec.loader import decode, load_document, load_yaml
from dispatcher.spec.order import Accept, Order
from dispatcher.text import describe

ORDER_SUFFIXES = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}
# (text, index) -> (value, end), StopIteration where no value starts: json.loads without its wrappers
_scan_json: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def order_format(name: str) -> str | None:
    """Return 'json' or 'yaml' for a work-order file name, None for anything else.

    The suffix is matched as the contract writes it (``x.JSON`` is not a work order).
    """
    return ORDER_SUFFIXES.get(suffix_of(name))


def suffix_of(name: str) -> str:
    """Return ``PurePosixPath(name).suffix``; a plain file name (no ``/``) is read without making a Path."""
    if "/" in name:
        return PurePosixPath(name).suffix
    i = name.rfind(".")
    return name[i:] if 0 < i < len(name) - 1 else ""


def parse_order(
    data: bytes,
    name: str,
    *,
    agents: Container[str] | None = None,
    max_timeout_s: float | None = None,
    max_bytes: int | None = None,
    load: Callable[[bytes, str], Any] = load_document,
    fmt: str | None = None,
) -> Order:
    """Parse and validate one work order; raise OrderError naming the file and field.

    ``name`` is the file name (it picks the format by its suffix and is named in
    errors; ``fmt``: its ``order_format``, when the caller has it). ``agents`` are the
    agent names of the config; with None, ``to`` is not checked against it
    (``dispatcher validate`` without a config). ``load`` parses the document
    (``orderchild.load_apart``: in a child process).
    """
    try:
        fmt = fmt or order_format(name)
        if fmt is None:
            raise OrderError("not a work order (the name must end in .yaml, .yml or .json)")
        if max_bytes is not None and len(data) > max_bytes:
            raise OrderError(f"larger than max_order_bytes ({len(data)} > {max_bytes} bytes)")
        body = load(data, fmt)
        return validate_order(body, agents=agents, max_timeout_s=max_timeout_s)
    except OrderError as exc:
        raise exc.with_file(name) from None


def validate_order(
    body: Any,
    *,
    agents: Container[str] | None = None,
    max_timeout_s: float | None = None,
) -> Order:
    """Validate an already parsed order body; raise OrderError naming the field."""
    if not isinstance(body, dict):
        raise OrderError(f"the top level must be a mapping, not {describe(body)}")
    try:
        schema.validate(body, "order")
    except OrderError as exc:
        raise _with_hint(exc, body) from None
    if not body["task"].strip():
        raise OrderError("must not be blank", field="task")
    seen: set[str] = set()
    for i, item in enumerate(body["items"]):
        if item["id"] in seen:
            raise OrderError(f"duplicate item id '{item['id']}'", field=f"items[{i}].id")
        seen.add(item["id"])
    if agents is not None and body["to"] not in agents:
        raise OrderError(f"no agent '{body['to']}' is defined in the config", field="to")
    timeout = body.get("timeout")
    if timeout is not None and max_timeout_s is not None and timeout > max_timeout_s:
        raise OrderError(f"{timeout:.15g} is above max_timeout ({max_timeout_s:.15g})", field="timeout")
    raw_accept = body.get("accept") or {}
    if agents is not None:
        for i, name in enumerate(raw_accept.get("followups", ())):
            if name not in agents:
                raise OrderError(f"no agent '{name}' is defined in the config", field=f"accept.followups[{i}]")
    allowed = raw_accept.get("allowed")
    output = raw_accept.get("output")
    if output is not None and (why := _never_an_output(plain_rel(output))) is not None:
        raise OrderError(why, field="accept.output")
    accept = Accept(
        output=plain_rel(output) if output is not None else None,  # ./out.csv is out.csv, as in writes
        key=raw_accept.get("key", "id"),
        allowed={k: tuple(v) for k, v in allowed.items()} if allowed is not None else None,
        required=tuple(raw_accept.get("required", ())),
        followups=tuple(raw_accept["followups"]) if "followups" in raw_accept else None,
    )
    after: tuple[str, ...] = ()
    after_rule, priority, not_before, expires = "all_done", 5, None, None
    if not _SCHEDULE_KEYS.isdisjoint(body):  # section 16's fields, which most orders leave out: one ask, not seven
        after = tuple(body.get("after") or ())
        if body["job_id"] in after:
            raise OrderError(f"names the order's own job_id {body['job_id']} (a cycle)", field="after")
        after_rule = body.get("after_rule", "all_done")
        priority = body.get("priority", 5)
        not_before = _time(body, "not_before")
        expires = _time(body, "expires")
    writes = body.get("writes")
    return Order(
        job_id=body["job_id"],
        sender=body["from"],
        to=body["to"],
        task=body["task"],
        item_ids=tuple(item["id"] for item in body["items"]),
        accept=accept,
        writes=tuple(plain_rel(w) for w in writes) if writes is not None else None,  # ./x.txt is x.txt
        timeout_s=float(timeout) if timeout is not None else None,
        max_attempts=body.get("max_attempts"),
        body=body,
        after=after,
        after_rule=after_rule,
        priority=priority,
        not_before=not_before,
        expires=expires,
    )


_SCHEDULE_KEYS = frozenset(("after", "after_rule", "priority", "not_before", "expires"))


#: the latest time an order may name: what every later step can still write as an ISO 8601 UTC time
LATEST_TIME = "9999-12-31T23:59:59Z"
LATEST_S = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp()


#: the earliest: 0001-01-01T00:00:00+00:01 is in the year 0 in UTC, which no listing or result could write
EARLIEST_TIME = "0001-01-01T00:00:00Z"
EARLIEST_S = datetime(1, 1, 1, tzinfo=UTC).timestamp()


class TimeOutOfRange(ValueError):
    """An ISO 8601 time that is valid text but lies beyond ``LATEST_TIME`` (or before ``EARLIEST_TIME``) in UTC."""


def parse_time(text: str) -> float:
    """Return epoch seconds for an ISO 8601 time; a time without a zone is UTC. Raise ValueError.

    A time whose UTC moment lies beyond ``LATEST_TIME`` (9999-12-31T23:59:59-12:00 is in the
    year 10000 there) raises ``TimeOutOfRange``: no listing or result could write it.
    """
    moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    seconds = moment.timestamp()
    if seconds >= LATEST_S + 1:  # 23:59:59.999999 of the last day is a float that rounds to the year 10000
        raise TimeOutOfRange(f"is later than {LATEST_TIME}")
    if seconds < EARLIEST_S:
        raise TimeOutOfRange(f"is earlier than {EARLIEST_TIME}")
    return seconds


def time_text_ok(text: str) -> bool:
    """Return True if text has a form the order schema takes for a time (``$defs/time``): calendar dates only."""
    rule = schema.load("order")["$defs"]["time"]
    return len(text) <= rule["maxLength"] and schema.matches(rule["pattern"], text)


def _time(body: Mapping[str, Any], key: str) -> float | None:
    text = body.get(key)
    if text is None:
        return None
    try:
        return parse_time(text)
    except TimeOutOfRange as exc:
        raise OrderError(f"{text} {exc}", field=key) from None
    except ValueError:
        raise OrderError("must be an ISO 8601 time such as 2026-12-01T08:00:00Z", field=key) from None


def _with_hint(exc: OrderError, body: dict[str, Any]) -> OrderError:
    """Add a quoting hint when YAML read a scalar as a number or boolean."""
    if "must be a string, not" in exc.message and not exc.message.endswith("null"):
        return OrderError(exc.message + " (in YAML, quote the value)", field=exc.field)
    return exc


def to_json(body: Mapping[str, Any]) -> bytes:
    """Return an order body as the JSON bytes written to work/order.json."""
    return (json_text(body) + "\n").encode()  # json.dumps(body, ensure_ascii=False), its encoder made directly


# a line of a block-style top-level key (``\r?``: a file saved with CRLF line ends)
_TOP_PRIORITY = re.compile(rb"^priority:[ \t]*(?:!!int[ \t]+)?[\"']?\+?([0-9])[\"']?[ \t]*(?:#.*)?\r?$", re.M)
_TOP_AFTER = re.compile(rb"^after:", re.M)
_TOP_TO = re.compile(rb"^to:[ \t]*[\"']?([^\s\"'#]+)[\"']?[ \t]*(?:#.*)?\r?$", re.M)
_TOP_NOT_BEFORE = re.compile(rb"^not_before:[ \t]*[\"']?([0-9][0-9T:.,+Zz -]*?)[\"']?[ \t]*(?:#.*)?\r?$", re.M)
_TOP_EXPIRES = re.compile(rb"^expires:[ \t]*[\"']?([0-9][0-9T:.,+Zz -]*?)[\"']?[ \t]*(?:#.*)?\r?$", re.M)
_TOP_LINES = (  # the lines the glance reads, in the order peek_schedule takes them
    (b"priority:", _TOP_PRIORITY),
    (b"not_before:", _TOP_NOT_BEFORE),
    (b"after:", _TOP_AFTER),
    (b"to:", _TOP_TO),
    (b"expires:", _TOP_EXPIRES),
)
_NOT_BLOCK = re.compile(rb"^[\"'{]", re.M)  # a line that opens a quoted key or a flow mapping: parsed instead
GLANCE_PARSE_MAX = 16 * 1024  # such a YAML order is parsed for its glance up to this size (about 3 ms)


#: the files of work/ the daemon gives every job, or reads as something else: no output can pass its checks there
_GIVEN = {
    "order.json": "the order the daemon gives the agent",
    "receipt.json": "the receipt",
}


def _never_an_output(path: str) -> str | None:
    """Return why ``accept.output`` can never pass its checks (a file the daemon gives, or outbox/), or None."""
    if path in _GIVEN:
        return f"{path} is {_GIVEN[path]}, never the output"
    if path == "outbox" or path.startswith("outbox/"):
        return f"{path} lies in outbox/, where only follow-up orders go"
    return None


def deferred_until(not_before: float | None, expires: float | None, now: float) -> float | None:
    """Return when an order not due yet is looked at again: its not_before, or its expires when that comes first
    (it is refused then, section 16); None for an order due now, or one already expired (refused now)."""
    if not_before is None or not_before <= now or (expires is not None and expires <= now):
        return None
    return not_before if expires is None else min(not_before, expires)


@dataclass(frozen=True, slots=True)
class Glance:
    """What the inbox needs of an order before it is read for real: its priority, due time, if it joins, its agent."""

    priority: int = 5
    not_before: float | None = None
    joins: bool = False  # it names `after`: claimed at once, without waiting for a free slot
    agent: str = ""  # `to` as it looks at a glance (a hint: a gated agent's order is left unread)
    expires: float | None = None  # when an order left unread for a gate is read again, to be refused


def _top(data: bytes, key: bytes, pattern: re.Pattern[bytes]) -> re.Match[bytes] | None:
    """Return pattern's match on the first line that starts with key and matches it, else None.

    The same answer as ``pattern.search(data)`` for a pattern anchored at a line's start
    with that key, found with byte searches instead of a regex scan of the whole file:
    a 1 MB YAML order is glanced at in under 2 ms instead of 50.
    """
    needle = b"\n" + key
    at = 0 if data.startswith(key) else data.find(needle) + 1
    if at == 0 and not data.startswith(key):
        return None
    while True:
        end = data.find(b"\n", at)
        found = pattern.match(data, at, len(data) if end < 0 else end)
        if found is not None or end < 0:
            return found
        at = data.find(needle, end) + 1
        if at == 0:
            return None


def _yaml_glance(data: bytes) -> dict[str, Any] | None:
    """Return a small YAML order's top-level mapping (strictly parsed: no aliases), or None."""
    try:
        body = load_yaml(decode(data))
    except (OrderError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _json_glance(data: bytes, *, strict: bool = False) -> dict[str, Any] | None:
    """Return the JSON object data holds, scanned alone (without json.loads's wrappers), or None.

    ``strict``: a .json file, whose errors go to the caller (the glance then keeps its defaults).
    """
    try:
        text = data.decode()  # a glance: the JSON scanner alone, without json.loads's wrappers
        body = _scan_json(text, len(text) - len(text.lstrip(" \t\r\n")))[0]
    except (ValueError, StopIteration, RecursionError):
        if strict:
            raise
        return None
    return body if type(body) is dict else None  # the scanner makes plain dicts, str and int: type tells


def _first_quote(data: bytes) -> int:
    """Return where data's first quote is (len(data) if none): a top-level-looking line after it may
    continue a quoted scalar (``task: "first part`` then ``to: b"``), not start a key."""
    quotes = [at for at in (data.find(b'"'), data.find(b"'")) if at >= 0]
    return min(quotes) if quotes else len(data)


def peek_schedule(data: bytes, name: str) -> Glance:
    """Return an order file's priority, not_before, `after`, `to` and expires, at a glance (never raises).

    JSON is parsed; YAML is looked at line by line (top-level ``priority:``,
    ``not_before:``, ``after:``, ``to:`` and ``expires:`` in block style), or parsed when
    it is small and written otherwise (a flow mapping, quoted keys, a time after a quote).
    Only ordering uses this: the daemon checks the validated order again before it claims.
    A not_before the line scan cannot trust (a quote before it: the line may continue a
    quoted scalar) is left out, never made up: the order is then read, and its read defers
    it; so is a ``to`` (the order is read rather than left unread for a gated agent). An
    expires is kept: it only brings the order's read forward to that time. A small order
    with any of these lines after a quote is parsed instead.
    """
    priority, due, joins, agent, expires = 5, None, False, "", None
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]  # a byte-order mark, as decode() takes it off
    try:
        flow = None if name.endswith(".json") or data.lstrip(b" \t\r\n")[:1] != b"{" else _json_glance(data)
        if name.endswith(".json") or flow is not None:  # JSON saved as .yaml too (a flow mapping of any size)
            body = flow if flow is not None else _json_glance(data, strict=True) or {}
            raw_p, raw_t, joins = body.get("priority"), body.get("not_before"), bool(body.get("after"))
            raw_to, raw_e = body.get("to"), body.get("expires")
            agent = raw_to if type(raw_to) is str else ""
        else:
            quote = _first_quote(data)
            p, t, a, to, e = (_top(data, key, pattern) for key, pattern in _TOP_LINES)
            doubtful = any(m is not None and m.start() > quote for m in (p, t, a, to, e))
            small = (
                _yaml_glance(data) if len(data) <= GLANCE_PARSE_MAX and (doubtful or _NOT_BLOCK.search(data)) else None
            )
            if small is not None:  # parsed: written otherwise than the line scan reads
                raw_p, raw_t, joins = small.get("priority"), small.get("not_before"), bool(small.get("after"))
                raw_to, raw_e = small.get("to"), small.get("expires")
                agent = raw_to if type(raw_to) is str else ""
            else:  # a line after a quote is left out, never made up (the order is read, not deferred or left)
                raw_p = int(p.group(1)) if p else None
                raw_t = t.group(1).decode() if t and t.start() < quote else None
                joins = a is not None
                agent = to.group(1).decode("utf-8", "replace") if to and to.start() < quote else ""
                raw_e = e.group(1).decode() if e else None  # a hint only: at that time the order is read for real
        if type(raw_p) is int and 0 <= raw_p <= 9:  # not a bool
            priority = raw_p
        expires = parse_time(str(raw_e)) if isinstance(raw_e, str) else None  # str: an unquoted YAML time too
        if isinstance(raw_t, str):
            due = parse_time(str(raw_t))
    except (ValueError, TypeError, RecursionError, StopIteration):
        pass
    return Glance(priority, due, joins, agent, expires)
