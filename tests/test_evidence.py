"""Gathering evidence from a work/ folder: what is read, and what is deliberately not.

`evidence.gather` and `read_followups` run against real folders on tmp_path, with a
parse function that counts its calls, so that a cost bound is a number a test can see.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dispatcher.checks.builtin import Exit, followups_valid
from dispatcher.checks.evidence import gather, read_followups
from dispatcher.spec.orders import Order, parse_order, validate_order


def fill_outbox(work: Path, n: int) -> None:
    """Write n valid follow-up orders from `worker` into work/outbox/."""
    outbox = work / "outbox"
    outbox.mkdir(parents=True)
    for i in range(n):
        body = {"job_id": f"N{i:05d}", "from": "worker", "to": "worker", "task": "Next.", "items": [{"id": "R1"}]}
        (outbox / f"N{i:05d}.json").write_text(json.dumps(body))


def test_read_followups_parses_at_most_max_followups_plus_one(tmp_path: Path) -> None:
    """With 5,000 files in outbox/ and max_followups 100, only 101 are parsed; every file is still listed."""
    fill_outbox(tmp_path, 5000)
    calls: list[str] = []

    def parse(data: bytes, name: str) -> Order:
        calls.append(name)
        return parse_order(data, name)

    exists, found = read_followups(tmp_path, parse, 1 << 20, 100)
    assert exists is True
    assert len(calls) == 101
    assert len(found) == 5000
    assert [f.order is not None for f, _ in found].count(True) == 101
    left = found[-1][0]
    assert left.order is None and left.error == "not read: more than max_followups (100)"


def test_gather_passes_max_followups_to_the_check(tmp_path: Path) -> None:
    """gather(max_followups=...) reaches followups_valid: 3 follow-ups pass with 3 and fail with 2."""
    fill_outbox(tmp_path, 3)
    order = validate_order({"job_id": "J-1", "from": "tester", "to": "worker", "task": "Go.", "items": [{"id": "R1"}]})
    common: dict[str, Any] = {
        "order": order,
        "agent": "worker",
        "writes": (),
        "exit": Exit(code=0),
        "work": tmp_path,
        "given": {},
        "agents": {"worker"},
        "max_timeout_s": 60.0,
        "max_order_bytes": 1 << 20,
        "known": lambda ids: frozenset(),
        "hops": 0,
        "max_hops": 5,
    }
    ev, _ = gather(**common, max_followups=2)
    assert ev.max_followups == 2
    result = followups_valid(ev)
    assert (result.ok, result.detail) == (False, "3 follow-ups, more than max_followups (2)")
    ev, followups = gather(**common, max_followups=3)
    assert followups_valid(ev).ok is True
    assert len(followups) == 3
    ev, _ = gather(**common)
    assert ev.max_followups == 100
