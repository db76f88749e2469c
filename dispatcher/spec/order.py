"""A validated work order as a typed value (contract section 2); ``orders`` parses and validates."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

LINEAGE_KEYS = ("parent", "hops")


@dataclass(frozen=True, slots=True)
class Accept:
    """The proof that counts for a job (the order's ``accept``)."""

    output: str | None = None
    key: str = "id"
    allowed: Mapping[str, tuple[Any, ...]] | None = None
    required: tuple[str, ...] = ()
    followups: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Order:
    """A validated work order. ``body`` is the order as plain JSON values."""

    job_id: str
    sender: str
    to: str
    task: str
    item_ids: tuple[str, ...]
    accept: Accept
    writes: tuple[str, ...] | None
    timeout_s: float | None
    max_attempts: int | None
    body: Mapping[str, Any]
    after: tuple[str, ...] = ()  # job ids this job waits for (contract section 16)
    after_rule: str = "all_done"
    priority: int = 5
    not_before: float | None = None  # epoch seconds
    expires: float | None = None  # epoch seconds

    @property
    def sets_lineage(self) -> bool:
        """Return True when the file itself set ``parent`` or ``hops``."""
        return any(key in self.body for key in LINEAGE_KEYS)

    def with_body(self, body: Mapping[str, Any]) -> Order:
        """Return this order with another body: ``dataclasses.replace``, without a call per field (once per claim)."""
        values = list(_VALUES(self))
        values[_BODY] = body
        return Order(*values)


_NAMES = [f.name for f in fields(Order)]
_VALUES = operator.attrgetter(*_NAMES)  # every field's value, in the order Order() takes them
_BODY = _NAMES.index("body")
