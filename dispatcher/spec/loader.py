"""Parse untrusted YAML or JSON bytes into plain JSON values, strictly.

``yaml.safe_load`` alone expands aliases (billion laughs), keeps the last of two
duplicate keys, reads dates and sets into values JSON cannot hold, and raises
RecursionError on deep nesting. This loader refuses all of those with an
OrderError that names the field, so that what an order says is what JSON says.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import sys
from typing import Any

import yaml

from dispatcher.errors import OrderError
from dispatcher.spec.yamlfields import field_at, path_of
from dispatcher.text import describe

MAX_DEPTH = 64
_INT_DIGITS_MAX = sys.get_int_max_str_digits() or 4300  # what int() converts (0: no limit set)
_BOM = b"\xef\xbb\xbf"


def decode(data: bytes) -> str:
    """Return data as text: UTF-8, a leading byte-order mark ignored."""
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OrderError(f"not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})") from None


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that refuses anchors, aliases, duplicate keys and deep nesting."""

    def __init__(self, stream: str, *, aliases: bool = False) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = aliases

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        if self._aliases:
            pass
        elif isinstance(event, yaml.AliasEvent):
            raise OrderError(f"YAML aliases are not allowed (*{event.anchor}, line {_line(event)})")
        anchor = getattr(event, "anchor", None)
        if anchor is not None and not self._aliases:
            raise OrderError(f"YAML anchors are not allowed (&{anchor}, line {_line(event)})")
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise OrderError(f"nesting deeper than {MAX_DEPTH} levels (line {_line(event)})")
        try:
            node: yaml.Node | None = super().compose_node(parent, index)
            return node
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        return _construct_mapping(self, node, deep)


class _AtNode(OrderError):
    """An error met while building the value of ``node``, raised again by ``load_yaml`` with its field.

    ``key``: the duplicate key of the mapping ``node``, which is the field at fault.
    """

    def __init__(self, message: str, node: yaml.Node, key: str | None = None) -> None:
        super().__init__(message)
        self.node = node
        self.key = key


def _construct_mapping(loader: yaml.constructor.SafeConstructor, node: yaml.MappingNode, deep: bool) -> dict[Any, Any]:
    """SafeConstructor.construct_mapping, refusing duplicate keys and keys that are not strings."""
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if isinstance(key, YamlTime):
            raise _AtNode(f"mapping key {key} is {key.kind}, not a string (line {line})", node)
        if not isinstance(key, str):
            raise _AtNode(f"mapping key {_shown(key)} is {describe(key)}, not a string (line {line})", node)
        if key in seen:
            raise _AtNode(f"is a duplicate key (line {line})", node, key)
        seen.add(key)
    mapping: dict[Any, Any] = yaml.constructor.SafeConstructor.construct_mapping(loader, node, deep=deep)
    return mapping


class YamlTime(str):
    """An unquoted YAML date or time, kept as its text: a value only where the contract takes a time."""

    kind: str  # "date" or "datetime", as YAML read it


#: top-level order fields that take an ISO 8601 time, where an unquoted YAML time is welcome
TIME_FIELDS = frozenset({"not_before", "expires"})


def _timestamp(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    """An unquoted YAML date or time as its text (YamlTime); an impossible one (month 13) is an OrderError."""
    assert isinstance(node, yaml.ScalarNode)  # noqa: S101 - the timestamp tag is resolved on scalars only
    try:
        moment = yaml.constructor.SafeConstructor.construct_yaml_timestamp(loader, node)
    except (ValueError, OverflowError) as exc:
        # Python's own words may hold its notation (``datetime.timedelta(days=1, ...)``): not for a person
        said = str(exc)
        why = f": {said}" if "(" not in said else " (an offset from UTC is at most 23:59)" if "offset" in said else ""
        line = node.start_mark.line + 1
        raise _AtNode(f"{node.value} is not a valid date or time{why} (line {line})", node) from None
    text = YamlTime(node.value)
    text.kind = type(moment).__name__
    return text


def _integer(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    """A YAML integer; one with more digits than Python converts (``sys.get_int_max_str_digits``) is an OrderError."""
    assert isinstance(node, yaml.ScalarNode)  # noqa: S101 - the int tag is resolved on scalars only
    why = _too_long(str(node.value))
    if why is not None:
        raise _AtNode(f"{why} (line {node.start_mark.line + 1})", node)
    return yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)


def _too_long(number: str) -> str | None:
    """Say why an integer's text is more than int() converts, or None: the one length rule of every parse here."""
    if len(number) <= _INT_DIGITS_MAX:
        return None  # the usual case: no count
    digits = sum(c.isdigit() for c in number)
    return f"a number of {digits} digits is too long (at most {_INT_DIGITS_MAX})" if digits > _INT_DIGITS_MAX else None


def _shown(key: Any) -> str:
    """Return a mapping key as YAML or JSON writes it (null, true, 2024-01-01), never in Python notation."""
    if isinstance(key, str):
        return repr(key)
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    if isinstance(key, (datetime.date, datetime.datetime)):
        return key.isoformat()
    return json.dumps(key, default=str, ensure_ascii=False)


def _line(event: yaml.Event) -> int:
    mark = event.start_mark
    return mark.line + 1 if mark is not None else 0


class _StrictCLoader(yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader):  # type: ignore[misc]
    """libyaml's parser with the strict constructor: duplicate and non-string keys refused."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        return _construct_mapping(self, node, deep)


def _check_events(text: str, *, aliases: bool, loader: Any = yaml.SafeLoader) -> None:
    """Refuse anchors, aliases and deep nesting by scanning the parser's events (no tree is built).

    The field of an anchor or alias is named (``yamlfields.field_at``, a second scan made only then).
    """
    depth = 0
    for n, event in enumerate(yaml.parse(text, Loader=loader)):
        if not aliases:
            if isinstance(event, yaml.AliasEvent):
                message = f"YAML aliases are not allowed (*{event.anchor}, line {_line(event)})"
                raise OrderError(message, field=field_at(text, loader, n))
            anchor = getattr(event, "anchor", None)
            if anchor is not None:
                message = f"YAML anchors are not allowed (&{anchor}, line {_line(event)})"
                raise OrderError(message, field=field_at(text, loader, n))
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise OrderError(f"nesting deeper than {MAX_DEPTH} levels (line {_line(event)})")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def load_yaml(text: str, *, aliases: bool = False) -> Any:
    """Parse one YAML document strictly; more than one document is an error.

    Anchors and aliases are refused unless ``aliases`` (the trusted config allows them).
    Parsed by libyaml when PyYAML has it (10 to 30 times faster: a 5 KB order in 1 ms
    instead of 26), under the same rules; a document with ``\\u`` escapes stays with
    PyYAML's own parser, which reads an escaped lone surrogate as text, so that the
    error names the field that holds it.
    """
    fast = yaml.__with_libyaml__ and "\\u" not in text and "\\U" not in text
    try:
        _check_events(text, aliases=aliases, loader=yaml.CSafeLoader if fast else yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise OrderError(f"not valid YAML: {_yaml_problem(exc)}") from None
    loader: yaml.SafeLoader = _StrictCLoader(text) if fast else _StrictLoader(text, aliases=aliases)
    try:
        if not loader.check_node():
            raise OrderError("empty document")
        node = loader.get_node()
        if loader.check_node():
            raise OrderError("more than one YAML document")
        if node is None:
            raise OrderError("empty document")
        try:
            value = loader.construct_document(node)
        except _AtNode as exc:
            field = path_of(node, exc.node)
            if exc.key is not None:
                field = f"{field}.{exc.key}" if field else exc.key
            raise OrderError(exc.message, field=field or None) from None
    except yaml.YAMLError as exc:
        raise OrderError(f"not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise OrderError(f"nesting deeper than {MAX_DEPTH} levels") from None
    finally:
        loader.dispose()
    check_json_value(value)
    return value


def _yaml_problem(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return str(problem)


class _Refused:
    """A value the strict JSON parse met but may not keep: its message, raised with the field by ``check_json_value``.

    The parser's hooks see a mapping or a constant without knowing where it is, so they
    leave this mark in its place and the walk after the parse names the field.
    """

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        out[key] = _Refused("is a duplicate key") if key in out else value
    return out


def _no_constant(name: str) -> Any:
    return _Refused(f"{name} is not a JSON value")


class _Marked(Exception):
    """Raised by the shared decoder's hooks where the full parse of ``load_json`` must judge the document."""


def _pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(items)
    if len(out) != len(items):
        raise _Marked
    return out


def _constant(name: str) -> Any:
    raise _Marked


def _number(digits: str) -> float:
    value = float(digits)
    if not math.isfinite(value):
        raise _Marked
    return value


def _integer_digits(digits: str) -> int:
    if len(digits) > _INT_DIGITS_MAX:
        raise _Marked
    return int(digits)


#: one decoder for every document: its hooks stop at anything the full parse would mark (a duplicate key,
#: a constant, an infinite float, a number too long)
_DECODER = json.JSONDecoder(
    object_pairs_hook=_pairs, parse_constant=_constant, parse_float=_number, parse_int=_integer_digits
)


def load_json(text: str) -> Any:
    """Parse JSON strictly: no duplicate keys, no NaN or Infinity, bounded nesting.

    The usual document (no leading white space, nothing refused) is read once by a decoder
    made at import; anything else is parsed again by ``_load_json_marked``, which words
    every error.
    """
    try:
        value, end = _DECODER.raw_decode(text)
    except (_Marked, ValueError, RecursionError):
        return _load_json_marked(text)
    rest = text[end:]
    if rest and rest.strip(" \t\n\r"):
        return _load_json_marked(text)  # Extra data
    # the walk finds nothing in ASCII text without escapes that could make a lone surrogate and fewer
    # brackets than MAX_DEPTH: it runs only where it could name a field
    if not text.isascii() or "\\u" in text or text.count("[") + text.count("{") > MAX_DEPTH:
        check_json_value(value)
    return value


def _load_json_marked(text: str) -> Any:
    """Parse JSON strictly as ``load_json`` does, with a decoder made for this text that marks what it refuses."""
    marked = False  # a hook left a mark (a duplicate key, a constant) or met a float too large to keep

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal marked
        out = dict(items)
        if len(out) == len(items):
            return out
        marked = True
        return _no_duplicates(items)

    def constant(name: str) -> Any:
        nonlocal marked
        marked = True
        return _no_constant(name)

    def number(digits: str) -> float:
        nonlocal marked
        value = float(digits)
        marked = marked or not math.isfinite(value)  # 1e999
        return value

    def integer(digits: str) -> Any:
        nonlocal marked
        why = _too_long(digits)
        if why is None:
            return int(digits)
        marked = True
        return _Refused(why)

    try:
        value = json.loads(
            text, object_pairs_hook=pairs, parse_constant=constant, parse_float=number, parse_int=integer
        )
    except json.JSONDecodeError as exc:
        raise OrderError(f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise OrderError(f"nesting deeper than {MAX_DEPTH} levels") from None
    # the walk finds nothing in ASCII text without escapes that could make a lone surrogate, no mark, and
    # fewer brackets than MAX_DEPTH: it runs only where it could name a field
    if marked or not text.isascii() or "\\u" in text or text.count("[") + text.count("{") > MAX_DEPTH:
        check_json_value(value)
    return value


def check_json_value(value: Any, path: str = "", depth: int = 1) -> None:
    """Raise OrderError if value is nested too deep or holds a non-JSON value.

    A string or mapping key holding a lone surrogate (``"\\ud800"`` in JSON) is
    refused: it cannot be written as UTF-8, so no job could ever record it.
    """
    if depth > MAX_DEPTH and isinstance(value, (dict, list)):  # levels are mappings and lists, the top one first
        raise OrderError(f"nesting deeper than {MAX_DEPTH} levels")
    if type(value) is _Refused:
        raise OrderError(value.message, field=path or None)
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and (bad := lone_surrogate(key)) is not None:
                shown = key.encode("utf-8", "backslashreplace").decode("ascii")
                raise OrderError(f"key '{shown}' {_SURROGATE.format(bad)}", field=path or None)
            check_json_value(item, f"{path}.{key}" if path else key, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_json_value(item, f"{path}[{i}]", depth + 1)
    elif isinstance(value, str):
        if isinstance(value, YamlTime) and path not in TIME_FIELDS:
            raise OrderError(f"a {value.kind} value is not allowed (quote it to make it a string)", field=path or None)
        if (bad := lone_surrogate(value)) is not None:
            raise OrderError(_SURROGATE.format(bad), field=path or None)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise OrderError(f"{value} is not a JSON value", field=path or None)
    elif value is not None and not isinstance(value, (str, int, bool)):
        hint = " (quote it to make it a string)" if type(value).__name__ in ("date", "datetime") else ""
        raise OrderError(f"a {type(value).__name__} value is not allowed{hint}", field=path or None)


_SURROGATE = "holds a lone surrogate ({}), which cannot be written as UTF-8"


def lone_surrogate(text: str) -> str | None:
    """Return the first lone surrogate of text as an escape (``\\ud800``), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"\\u{ord(text[exc.start]):04x}"
    return None


def load_document(data: bytes, fmt: str, *, aliases: bool = False) -> Any:
    """Parse data as 'json' or 'yaml' into plain JSON values.

    In YAML an unquoted basic-format date in a top-level time field (``not_before:
    20300101``), a number to YAML, is read as the text it is (README: quoted or not).
    """
    text = decode(data)
    if fmt == "json":
        return load_json(text)
    body = load_yaml(text, aliases=aliases)
    if isinstance(body, dict):
        _basic_dates_as_text(body)
    return body


def _basic_dates_as_text(body: dict[Any, Any]) -> None:
    """Read an unquoted basic-format date (``not_before: 20300101``), a number to YAML, as the text it is."""
    for key in TIME_FIELDS:
        value = body.get(key)
        if type(value) is int and 10_000_000 <= value <= 99_999_999:
            body[key] = str(value)


def read_job_id(data: bytes, fmt: str) -> str | None:
    """Return the top-level ``job_id`` string of a document the strict rules refused, if a plain parse reads one.

    For a refused file's result.json: a date or a duplicate key elsewhere in the file
    does not hide the id it names. None when the document does not parse even so.
    """
    return read_names(data, fmt)[0]


def read_names(data: bytes, fmt: str) -> tuple[str | None, str | None]:
    """Return the top-level ``job_id`` and ``to`` strings of a refused document, as a plain parse reads them.

    YAML that no parse reads (an escape of a lone surrogate, an alias never defined): its
    one top-level `job_id:` (and `to:`) line, if it holds a plain name, still says which job
    was refused, for whom.
    """
    try:
        text = decode(data)
    except (OrderError, ValueError):
        return None, None
    try:
        body = json.loads(text, parse_int=_plain_int) if fmt == "json" else yaml.load(text, Loader=_PlainLoader)  # noqa: S506
    except (OrderError, ValueError, yaml.YAMLError, RecursionError):
        if fmt != "yaml":
            return None, None
        ids, tos = _JOB_ID_LINE.findall(text), _TO_LINE.findall(text)
        return (ids[0][1] if len(ids) == 1 else None), (tos[0][1] if len(tos) == 1 else None)
    if not isinstance(body, dict):
        return None, None
    job_id, to = body.get("job_id"), body.get("to")
    return (
        job_id if isinstance(job_id, str) and lone_surrogate(job_id) is None else None,
        to if isinstance(to, str) and lone_surrogate(to) is None else None,
    )


_JOB_ID_LINE = re.compile(r"""^job_id:[ \t]*(["']?)([A-Za-z0-9][A-Za-z0-9._-]{0,127})\1[ \t]*(?:#.*)?$""", re.MULTILINE)
_TO_LINE = re.compile(r"""^to:[ \t]*(["']?)([A-Za-z0-9][A-Za-z0-9._-]{0,127})\1[ \t]*(?:#.*)?$""", re.MULTILINE)


def _text(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    """A plain ``=`` or ``<<`` as a value: YAML 1.1's "value" and "merge" types, which no safe loader constructs
    there, read as the text they are."""
    assert isinstance(node, yaml.ScalarNode)  # noqa: S101 - the value tag is resolved on scalars only
    return str(node.value)


for _loader in (_StrictLoader, _StrictCLoader):
    _loader.add_constructor("tag:yaml.org,2002:value", _text)
    _loader.add_constructor("tag:yaml.org,2002:merge", _text)  # `<<` as a value is text too
    _loader.add_constructor("tag:yaml.org,2002:timestamp", _timestamp)
    _loader.add_constructor("tag:yaml.org,2002:int", _integer)


def _plain_int(digits: str) -> Any:
    """A JSON integer as the plain parse reads it; one longer than int() converts is 0 (never a job_id either way)."""
    return 0 if _too_long(digits) else int(digits)


def _plain_yaml_int(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    """A YAML integer as the plain parse reads it (``_plain_int``'s rule)."""
    assert isinstance(node, yaml.ScalarNode)  # noqa: S101 - the int tag is resolved on scalars only
    return 0 if _too_long(str(node.value)) else yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)


class _PlainLoader(yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader):  # type: ignore[misc]
    """The safe loader with timestamps read as text: only used to find a refused file's job_id."""


_PlainLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.constructor.SafeConstructor.construct_yaml_str)
_PlainLoader.add_constructor("tag:yaml.org,2002:int", _plain_yaml_int)
_PlainLoader.add_constructor("tag:yaml.org,2002:value", _text)
_PlainLoader.add_constructor("tag:yaml.org,2002:merge", _text)
