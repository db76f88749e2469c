"""Times as the dispatcher writes them: ISO 8601 UTC with milliseconds, and refusal-folder stamps."""

from __future__ import annotations

from datetime import UTC, datetime


def utc_stamp(when: float | None = None) -> str:
    """Return a refusal-folder timestamp such as 20261129T081600.123456Z."""
    moment = datetime.fromtimestamp(when, UTC) if when is not None else datetime.now(UTC)
    return moment.strftime("%Y%m%dT%H%M%S.%fZ")


def iso(when: float) -> str:
    """Return an ISO 8601 UTC time with milliseconds, as result.json writes it."""
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(when * 1000) % 1000:03d}Z"


def parse_iso(text: str) -> float:
    """Return epoch seconds for an ``iso`` time."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
