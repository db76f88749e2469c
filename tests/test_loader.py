"""The strict loader on its own: values JSON can hold and UTF-8 can write, nothing else.

`dispatcher validate`, `submit` and the inbox all parse orders through it; the CLI side of
the same rules is in test_validate.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from dispatcher.errors import OrderError
from dispatcher.spec.loader import check_json_value, load_document


def refusal(data: bytes, fmt: str = "json") -> OrderError:
    """Return the OrderError the loader raises for data (failing the test if it raises none)."""
    with pytest.raises(OrderError) as info:
        load_document(data, fmt)
    return info.value


@pytest.mark.parametrize(
    ("text", "field", "escape"),
    [
        ('{"task": "a\\ud800b"}', "task", "\\ud800"),
        ('{"items": [{"id": "R\\udfff"}]}', "items[0].id", "\\udfff"),
        ('{"meta": {"deep": ["ok", "\\udc80"]}}', "meta.deep[1]", "\\udc80"),
        ('{"task": "\\ude00\\ud83d"}', "task", "\\ude00"),
    ],
    ids=["high", "low-in-item-id", "in-a-list", "pair-in-the-wrong-order"],
)
def test_string_with_a_lone_surrogate_is_refused_naming_the_field(text: str, field: str, escape: str) -> None:
    """A JSON string escape that leaves a lone surrogate is an error naming the field and the escape."""
    exc = refusal(text.encode())
    assert exc.field == field
    assert exc.reason == f"{field}: holds a lone surrogate ({escape}), which cannot be written as UTF-8"


def test_mapping_key_with_a_lone_surrogate_is_refused() -> None:
    """A key holding a lone surrogate is refused; the error names the mapping and shows the key escaped."""
    exc = refusal(b'{"meta": {"k\\ud800": 1}}')
    assert exc.field == "meta"
    assert exc.reason == "meta: key 'k\\ud800' holds a lone surrogate (\\ud800), which cannot be written as UTF-8"
    top = refusal(b'{"\\udc80": 1}')
    assert top.field is None and "lone surrogate (\\udc80)" in top.reason


def test_lone_surrogate_in_yaml_is_refused() -> None:
    """YAML's own escape gives the same refusal as JSON's."""
    exc = refusal(b'task: "a \\ud800"\n', "yaml")
    assert exc.reason == "task: holds a lone surrogate (\\ud800), which cannot be written as UTF-8"


def test_error_text_can_be_written_as_utf8() -> None:
    """The error line itself holds no surrogate, so it can be printed and stored in result.json."""
    exc = refusal(b'{"\\ud800\\ud800": "\\udfff"}')
    str(exc).encode("utf-8")


@pytest.mark.parametrize(
    "value",
    ["\U0001f600", "caf\u00e9 \u2603", {"\U0001f600": ["\U0001f600"]}],
    ids=["emoji", "bmp", "emoji-key"],
)
def test_proper_surrogate_pairs_and_other_text_pass(value: Any) -> None:
    """A surrogate pair escape is one character, valid in UTF-8: it loads unchanged."""
    text = json.dumps({"v": value})  # ensure_ascii writes the emoji as a \\ud83d\\ude00 pair
    assert load_document(text.encode(), "json") == {"v": value}
    check_json_value({"v": value})


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("expires: 2026-13-01T00:00:00Z\n", "2026-13-01T00:00:00Z is not a valid date or time"),
        ("meta: {when: 2026-02-30}\n", "2026-02-30 is not a valid date or time"),
        (
            "not_before: 2026-12-05T10:00:00+25:00\n",
            "2026-12-05T10:00:00+25:00 is not a valid date or time (an offset from UTC is at most 23:59)",
        ),
    ],
)
def test_an_impossible_date_is_an_order_error_naming_it(text: str, shown: str) -> None:
    """An unquoted timestamp with month 13, February 30 or an offset of 25 hours is refused in one line, never a
    crash, and in words a person reads (section 7: no Python notation such as `datetime.timedelta(...)`)."""
    with pytest.raises(OrderError) as err:
        load_document(f"job_id: J-1\n{text}".encode(), "yaml")
    assert shown in err.value.reason and "(line 2)" in err.value.reason, err.value.reason
    assert "timedelta" not in err.value.reason


@pytest.mark.parametrize(("key", "shown"), [("~", "null"), ("yes", "true"), ("12", "12"), ("2024-01-01", "2024-01-01")])
def test_a_key_that_is_not_a_string_is_shown_as_yaml_writes_it(key: str, shown: str) -> None:
    """Error text shows a non-string key in YAML/JSON notation (null, true), never Python's (None, True)."""
    with pytest.raises(OrderError) as err:
        load_document(f"meta: {{{key}: 1}}\n".encode(), "yaml")
    assert f"mapping key {shown} is" in err.value.reason, err.value.reason
    assert "None" not in err.value.reason and "True" not in err.value.reason


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ('{"meta": {"k": 1, "k": 2}}', "meta.k", "is a duplicate key"),
        ('{"meta": {"x": [1, {"y": NaN}]}}', "meta.x[1].y", "NaN is not a JSON value"),
        ('{"timeout": Infinity}', "timeout", "Infinity is not a JSON value"),
        ('{"meta": -Infinity}', "meta", "-Infinity is not a JSON value"),
    ],
)
def test_a_duplicate_key_or_a_constant_in_json_names_its_field(text: str, field: str, message: str) -> None:
    """The JSON parser's hooks do not know where they are: the walk after the parse names the field."""
    with pytest.raises(OrderError) as err:
        load_document(text.encode(), "json")
    assert (err.value.field, err.value.message) == (field, message)


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ("task: a\ntask: b\n", "task", "is a duplicate key (line 2)"),
        ("meta:\n  k: 1\n  k: 2\n", "meta.k", "is a duplicate key (line 3)"),
        ("items:\n  - id: a\n  - id: b\n    id: c\n", "items[1].id", "is a duplicate key (line 4)"),
        ("meta:\n  1: a\n", "meta", "mapping key 1 is an integer, not a string (line 2)"),
        (
            "meta: {x: [2026-02-30]}\n",
            "meta.x[0]",
            "2026-02-30 is not a valid date or time: day is out of range for month (line 1)",
        ),
        ("task: &t a\n", "task", "YAML anchors are not allowed (&t, line 1)"),
        ("items:\n  - id: a\n  - &i {id: b}\n", "items[1]", "YAML anchors are not allowed (&i, line 3)"),
        ("meta: {a: [1, {b: 2}], c: *z}\n", "meta.c", "YAML aliases are not allowed (*z, line 1)"),
        ("meta:\n  ? [1]\n  : v\n  w: &w 1\n", "meta.w", "YAML anchors are not allowed (&w, line 4)"),
        ("meta:\n  ? [1]\n  : v\n", "meta", "mapping key [1] is a list, not a string (line 2)"),
        ('task: "caf\\u00e9"\nmeta: {x: 1, x: 2}\n', "meta.x", "is a duplicate key (line 2)"),
        ('task: "caf\\u00e9"\nmeta: {x: &q 1}\n', "meta.x", "YAML anchors are not allowed (&q, line 2)"),
        ("&top\njob_id: J-1\n", None, "YAML anchors are not allowed (&top, line 1)"),
    ],
)
def test_a_duplicate_key_an_anchor_or_a_bad_key_in_yaml_names_its_field(
    text: str, field: str | None, message: str
) -> None:
    """YAML's errors name the field at fault as JSON's do (its line too); one at the top level names none."""
    with pytest.raises(OrderError) as err:
        load_document(text.encode(), "yaml")
    assert (err.value.field, err.value.message) == (field, message)


def test_sixty_four_levels_of_mappings_and_lists_hold_values_at_the_last() -> None:
    """64 nested mappings or lists (the top one counted) are allowed whatever the last holds; 65 are not."""

    def nested(levels: int, inner: Any) -> Any:
        value = inner
        for _ in range(levels - 1):
            value = {"k": value}
        return value

    for inner in ({"k": "v"}, ["v"], {}, []):
        assert load_document(json.dumps(nested(64, inner)).encode(), "json")
        with pytest.raises(OrderError, match="nesting deeper than 64 levels"):
            load_document(json.dumps(nested(65, inner)).encode(), "json")


def test_a_plain_equals_sign_in_yaml_is_the_text_it_is() -> None:
    """`task: =` is the text "=" (YAML 1.1's "value" type, which no safe loader constructs, made it a refusal:
    "could not determine a constructor for the tag 'tag:yaml.org,2002:value'"), as a value and in a list."""
    body = load_document(b"task: =\nitems:\n  - id: =\n", "yaml")
    assert body == {"task": "=", "items": [{"id": "="}]}
    from dispatcher.spec.loader import read_job_id  # a refused file's job_id, read by the plain parse

    assert read_job_id(b"{job_id: J1, task: =}\n", "yaml") == "J1"  # no `job_id:` line for the fallback


def test_a_plain_merge_sign_as_a_value_in_yaml_is_the_text_it_is() -> None:
    """`task: <<` is the text "<<" as a value and in a list (YAML 1.1's merge type, constructed only as a key, made
    it a refusal: "could not determine a constructor for the tag 'tag:yaml.org,2002:merge'")."""
    body = load_document(b"task: <<\nitems:\n  - id: a\n    v: <<\n  - [<<, x]\n", "yaml")
    assert body == {"task": "<<", "items": [{"id": "a", "v": "<<"}, ["<<", "x"]]}
    from dispatcher.spec.loader import read_job_id

    assert read_job_id(b"{job_id: J1, task: <<}\n", "yaml") == "J1"
