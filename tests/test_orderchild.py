"""A YAML order over 16 KiB is parsed in a child process: the same value, the same errors, a fallback if it cannot."""

from __future__ import annotations

import json

import pytest

from dispatcher.errors import OrderError
from dispatcher.spec import orderchild
from dispatcher.spec.loader import load_document
from dispatcher.spec.orderchild import APART_YAML_BYTES, load_apart
from dispatcher.spec.orders import parse_order

PAD = b"#" * (APART_YAML_BYTES + 1) + b"\n"
GOOD = (
    b"job_id: BIG-1\nfrom: intake\nto: worker\ntask: Sort the lines.\nitems:\n  - {id: R1, n: 1.5}\n"
    b"accept: {output: out.csv}\nmeta:\n  lines:\n" + b"    - one line, \xc3\xa9 and all\n" * 2000
)
BAD = [
    b"a: &x 1\nb: *x\n",  # anchors are refused
    b"job_id: [\n",  # not YAML
    b"x: 1\nx: 2\n",  # a duplicate key
    b"when: 2026-01-01\n",  # a date is not a JSON value
]


def _no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make an in-process parse in load_apart fail the test: the answer must come from the child."""

    def refuse(data: bytes, fmt: str) -> None:
        raise AssertionError("parsed in process, not in the child")

    monkeypatch.setattr(orderchild, "load_document", refuse)


def test_the_child_gives_the_value_the_daemon_would_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 60 KB order parsed apart equals the same order parsed in process, floats and non-ASCII text included."""
    assert len(GOOD) > APART_YAML_BYTES
    want = load_document(GOOD, "yaml")
    _no_fallback(monkeypatch)
    assert load_apart(GOOD, "yaml") == want


@pytest.mark.parametrize("doc", BAD, ids=["anchor", "not-yaml", "duplicate", "date"])
def test_the_child_refuses_with_the_same_reason(doc: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken large order gets the same refusal reason (and field) from the child as from an in-process parse."""
    with pytest.raises(OrderError) as here:
        load_document(doc + PAD, "yaml")
    _no_fallback(monkeypatch)
    with pytest.raises(OrderError) as apart:
        load_apart(doc + PAD, "yaml")
    assert (apart.value.reason, apart.value.field) == (here.value.reason, here.value.field)


def test_a_large_order_missing_a_field_names_it_either_way() -> None:
    """parse_order through the child names the file and the field at fault, as in process."""
    doc = GOOD.replace(b"task: Sort the lines.\n", b"")
    with pytest.raises(OrderError) as apart:
        parse_order(doc, "BIG-1.yaml", load=load_apart)
    with pytest.raises(OrderError) as here:
        parse_order(doc, "BIG-1.yaml")
    assert str(apart.value) == str(here.value) and "task" in str(apart.value)


def test_a_child_that_cannot_start_leaves_the_parse_to_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no interpreter to start (a shortage, say), the order is parsed in process: the same value."""
    monkeypatch.setattr(orderchild.sys, "executable", "/nonexistent/python3")
    assert load_apart(GOOD, "yaml") == load_document(GOOD, "yaml")


def test_the_child_also_gives_the_values_json_text_byte_for_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_apart_text: the value, and exactly json.dumps(value, ensure_ascii=False), non-ASCII text kept as is."""
    _no_fallback(monkeypatch)
    value, text = orderchild.load_apart_text(GOOD, "yaml")
    assert value == load_document(GOOD, "yaml")
    assert text == json.dumps(value, ensure_ascii=False)
    assert "é" in text


def test_a_parse_in_process_gives_no_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the child cannot run, the value still comes, and no text: the claim encodes it itself."""
    monkeypatch.setattr(orderchild.sys, "executable", "/nonexistent/python3")
    value, text = orderchild.load_apart_text(GOOD, "yaml")
    assert value == load_document(GOOD, "yaml") and text is None
