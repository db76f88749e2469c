"""Times as the dispatcher writes them: ISO 8601 UTC with milliseconds, and refusal-folder stamps."""

from __future__ import annotations

from datetime import UTC, datetime


def utc_stamp(when: float | None = None) -> str:
    """Return a refusal-folder timestamp such as 20261129T081600.123456Z."""
    moment = datetime.fromtimestamp(when, UTC) if when is not None else datetime.now(UTC)
    return moment.strftime("%Y%m%dT%H%M%S.%fZ")


_second: tuple[int, str] = (-1, "")  # the last whole second iso() wrote and its text up to the seconds


def iso(when: float) -> str:
    """Return an ISO 8601 UTC time with milliseconds, as result.json writes it.

    The text up to the seconds is made once a second (a job writes six such
    times); a time so close to the next second that ``fromtimestamp`` rounds it
    up is made in full, as before.
    """
    global _second
    second = int(when)
    last = _second
    if last[0] != second or not 0 <= when - second < 0.999999:
        moment = datetime.fromtimestamp(when, UTC)
        head = f"{moment.year:04d}" + moment.strftime("-%m-%dT%H:%M:%S.")  # %Y writes the year 1 as "1"
        if not 0 <= when - second < 0.999999:  # rounded up, or before 1970: not the text of ``second``
            return head + f"{int(when * 1000) % 1000:03d}Z"
        last = _second = (second, head)
    return last[1] + f"{int(when * 1000) % 1000:03d}Z"


def parse_iso(text: str) -> float:
    """Return epoch seconds for an ``iso`` time."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
