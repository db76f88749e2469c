"""A resumed attempt's cost (contract 14): its reported total minus the session's previous total."""

from __future__ import annotations

from typing import Any

import pytest

from dispatcher.job.attempt import record
from dispatcher.job.runner import AgentExit
from dispatcher.spec.jobspec import Attempt


def _exit() -> AgentExit:
    return AgentExit(0, False, None, 1.0, 2.0, 1, b"", b"", False, False, False)


def _ran(n: int, result: dict[str, Any], earlier: list[Attempt], resumed: str | None) -> Attempt:
    return record(n, _exit(), ["agent"], result, earlier, resumed)


def test_an_attempt_that_resumed_and_named_no_session_costs_its_part_only() -> None:
    """Resumed with `resume` (session T1) but its final JSON names no session: still T1's running total."""
    first = _ran(1, {"session_id": "T1", "total_cost_usd": 0.5}, [], None)
    second = _ran(2, {"total_cost_usd": 0.5}, [first], "T1")
    third = _ran(3, {"total_cost_usd": 0.7}, [first, second], "T1")
    assert first.cost_usd == pytest.approx(0.5)
    assert second.cost_usd == pytest.approx(0.0)
    assert third.cost_usd == pytest.approx(0.2)  # after attempt 2's 0.5, not attempt 1's
    assert sum(a.cost_usd or 0.0 for a in (first, second, third)) == pytest.approx(0.7)


def test_an_attempt_that_names_another_session_costs_what_it_reported() -> None:
    """The CLI started a new session (it names another one): nothing to take off."""
    first = _ran(1, {"session_id": "T1", "total_cost_usd": 0.5}, [], None)
    second = _ran(2, {"session_id": "T2", "total_cost_usd": 0.3}, [first], "T1")
    assert second.cost_usd == pytest.approx(0.3)
    assert "resumed_session" not in second.extra


def test_an_attempt_that_did_not_resume_costs_what_it_reported() -> None:
    first = _ran(1, {"session_id": "T1", "total_cost_usd": 0.5}, [], None)
    second = _ran(2, {"session_id": "T1", "total_cost_usd": 0.6}, [first], None)
    assert second.cost_usd == pytest.approx(0.6)
