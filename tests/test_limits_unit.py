"""The pure decisions of section 14, in milliseconds: reading limit texts, which gate holds, daily windows."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from dispatcher.checks.builtin import CHECKS
from dispatcher.core.gatekeeper import gated_agents
from dispatcher.job.waits import budget_gates, holding, window_until
from dispatcher.ledger.base import Gate, GateKind
from dispatcher.spec.agent_rules import BUILTIN_CHECKS
from dispatcher.spec.limits import LimitRule, clock_time, duration_s, find_limit, preset
from dispatcher.spec.settings import Agent, Config

NOW = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC).timestamp()
ALL = preset("claude") + preset("codex") + preset("http429")


@pytest.mark.parametrize(
    ("text", "wait_s"),
    [
        (f'{{"type":"result","is_error":true,"result":"Claude AI usage limit reached|{int(NOW) + 90}"}}', 90),
        (
            "■ You've hit your usage limit. Upgrade to Pro (https://openai.com/chatgpt/pricing) or try again in"
            " 4 days 20 hours 9\nminutes.",
            4 * 86400 + 20 * 3600 + 9 * 60,
        ),
        ("You've hit your usage limit. Upgrade to Pro or try again in 8 hours 30 minutes.", 8 * 3600 + 30 * 60),
        ('Error: {"type":"error","error":{"type":"usage_limit_reached","resets_in_seconds":13872}}', 13872),
        ("Rate limit reached for gpt-4 in organization org-x on tokens per min. Please try again in 1.5s.", 1.5),
        (
            "Rate limit reached for o3 in organization org-abc on requests per day (RPD): Limit 100, Used 100,"
            " Requested 1. Please try again in 6m0s.",
            360,
        ),
        ("Rate limit reached for gpt-4o on tokens per min (TPM). Please try again in 1h2m3s. Visit ...", 3723),
        ("Rate limit reached for gpt-4o on tokens per min (TPM). Please try again in 1m30.5s.", 90.5),
        ("HTTP/1.1 429 Too Many Requests\r\nRetry-After: 30\r\n", 30),
        ("5-hour limit reached ∙ resets 3pm (Europe/Stockholm)", 4 * 3600),  # 15:00 CET is 14:00 UTC
        (
            "You've hit your session limit · resets 12:50am (America/Los_Angeles)",
            22 * 3600 + 50 * 60,
        ),  # 00:50 PST is 08:50 UTC
        ("Claude usage limit reached. Your limit will reset at 5pm (Europe/Warsaw).", 6 * 3600),
        ("Session limit reached ∙ resets 4am", 18 * 3600),
        ("You've hit your limit · resets 1pm (Europe/Lisbon)", 3 * 3600),  # what claude -p prints today
        ("You\u2019ve hit your limit · resets 10pm", 12 * 3600),
        ("You've hit your weekly limit · resets Dec 3 at 7pm", 2 * 86400 + 9 * 3600),  # a date without a year
        ("Opus weekly limit reached ∙ resets Dec 6, 1pm", 5 * 86400 + 3 * 3600),
        ("You've hit your limit · resets Jan 30, 11:30am (Asia/Calcutta)", 60 * 86400 - 4 * 3600),  # 06:00 UTC
        ("You've hit your limit · resets Nov 30, 1pm", 364 * 86400 + 3 * 3600),  # passed this year: the next one
        (
            "■ You\u2019ve hit your usage limit. Visit https://chatgpt.com/codex/settings/usage to purchase more"
            " credits or try again at 4:05 PM.",
            6 * 3600 + 5 * 60,
        ),
        (
            "You've hit your usage limit for GPT-5.3-Codex-Spark. Switch to another model now, or try again at"
            " Dec 9th, 2026 1:47 AM.",
            7 * 86400 + 15 * 3600 + 47 * 60,
        ),
        (
            "You've hit your usage limit. Add credits to continue, or try again at Dec 10, 2026, 11:12 AM.",
            9 * 86400 + 4320,
        ),
    ],
)
def test_the_real_clis_texts_are_read(text: str, wait_s: float) -> None:
    """Each text the CLIs print at a limit gives the time it names."""
    hit = find_limit(text, ALL, NOW)
    assert hit is not None and hit.until - NOW == pytest.approx(wait_s)


@pytest.mark.parametrize(
    "result",
    [
        "You've hit your limit \u00b7 resets 1pm (Europe/Lisbon)",
        "5-hour limit reached \u2219 resets 3pm (Europe/Stockholm)",
        "You\u2019ve hit your limit \u00b7 resets 10pm",
    ],
)
def test_a_claude_limit_in_a_final_json_written_with_escapes_is_read(result: str) -> None:
    """A final JSON may write the middle dot, the bullet and the curly quote as \\u escapes: the preset reads them."""
    line = json.dumps({"type": "result", "is_error": True, "result": result})  # ensure_ascii: `·` -> \\u00b7
    assert "\\u" in line
    hit = find_limit(line, ALL, NOW)
    assert hit is not None and hit.until > NOW


@pytest.mark.parametrize(
    "result",
    [
        "You\u2019ve hit your usage limit \U0001f680 Upgrade to Pro or try again in 2 hours.",
        "Claude usage limit reached.\nYour limit will reset at 5pm (Europe/Warsaw).",
    ],
)
def test_a_limit_in_a_final_json_with_an_escaped_emoji_or_line_break_is_read(result: str) -> None:
    """An emoji escaped as a surrogate pair (\\ud83d\\ude80) is one character again, and the hit text can be
    written as UTF-8 (it is logged and kept); a line break escaped as \\n is a line break."""
    line = json.dumps({"type": "result", "is_error": True, "result": result})
    assert "\\u" in line or "\\n" in line
    hit = find_limit(line, ALL, NOW)
    assert hit is not None and hit.until > NOW
    hit.text.encode("utf-8")  # no lone surrogate
    lone = find_limit(line.replace("\\ude80", ""), ALL, NOW)  # half a pair: read as U+FFFD
    assert lone is not None
    lone.text.encode("utf-8")


def test_no_limit_in_ordinary_failures_or_past_times() -> None:
    """An ordinary error, a 429 without Retry-After and an epoch in the past are not limits."""
    assert find_limit("Error: ENOENT: no such file", ALL, NOW) is None
    assert find_limit("Retry-After: 30 (but all went fine)", ALL, NOW) is None
    assert find_limit(f"Claude AI usage limit reached|{int(NOW) - 5}", ALL, NOW) is None
    assert find_limit("You've hit your usage limit. Try again at Jul 7th, 2026 12:25 PM.", ALL, NOW) is None
    assert find_limit("You've hit your usage limit. Try again at Feb 30th, 2027 1:00 AM.", ALL, NOW) is None


def test_a_custom_rule_and_the_last_match_wins() -> None:
    """A user's rule reads its first group; of several matches the last one counts."""
    rule = (LimitRule(r"rate limited until (\d+)", "epoch"),)
    hit = find_limit(f"rate limited until {int(NOW) + 5}\nrate limited until {int(NOW) + 50}", rule, NOW)
    assert hit is not None and hit.until == int(NOW) + 50 and hit.text == f"rate limited until {int(NOW) + 50}"


def test_the_matched_text_is_cut_to_its_first_200_characters() -> None:
    """agent.limited's text is the match cut to 200 characters: its first 200, nothing added."""
    rule = (LimitRule(r"rate limited until (\d+) y+", "epoch"),)
    matched = f"rate limited until {int(NOW) + 5} " + "y" * 300
    hit = find_limit(matched, rule, NOW)
    assert hit is not None and hit.text == matched[:200]
    short = find_limit(f"rate limited until {int(NOW) + 5} yy", rule, NOW)
    assert short is not None and short.text == f"rate limited until {int(NOW) + 5} yy"


def test_clock_and_duration_readings() -> None:
    """Clock times roll to the next day once passed; durations take several units."""
    assert clock_time("09:00", NOW) == NOW + 23 * 3600
    assert clock_time("12:50am (America/Los_Angeles)", NOW) is not None
    at = datetime.fromtimestamp(clock_time("3pm (Europe/Berlin)", NOW) or 0, ZoneInfo("Europe/Berlin"))
    assert (at.hour, at.minute) == (15, 0)
    assert clock_time("25:00", NOW) is None and clock_time("3pm (Mars/Base)", NOW) is None
    assert duration_s("2 hours 5 minutes") == 7500 and duration_s("250ms") == 0.25 and duration_s("soon") is None


def test_durations_read_only_units_they_know() -> None:
    """Go's compound durations read whole; "90 milliseconds" is 0.09 s, not 90 minutes; "1 month" is no duration,
    so a rule that takes it finds no limit (the attempt counts as the failure it is)."""
    assert duration_s("6m0s") == 360 and duration_s("1h2m3s") == 3723 and duration_s("1m30.5s") == 90.5
    assert duration_s("90 milliseconds") == pytest.approx(0.09) and duration_s("3 hrs") == 10800
    assert duration_s("1 month") is None and duration_s("2 hours 1 month") is None
    rule = (LimitRule("custom wait (.+)$", "seconds"),)
    hit = find_limit("custom wait 90 milliseconds", rule, NOW)
    assert hit is not None and hit.until == pytest.approx(NOW + 0.09)
    assert find_limit("custom wait 1 month", rule, NOW) is None


@pytest.mark.parametrize(
    ("output", "utc"),
    [
        ("busy until 12:00 (Europe/Berlin)", (11, 0)),  # the zone right after what the group took
        ("busy until 12:00 Europe/Berlin", (11, 0)),
        ("busy until 12:00 America/New_York", (17, 0)),  # a zone starting with A or P is no "am" or "pm"
        ("busy until 12:00 Asia/Tokyo", (3, 0)),
        ("busy until 12:00 Pacific/Auckland", (23, 0)),
        ("busy until 12:00 Africa/Cairo", (10, 1)),  # 12:00 there is now: the minute under way ends at 10:01 UTC
        ("busy until 12:00\nlater: (Europe/Berlin)", (12, 0)),  # on another line: not this time's zone
        ("busy until 12:00", (12, 0)),
    ],
)
def test_a_clock_rule_reads_the_zone_the_text_names_after_its_group(output: str, utc: tuple[int, int]) -> None:
    """until: clock is UTC unless the text names a zone, even one the rule's group did not take."""
    hit = find_limit(output, (LimitRule(match=r"busy until (\d\d:\d\d)", until="clock"),), NOW)
    assert hit is not None
    at = datetime.fromtimestamp(hit.until, UTC)
    assert (at.hour, at.minute) == utc


def test_clock_times_with_seconds_a_bare_zone_name_or_z() -> None:
    """17:30:00, 17:30Z and 17:30 Europe/Berlin are clock times too."""
    berlin = datetime.fromtimestamp(clock_time("17:30 Europe/Berlin", NOW) or 0, ZoneInfo("Europe/Berlin"))
    assert (berlin.hour, berlin.minute) == (17, 30)
    assert clock_time("9:30am America/New_York", NOW) == clock_time("09:30 America/New_York", NOW) == NOW + 4.5 * 3600
    assert clock_time("17:30:00", NOW) == clock_time("17:30Z", NOW) == clock_time("17:30 UTC", NOW) == NOW + 7.5 * 3600


def test_which_gate_holds() -> None:
    """A pause holds longest; an expired gate holds no one; the root's gate holds every agent."""
    gates = [Gate("a", GateKind.LIMIT, NOW + 10), Gate("a", GateKind.PAUSE, None), Gate("b", GateKind.LIMIT, NOW - 1)]
    held = holding(gates, "a", NOW)
    assert held is not None and held.kind == "pause"
    assert holding(gates, "b", NOW) is None
    assert gated_agents([Gate("*", GateKind.BUDGET, NOW + 5)], ["a", "b"], NOW) == {"a", "b"}


def test_the_daily_window() -> None:
    """A cap reached is lifted when enough of the oldest costs leave the 24-hour window."""
    costs = [(NOW - 3600, 0.4), (NOW - 1800, 0.4), (NOW - 60, 0.4)]
    assert window_until(costs, 1.0, NOW) == NOW - 3600 + 86400  # 0.8 once the oldest 0.4 leaves
    assert window_until(costs[:2], 1.0, NOW) is None
    agent = Agent("w", ("true",), max_daily_cost_usd=1.0)
    cfg = Config(path=None, root=Path("/tmp"), max_daily_cost_usd=2.0)
    gates = budget_gates([(t, "w", c) for t, c in costs], cfg, agent, NOW)
    assert [(g.agent, g.kind) for g in gates] == [("w", "budget")]


def test_user_checks_cannot_take_a_built_in_name() -> None:
    """The reserved names are exactly the built-in checks."""
    assert tuple(c.__name__ for c in CHECKS) == BUILTIN_CHECKS


def test_a_daily_cap_is_reached_by_costs_whose_float_sum_falls_just_short() -> None:
    """3 x 0.3 USD is 0.9 USD (0.8999999999999999 in floats): a cap of 0.9 is reached."""
    costs = [(NOW - 300, 0.3), (NOW - 200, 0.3), (NOW - 100, 0.3)]
    assert sum(c for _, c in costs) < 0.9  # the floats fall short
    assert window_until(costs, 0.9, NOW) == NOW - 300 + 86400
    assert window_until(costs, 0.91, NOW) is None


def test_a_time_under_way_is_read_as_its_end_not_as_tomorrow_or_next_year() -> None:
    """ "resets 10:00am" read at 10:00:41, "resets 10am" at 10:30 and "Dec 1, 10:00am" at 10:00:40: the named minute
    (or hour) is under way, so the wait ends with it. They read as tomorrow and as next year: the agent was gated
    for a day (or the job failed beyond max_limit_wait and the agent stayed gated a year)."""
    assert clock_time("10:00am", NOW + 41) == NOW + 60
    assert clock_time("10am", NOW + 1800) == NOW + 3600
    assert clock_time("Dec 1, 10:00am", NOW + 40) == NOW + 60
    assert clock_time("Dec 1, 2026 10:00am", NOW + 40) == NOW + 60
    # ended a moment ago (the agent printed it just before it exited): in the past, so no limit, never a day or a
    # year later; ended long ago: the next such time, as before
    assert clock_time("9:59am", NOW) == NOW - 60
    assert clock_time("9am", NOW + 1) == NOW - 3600
    assert clock_time("Nov 30, 11:59pm", NOW - 10 * 3600 + 5) == NOW - 10 * 3600 - 60  # not next year
    assert (
        clock_time("Dec 31, 11pm", datetime(2027, 1, 1, 0, 0, 1, tzinfo=UTC).timestamp())
        == datetime(2026, 12, 31, 23, tzinfo=UTC).timestamp()
    )  # the year before, ended a second ago
    assert clock_time("11:59pm", NOW + 14 * 3600 + 5) == NOW + 14 * 3600 - 60  # 23:59 ended at 00:00, 5 s ago
    assert clock_time("9:59am", NOW + 700) == NOW + 24 * 3600 - 60
    assert clock_time("Nov 30, 9am", NOW) == datetime(2027, 11, 30, 9, tzinfo=UTC).timestamp()
