"""Usage limits: "come back at T" answers of agent CLIs, found on the end of an attempt's output.

An agent's ``limits:`` is a list of rules, each a regular expression whose first
group names a time, read as ``epoch`` (seconds since 1970), ``clock`` (a time of
day: ``17:30``, ``3pm``, ``12:50am``, UTC unless the text names a zone such as
``(Europe/Berlin)``) or ``seconds`` (``30``, ``1.5s``, ``6m0s``, ``4 days 20 hours 9
minutes``). The presets hold what the CLIs print, as their own trackers quote it:

- ``claude``: ``Claude AI usage limit reached|1760000400`` (headless mode),
  ``5-hour limit reached ∙ resets 3pm (Europe/Stockholm)``, ``You've hit your
  session limit · resets 12:50am (America/Los_Angeles)``, ``You've hit your limit ·
  resets 1pm (Europe/Lisbon)``, ``You've hit your weekly limit · resets Sep 15 at 7pm``,
  ``Opus weekly limit reached ∙ resets Oct 6, 1pm`` (a date without a year is its next
  coming) and ``Claude usage limit reached. Your limit will reset at 5pm (Europe/Warsaw).``;
- ``codex``: ``You've hit your usage limit. Upgrade to Pro (...) or try again in
  4 days 20 hours 9 minutes.``, its newer ``... or try again at 3:45 PM.`` and ``... try
  again at Jul 9th, 2026 1:47 AM.`` (read as UTC, like every clock without a zone), the
  API's ``"resets_in_seconds": 13872`` and
  ``Rate limit reached for ... Please try again in 1.5s`` (or ``6m0s``, as Go prints a duration);
- ``http429``: a ``429`` (or ``Too Many Requests``) with a ``Retry-After: 30`` header.

Pure: the caller passes the text and the time; nothing here reads a clock or a file.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

TAIL_BYTES = 64 * 1024  # the end of stdout and of stderr that limits look at
KINDS = ("epoch", "clock", "seconds")
_TEXT_MAX = 200


@dataclass(frozen=True, slots=True)
class LimitRule:
    """One pattern: ``match`` (its first group is the time), read as ``until``; ``needs`` must match too."""

    match: str
    until: str
    preset: str | None = None
    needs: str | None = None

    def to_json(self) -> dict[str, str | None]:
        """Return the rule as job.json keeps it (a preset expanded, so that a job keeps what it started with)."""
        return {"match": self.match, "until": self.until, "preset": self.preset, "needs": self.needs}

    @classmethod
    def from_json(cls, data: dict[str, str | None]) -> LimitRule:
        """Rebuild a rule from ``to_json`` output."""
        return cls(str(data["match"]), str(data["until"]), data.get("preset"), data.get("needs"))


@dataclass(frozen=True, slots=True)
class LimitHit:
    """A rule matched: come back at ``until`` (epoch seconds); ``text`` is the matched text, cut."""

    until: float
    text: str


# a date before the time: Codex's "Jul 9th, 2026 1:47 AM", Claude's "Jan 30, 11:30am", "Sep 15 at 7pm"
_DATE = r"(?:[A-Z][a-z]{2,8}\.?\s+\d{1,2}(?:st|nd|rd|th)?(?:,?\s+\d{4})?(?:,?\s+at|,)?\s+)"
_HALF = r"(?:[ap]\.?m\.?(?![A-Za-z]))"  # am, p.m.; never the start of a word ("9:46 America/New_York")
_CLOCK = r"(" + _DATE + r"?\d{1,2}(?::\d{2})?\s*" + _HALF + r"?(?:\s*\([A-Za-z_]+(?:/[A-Za-z0-9_+-]+)*\)|\s+UTC)?)"
_CODEX_HIT = r"(?is)You(?:'|\u2019)ve hit your usage limit\b.{0,300}?"  # a straight or a curly apostrophe
_RESETS = r"\s*[∙·•|-]\s*resets\s+(?:at\s+)?"
# one or more amounts with a unit, spelled out ("4 days 20 hours") or as Go prints them ("6m0s", "1m30.5s", "250ms")
_UNIT = r"(?:days?|d|hours?|h|minutes?|mins?|m|seconds?|secs?|s|milliseconds?|ms)(?![A-Za-z])"
_DURATION = r"((?:\d+(?:\.\d+)?\s*" + _UNIT + r"[\s,]*(?:and\s+)?)+)"
PRESETS: dict[str, tuple[LimitRule, ...]] = {
    "claude": (
        LimitRule(r"Claude AI usage limit reached\|(\d{9,13})", "epoch", "claude"),
        LimitRule(r"(?i)limit reached" + _RESETS + _CLOCK, "clock", "claude"),
        LimitRule(r"(?i)hit your (?:[\w-]+\s+){0,2}limit" + _RESETS + _CLOCK, "clock", "claude"),
        LimitRule(r"(?i)usage limit reached\.\s*Your limit will reset at\s+" + _CLOCK, "clock", "claude"),
    ),
    "codex": (
        LimitRule(_CODEX_HIT + r"try again in\s+" + _DURATION, "seconds", "codex"),
        LimitRule(_CODEX_HIT + r"try again at\s+" + _CLOCK, "clock", "codex"),
        LimitRule(r'(?i)"resets_in_seconds"\s*:\s*(\d+)', "seconds", "codex", needs=r"usage_limit_reached"),
        LimitRule(r"(?is)Rate limit reached for .{0,500}?try again in\s+" + _DURATION, "seconds", "codex"),
    ),
    "http429": (
        LimitRule(
            r"(?i)retry-after[\"']?\s*[:=]\s*[\"']?(\d+(?:\.\d+)?)",
            "seconds",
            "http429",
            needs=r"(?i)\b429\b|too many requests",
        ),
    ),
}  # fmt: skip


def preset(name: str) -> tuple[LimitRule, ...]:
    """Return a preset's rules (KeyError for an unknown name)."""
    return PRESETS[name]


def compile_rule(rule: LimitRule) -> re.Pattern[str]:
    """Compile a rule's pattern (re.error for a bad one); it must have a group."""
    pattern = re.compile(rule.match)
    if pattern.groups < 1:
        raise re.error("needs a group, for example (\\d+), around the time")
    return pattern


def find_limit(text: str, rules: tuple[LimitRule, ...], now: float, streams: tuple[str, ...] = ()) -> LimitHit | None:
    """Return the first rule's hit on text (the last match of that rule), or None.

    ``streams`` (stdout, stderr) are tried one by one after text (both of them) for
    each rule, so that a pattern anchored at the end (``$``) matches the end of either.
    A match whose time cannot be read, or lies in the past, is no hit: the
    attempt then counts as the failure it is.
    """
    for rule in rules:
        for where in (text, *streams):
            hit = _hit(where, rule, now)
            if hit is None and rule.preset is not None and "\\" in where:
                hit = _hit(_json_unescaped(where), rule, now)  # a CLI's final JSON may write `·` as \u00b7
            if hit is not None:
                return hit
    return None


# a surrogate pair first (an emoji escaped as two), then one escape; JSON's short escapes too (a line break as \n)
_JSON_ESCAPE = re.compile(
    r"\\(?:u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|([nrtbf\"\\/]))"
)
_SHORT_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "b": "\b", "f": "\f", '"': '"', "\\": "\\", "/": "/"}


def _json_unescaped(text: str) -> str:
    """Return text with JSON's escapes read: a preset's middle dot, bullet or curly quote as ``\\uXXXX``, an emoji
    as a surrogate pair, a line break as ``\\n``. A lone surrogate (no character) reads as U+FFFD."""
    return _JSON_ESCAPE.sub(_unescape, text)


def _unescape(m: re.Match[str]) -> str:
    high, low, one, short = m.groups()
    if high is not None:
        return chr(0x10000 + ((int(high, 16) - 0xD800) << 10) + (int(low, 16) - 0xDC00))
    if one is not None:
        code = int(one, 16)
        return "\ufffd" if 0xD800 <= code <= 0xDFFF else chr(code)
    return _SHORT_ESCAPES[short]


def _hit(text: str, rule: LimitRule, now: float) -> LimitHit | None:
    if rule.needs is not None and re.search(rule.needs, text) is None:
        return None
    last = None
    for m in compile_rule(rule).finditer(text):
        last = m
    if last is None:
        return None
    value = last.group(1) or ""
    if rule.until == "clock" and last.end(1) >= 0:
        value += _zone_after(text, last.end(1), value)
    until = read_time(value, rule.until, now)
    return LimitHit(until, _cut(last.group(0))) if until is not None and until > now else None


_ZONE_NAME = r"[A-Za-z]+/[A-Za-z_+\-]+(?:/[A-Za-z_+\-]+)?"  # Europe/Berlin, America/Argentina/Buenos_Aires
_ZONE_AFTER = re.compile(rf"[ \t]*(\([^)\n]{{1,64}}\)|{_ZONE_NAME})")


def _zone_after(text: str, end: int, value: str) -> str:
    """Return the zone the text names right after a clock time the rule's group took without one ("" if none)."""
    if "(" in value or re.search(r"(?i)utc|z\s*$|/", value):
        return ""
    m = _ZONE_AFTER.match(text, end)
    return f" {m.group(1)}" if m is not None else ""


LATEST = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp()  # the latest time a record can name


def read_time(value: str, kind: str, now: float) -> float | None:
    """Read a matched time as epoch seconds (None when it cannot be read).

    A time beyond what a record can name (``retry in 1e400 s``, an epoch of 30 digits)
    reads as ``LATEST``: a wait that long is beyond any ``max_limit_wait``.
    """
    value = value.strip()
    if kind == "epoch":
        try:
            t = float(value)
        except ValueError:
            return None
        return _bounded(t / 1000 if t > 1e11 else t)  # milliseconds
    if kind == "seconds":
        seconds = duration_s(value)
        return None if seconds is None else _bounded(now + seconds)
    return clock_time(value, now)


def _bounded(t: float) -> float | None:
    return None if math.isnan(t) else min(t, LATEST)


_UNITS = {
    **dict.fromkeys(("d", "day", "days"), 86400.0),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600.0),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60.0),
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1.0),
    **dict.fromkeys(("ms", "msec", "msecs", "millisecond", "milliseconds"), 0.001),
}


def duration_s(text: str) -> float | None:
    """Read ``30``, ``1.5s``, ``250ms``, ``6m0s`` or ``4 days 20 hours 9 minutes`` as seconds.

    A unit not known (``1 month``) makes the whole text unreadable: None.
    """
    text = text.strip().lower()
    try:
        return float(text)
    except ValueError:
        pass
    total, found = 0.0, False
    for amount, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]+)", text):
        if unit not in _UNITS:
            return None
        total += float(amount) * _UNITS[unit]
        found = True
    return total if found else None


_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")


def clock_time(text: str, now: float) -> float | None:
    """Return the next moment after ``now`` that shows this time of day (UTC unless a zone is named).

    With a date before it (``Jul 9th, 2026 1:47 AM``, as Codex prints) it is that moment itself.
    A time named to the minute (or to the hour) that is under way at ``now`` is read as the end of
    that minute (or hour), not as the same time tomorrow or next year: CLIs print reset times
    rounded, so "resets 11:30pm" read at 23:30:41 is a reset that has just come.
    """
    m = re.fullmatch(
        r"(?:(?P<mon>[A-Za-z]{3})[a-z]*\.?\s+(?P<day>\d{1,2})(?:st|nd|rd|th)?(?:,?\s+(?P<year>\d{4}))?"
        r"(?:,?\s+at|,)?\s+)?"
        r"(?P<hour>\d{1,2})(?::(?P<minute>\d{2})(?::\d{2})?)?\s*(?:(?P<half>[ap])\.?(?:m\.?)?(?![a-z]))?"
        rf"\s*(?:\((?P<zone>[^)]+)\)|(?P<named>{_ZONE_NAME})|UTC|Z)?",
        text.strip(),
        re.IGNORECASE,
    )
    if m is None:
        return None
    hour, minute = int(m["hour"]), int(m["minute"] or 0)
    half = (m["half"] or "").lower()
    if half:
        if not 1 <= hour <= 12:
            return None
        hour = hour % 12 + (12 if half == "p" else 0)
    if hour > 23 or minute > 59:
        return None
    zone = UTC
    if m["zone"] or m["named"]:
        try:
            zone = ZoneInfo((m["zone"] or m["named"]).strip())  # type: ignore[assignment]
        except (ZoneInfoNotFoundError, ValueError):
            return None
    here = datetime.fromtimestamp(now, zone)
    unit = 60 if m["minute"] else 3600  # how finely the text names its time
    if m["mon"]:
        month = _MONTHS.index(m["mon"].lower()) + 1 if m["mon"].lower() in _MONTHS else 0
        years = (int(m["year"]),) if m["year"] else (here.year - 1, here.year, here.year + 1)
        moments = []
        for year in years:
            with contextlib.suppress(ValueError):  # no such month or day (29 February: only in some years)
                moments.append(datetime(year, month, int(m["day"]), hour, minute, tzinfo=zone).timestamp())
        return _reading(moments, now, unit, exact=bool(m["year"])) if moments else None
    at = here.replace(hour=hour, minute=minute, second=0, microsecond=0)
    return _reading([(at + timedelta(days=d)).timestamp() for d in (-1, 0, 1)], now, unit, exact=False)


JUST_PASSED_S = 600.0  # a reset time that ended this recently is in the past, not the same time tomorrow


def _reading(moments: list[float], now: float, unit: int, *, exact: bool) -> float:
    """Return what a reset time means at ``now``, from the moments it may name (oldest first).

    Under way (the named minute or hour has begun): its end. Ended within ``JUST_PASSED_S``
    (the agent printed it a moment before it exited): that moment, in the past, which is no
    limit (the attempt counts as the failure it is), never a day or a year later. Otherwise
    the next such moment; with ``exact`` (a date with its year) the one moment named.
    """
    for moment in moments:
        if moment <= now < moment + unit:
            return moment + unit
        if moment + unit <= now < moment + unit + JUST_PASSED_S:
            return moment
    if exact:
        return moments[0]
    return next((moment for moment in moments if moment > now), moments[-1])


def _cut(text: str) -> str:
    """Return the matched text on one line, cut to its first 200 characters (as the contract says, no mark added)."""
    return " ".join(text.split())[:_TEXT_MAX]
