"""Check a JSON value against the published JSON Schemas in ``dispatcher/schemas/``.

The schema files are the one definition of the work order, receipt and config
shapes: editors use them for completion, and this module applies them. It
implements the subset of JSON Schema 2020-12 those files use (type, enum,
properties, required, additionalProperties, propertyNames, items, min/maxItems, uniqueItems,
min/maxLength, pattern, minimum, maximum, exclusiveMinimum, $ref, allOf, anyOf), and
stops at the first error so that a user gets one clear line naming the field.
A schema may carry ``x-error``, the message to give when its ``pattern`` fails.

Patterns are matched against the whole string (``^``/``$`` anchored patterns are
applied with ``re.fullmatch``), so a trailing newline never slips past ``$``.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from dispatcher.errors import OrderError
from dispatcher.text import describe

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


def _is_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES[name])


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def validate(value: Any, schema_name: str) -> None:
    """Raise OrderError at the first place value breaks the named schema."""
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
            raise errors[-1]

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
