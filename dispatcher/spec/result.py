"""What a finished job's ``result.json`` holds, as typed values: the ``Result`` and its checks.

``Result.to_json`` writes the keys in the order the contract shows them, then
any other key the file had (older files, a refusal's ``file``), so a result read
and written back keeps everything it said. ``Result.from_json`` never raises: a
value of the wrong type reads as missing, as a reader of a damaged file expects.
Nothing here touches the disk.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dispatcher.clock import parse_iso

KEYS = (
    "job_id", "state", "agent", "reason", "checks", "attempts", "received", "finished",
    "parent", "children", "cost_usd", "chain_cost_usd",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's verdict, as result.json records it."""

    name: str
    ok: bool | None
    detail: str

    def to_json(self) -> dict[str, Any]:
        """Return the check as result.json writes it."""
        return {"name": self.name, "ok": self.ok, "detail": self.detail}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckResult:
        """Rebuild a check (a field of the wrong type reads as empty)."""
        ok = data.get("ok")
        return cls(_str(data.get("name")) or "", ok if isinstance(ok, bool) else None, _str(data.get("detail")) or "")


@dataclass(frozen=True, slots=True)
class Result:
    """A finished job's (or a refused file's) ``result.json``."""

    job_id: str | None
    state: str | None  # done, failed or review (a ledger row's word)
    agent: str | None
    reason: str | None
    checks: tuple[CheckResult, ...] = ()
    attempts: tuple[Mapping[str, Any], ...] = ()  # as attempts/<n>/attempt.json records them
    received: str | None = None  # ISO 8601 UTC times, as written
    finished: str | None = None
    parent: str | None = None
    children: tuple[str, ...] = ()
    cost_usd: float | None = None
    chain_cost_usd: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # any other key, written after these

    @property
    def duration_s(self) -> float | None:
        """Return seconds from received to finished, or None when either is missing or odd."""
        try:
            return round(parse_iso(self.finished or "") - parse_iso(self.received or ""), 3)
        except (TypeError, ValueError):
            return None

    def failed_checks(self) -> list[CheckResult]:
        """Return the checks that failed (what a repair attempt is told)."""
        return [c for c in self.checks if c.ok is False]

    def to_json(self) -> dict[str, Any]:
        """Return the result as plain JSON values, in the order result.json has them."""
        out: dict[str, Any] = {
            "job_id": self.job_id,
            "state": self.state,
            "agent": self.agent,
            "reason": self.reason,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],  # as CheckResult.to_json
            "attempts": [dict(a) for a in self.attempts],
            "received": self.received,
            "finished": self.finished,
            "parent": self.parent,
            "children": list(self.children),
            "cost_usd": self.cost_usd,
            "chain_cost_usd": self.chain_cost_usd,
        }
        out.update((k, v) for k, v in self.extra.items() if k not in out)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Result:
        """Rebuild a result from a result.json body; keys it does not know are kept in ``extra``."""
        checks = data.get("checks")
        attempts = data.get("attempts")
        children = data.get("children")
        return cls(
            job_id=_str(data.get("job_id")),
            state=_str(data.get("state")),
            agent=_str(data.get("agent")),
            reason=_str(data.get("reason")),
            checks=tuple(CheckResult.from_json(c) for c in _list(checks) if isinstance(c, Mapping)),
            attempts=tuple(a for a in _list(attempts) if isinstance(a, Mapping)),
            received=_str(data.get("received")),
            finished=_str(data.get("finished")),
            parent=_str(data.get("parent")),
            children=tuple(c for c in _list(children) if isinstance(c, str)),
            cost_usd=_number(data.get("cost_usd")),
            chain_cost_usd=_number(data.get("chain_cost_usd")),
            extra={k: v for k, v in data.items() if k not in KEYS},
        )


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _number(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
