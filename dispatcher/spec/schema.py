"""Check a JSON value against the published JSON Schemas in ``dispatcher/schemas/``.

The schema files are the one definition of the work order, receipt and config
shapes: editors use them for completion, and this module applies them. It
implements the subset of JSON Schema 2020-12 those files use (type, enum,
properties, required, additionalProperties, propertyNames, items, min/maxItems, uniqueItems,
min/maxLength, pattern, minimum, maximum, exclusiveMinimum, $ref, allOf, anyOf), and
stops at the first error so that a user gets one clear line naming the field.
A schema may carry ``x-error``, the message to give when its ``pattern`` fails.

Patterns are matched against the whole string (``^``/``$`` anchored patterns are
applied with ``re.fullmatch``), so a trailing newline never slips past ``$``. An
``integer`` is written as one: ``2.0`` is a number, not an integer (JSON Schema
would take it), so that ``max_attempts: 1.0`` is refused like ``1.5`` and no
float reaches a count.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from dispatcher.errors import OrderError
from dispatcher.text import describe

_Check = Callable[[Any, str], None]

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "null": (type(None),),
    "integer": (int,),
    "number": (int, float),
}
_TYPE_WORDS = {
    "object": "a mapping",
    "array": "a list",
    "string": "a string",
    "boolean": "true or false",
    "null": "null",
    "integer": "an integer",
    "number": "a number",
}


@cache
def load(name: str) -> dict[str, Any]:
    """Return the parsed schema ``dispatcher/schemas/<name>.schema.json``."""
    data: dict[str, Any] = json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())
    return data


@cache
def _regex(pattern: str) -> re.Pattern[str]:
    if pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[1:-1]
    return re.compile(pattern, re.DOTALL)


def matches(pattern: str, text: str) -> bool:
    """Return True if a schema's ``pattern`` matches text, as the validator reads it."""
    return _regex(pattern).fullmatch(text) is not None


MAX_INT_BITS = 1000  # an integer in a number field beyond this is refused: as a float it would overflow


def _is_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    if name == "integer":
        return isinstance(value, int)  # 2.0 is a number written as one: the contract's integers are written as such
    return isinstance(value, _TYPES[name])


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def validate(value: Any, schema_name: str) -> None:
    """Raise OrderError at the first place value breaks the named schema."""
    _compiled(schema_name)(value, "")


@cache
def _compiled(schema_name: str) -> _Check:
    root = load(schema_name)
    return _Compiler(root).compile(root)


def check_interpreted(value: Any, schema_name: str) -> None:
    """Walk the named schema for value as written (the compiled checks' reference; tests compare the two)."""
    root = load(schema_name)
    _check(value, root, root, "")


def _check(value: Any, schema: dict[str, Any], root: dict[str, Any], path: str) -> None:
    if "$ref" in schema:
        ref = schema["$ref"]
        target: Any = root
        for part in ref.lstrip("#/").split("/"):
            target = target[part]
        _check(value, target, root, path)
    for sub in schema.get("allOf", ()):
        _check(value, sub, root, path)
    if "anyOf" in schema:
        errors: list[OrderError] = []
        for sub in schema["anyOf"]:
            try:
                _check(value, sub, root, path)
                break
            except OrderError as exc:
                errors.append(exc)
        else:
            raise _closest(errors)

    def fail(message: str) -> None:
        raise OrderError(message, field=path or None)

    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(value, n) for n in names):
            wanted = " or ".join(_TYPE_WORDS[n] for n in names)
            fail(f"must be {wanted}, not {describe(value)}")
    if "enum" in schema and value not in schema["enum"]:
        fail("must be one of " + ", ".join(json.dumps(v) for v in schema["enum"]))
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            fail("must not be empty" if schema["minLength"] == 1 else "is too short")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            fail(f"is longer than {schema['maxLength']} characters ({len(value)})")
        if "pattern" in schema and not _regex(schema["pattern"]).fullmatch(value):
            fail(schema.get("x-error", f"must match {schema['pattern']}"))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            fail(f"must be at least {schema['minimum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            fail(f"must be greater than {schema['exclusiveMinimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            fail(f"must be at most {schema['maximum']}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            fail("must not be empty")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            fail(f"has more than {schema['maxItems']} entries ({len(value)})")
        if schema.get("uniqueItems"):
            seen: list[Any] = []
            for item in value:
                if item in seen:
                    fail(f"names {json.dumps(item)} twice")
                seen.append(item)
        if "items" in schema:
            for i, item in enumerate(value):
                _check(item, schema["items"], root, _join(path, i))
    if isinstance(value, dict):
        props: dict[str, Any] = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        if extra is False:
            for key in value:
                if key not in props:
                    raise OrderError("unknown key", field=_join(path, key))
        for key in schema.get("required", ()):
            if key not in value:
                raise OrderError("is required", field=_join(path, key))
        key_schema = schema.get("propertyNames")
        for key, item in value.items():
            if key_schema is not None:
                _check(key, key_schema, root, _join(path, key))
            if key in props:
                _check(item, props[key], root, _join(path, key))
            elif isinstance(extra, dict):
                _check(item, extra, root, _join(path, key))


def _fail(message: str, path: str) -> None:
    raise OrderError(message, field=path or None)


class _Compiler:
    """Turn a schema into nested closures that make only the checks its keywords ask for.

    The checks, their order and their messages are those of ``_check``: a compiled
    check walks the value as ``_check`` walks it, without looking up at every node
    the keywords a schema does not have. Each schema node is compiled once; a
    ``$ref`` is resolved on its first use, so that a schema may refer to itself.
    """

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.done: dict[int, _Check] = {}

    def compile(self, schema: dict[str, Any]) -> _Check:
        """Return the check of one schema node (compiled once per node)."""
        key = id(schema)
        if key not in self.done:
            self.done[key] = self._lazy(schema)
            self.done[key] = self._build(schema)
        return self.done[key]

    def _lazy(self, schema: dict[str, Any]) -> _Check:
        def check(value: Any, path: str) -> None:
            self.done[id(schema)](value, path)

        return check

    def _ref(self, ref: str) -> _Check:
        target: Any = self.root
        for part in ref.lstrip("#/").split("/"):
            target = target[part]
        return self.compile(target)

    def _build(self, schema: dict[str, Any]) -> _Check:
        steps: list[_Check] = []
        if "$ref" in schema:
            steps.append(self._ref(schema["$ref"]))
        steps.extend(self.compile(sub) for sub in schema.get("allOf", ()))
        if "anyOf" in schema:
            steps.append(_any_of([self.compile(sub) for sub in schema["anyOf"]]))
        strings = any(k in schema for k in ("minLength", "maxLength", "pattern"))
        numbers = any(k in schema for k in ("minimum", "exclusiveMinimum", "maximum"))
        lists = any(k in schema for k in ("minItems", "maxItems", "uniqueItems", "items"))
        dicts = any(k in schema for k in ("properties", "additionalProperties", "required", "propertyNames"))
        # `type: string`, `array` or `object` right before the step of its own keywords: one step checks both
        kind = schema.get("type") if "enum" not in schema else None
        typed = (kind == "string" and strings) or (
            not strings and not numbers and ((kind == "array" and lists) or (kind == "object" and dicts and not lists))
        )
        if "type" in schema and not typed:
            steps.append(_type_step(schema["type"]))
        type_check = _type_step(kind) if typed else None
        if "enum" in schema:
            steps.append(_enum_step(schema["enum"]))
        if strings:
            steps.append(_string_step(schema, type_check if kind == "string" else None))
        if numbers:
            steps.append(_number_step(schema))
        if lists:
            items = self.compile(schema["items"]) if "items" in schema else None
            steps.append(_list_step(schema, items, type_check if kind == "array" else None))
        if dicts:
            steps.append(self._dict_step(schema, type_check if kind == "object" else None))
        if not steps:
            return _nothing
        if len(steps) == 1:
            return steps[0]

        def check(value: Any, path: str) -> None:
            for step in steps:
                step(value, path)

        return check

    def _dict_step(self, schema: dict[str, Any], typed: _Check | None = None) -> _Check:
        """Return the check of the mapping keywords; ``typed``: the ``type: object`` check made first."""
        props: dict[str, _Check] = {k: self.compile(v) for k, v in schema.get("properties", {}).items()}
        extra = schema.get("additionalProperties", True)
        closed = extra is False
        extra_check = self.compile(extra) if isinstance(extra, dict) else None
        required = tuple(schema.get("required", ()))
        key_check = self.compile(schema["propertyNames"]) if "propertyNames" in schema else None

        def check(value: Any, path: str) -> None:
            if type(value) is not dict:
                if typed is not None:
                    typed(value, path)
                if not isinstance(value, dict):
                    return
            if closed:
                for key in value:
                    if key not in props:
                        raise OrderError("unknown key", field=_join(path, key))
            for key in required:
                if key not in value:
                    raise OrderError("is required", field=_join(path, key))
            for key, item in value.items():
                # _join(path, key), without its two calls for a string key
                field = (f"{path}.{key}" if path else key) if type(key) is str else _join(path, key)
                if key_check is not None:
                    key_check(key, field)
                sub = props[key] if closed else props.get(key, extra_check)  # closed: every key is in props
                if sub is not None:
                    sub(item, field)

        return check


def _nothing(value: Any, path: str) -> None:
    """The check of a schema without keywords that constrain: every value passes."""


def _any_of(subs: list[_Check]) -> _Check:
    def check(value: Any, path: str) -> None:
        errors: list[OrderError] = []
        for sub in subs:
            try:
                sub(value, path)
                return
            except OrderError as exc:
                errors.append(exc)
        raise _closest(errors)

    return check


def _closest(errors: list[OrderError]) -> OrderError:
    """Return the error of the alternative the value came closest to: the one that failed deepest inside it.

    ``before: [sleep, 1]`` is an argv with a number in it (``before[1]: must be a string``),
    not a mapping that is a list (the last alternative's complaint). Among equals, one whose
    type was right (``before: []``: a list, but an empty one); when no alternative took the
    value's type, one line naming every type that would do (``must be a list or a mapping,
    not a string``), null left out.
    """
    deepest = max(len(e.field or "") for e in errors)
    tied = [e for e in errors if len(e.field or "") == deepest]
    typed = [e for e in tied if _wanted_type(e) is None]
    if typed or len(tied) == 1:
        return (typed or tied)[-1]
    wanted = [w for e in tied if (w := _wanted_type(e)) is not None and w != "null"]
    got = tied[-1].message.rpartition(", not ")[2]
    return OrderError(f"must be {' or '.join(dict.fromkeys(wanted))}, not {got}", field=tied[-1].field)


def _wanted_type(error: OrderError) -> str | None:
    """Return the type words of a type mismatch (``must be a list, not a string``: ``a list``), else None."""
    message = error.message
    if not message.startswith("must be ") or ", not " not in message:
        return None
    wanted = message[len("must be ") : message.rindex(", not ")]
    return wanted if wanted in _TYPE_WORDS.values() or " or " in wanted else None


def _type_step(spec: Any) -> _Check:
    names = spec if isinstance(spec, list) else [spec]
    wanted = " or ".join(_TYPE_WORDS[n] for n in names)
    plain = tuple(t for n in names if n not in ("integer", "number") for t in _TYPES[n])
    numeric = [n for n in names if n in ("integer", "number")]

    def check(value: Any, path: str) -> None:
        if type(value) in plain:
            return
        if any(_is_type(value, n) for n in numeric):
            if type(value) is int and value.bit_length() > MAX_INT_BITS:  # no float holds it: every use would fail
                _fail(f"is too large ({value.bit_length()} bits)", path)
            return
        if isinstance(value, plain):
            return
        _fail(f"must be {wanted}, not {describe(value)}", path)

    return check


def _enum_step(allowed: list[Any]) -> _Check:
    message = "must be one of " + ", ".join(json.dumps(v) for v in allowed)

    def check(value: Any, path: str) -> None:
        if value not in allowed:
            _fail(message, path)

    return check


def _string_step(schema: dict[str, Any], typed: _Check | None = None) -> _Check:
    """Return the check of the string keywords; ``typed``: the ``type: string`` check made first."""
    min_length = schema.get("minLength", 0)
    max_length = schema.get("maxLength")
    regex = _regex(schema["pattern"]) if "pattern" in schema else None
    mismatch = schema.get("x-error", f"must match {schema.get('pattern')}")

    def check(value: Any, path: str) -> None:
        if type(value) is not str:
            if typed is not None:
                typed(value, path)
            if not isinstance(value, str):
                return
        length = len(value)
        if length < min_length:
            _fail("must not be empty" if min_length == 1 else "is too short", path)
        if max_length is not None and length > max_length:
            _fail(f"is longer than {max_length} characters ({length})", path)
        if regex is not None and not regex.fullmatch(value):
            _fail(mismatch, path)

    return check


def _number_step(schema: dict[str, Any]) -> _Check:
    low, above, high = schema.get("minimum"), schema.get("exclusiveMinimum"), schema.get("maximum")

    def check(value: Any, path: str) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return
        if low is not None and value < low:
            _fail(f"must be at least {low}", path)
        if above is not None and value <= above:
            _fail(f"must be greater than {above}", path)
        if high is not None and value > high:
            _fail(f"must be at most {high}", path)

    return check


def _list_step(schema: dict[str, Any], items: _Check | None, typed: _Check | None = None) -> _Check:
    """Return the check of the list keywords; ``typed``: the ``type: array`` check made first."""
    min_items = schema.get("minItems", 0)
    max_items = schema.get("maxItems")
    unique = bool(schema.get("uniqueItems"))

    def check(value: Any, path: str) -> None:
        if type(value) is not list:
            if typed is not None:
                typed(value, path)
            if not isinstance(value, list):
                return
        if len(value) < min_items:
            _fail("must not be empty", path)
        if max_items is not None and len(value) > max_items:
            _fail(f"has more than {max_items} entries ({len(value)})", path)
        if unique:
            seen: list[Any] = []
            for item in value:
                if item in seen:
                    _fail(f"names {json.dumps(item)} twice", path)
                seen.append(item)
        if items is not None:
            for i, item in enumerate(value):
                items(item, f"{path}[{i}]")

    return check
