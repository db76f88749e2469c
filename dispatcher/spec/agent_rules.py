"""The per-agent rules of contract section 14 as the config gives them: usage limits and user checks.

``build_limits`` expands presets and compiles patterns; ``build_checks`` refuses
a check named like a built-in one. Both name the key in every error.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dispatcher.errors import ConfigError
from dispatcher.spec.limits import KINDS, LimitRule, compile_rule, preset
from dispatcher.spec.settings import DEFAULT_CHECK_TIMEOUT_S, UserCheck

# the built-in checks of contract section 5 (checks.builtin.CHECKS): a user check may not take one's name
BUILTIN_CHECKS = (
    "exit_ok", "receipt_present", "receipt_job_id", "receipt_status", "receipt_inputs", "output_rows",
    "receipt_outputs", "allowed_values", "writes_scope", "followups_valid",
)  # fmt: skip


def build_limits(agent: str, entries: list[dict[str, Any]]) -> tuple[LimitRule, ...]:
    """Build an agent's limit rules: presets expanded, patterns compiled (a bad one is a config error)."""
    rules: list[LimitRule] = []
    for i, entry in enumerate(entries):
        where = f"agents.{agent}.limits[{i}]"
        if "preset" in entry:
            if "match" in entry or "until" in entry:
                raise ConfigError("give either preset or match with until, not both", field=where)
            rules.extend(preset(entry["preset"]))
            continue
        if "match" not in entry or "until" not in entry:
            raise ConfigError("needs preset, or match with until (" + " | ".join(KINDS) + ")", field=where)
        rule = LimitRule(entry["match"], entry["until"])
        try:
            compile_rule(rule)
        except re.error as exc:
            raise ConfigError(f"is not a usable regular expression: {exc}", field=f"{where}.match") from None
        rules.append(rule)
    return tuple(rules)


def build_checks(
    agent: str, entries: list[dict[str, Any]], base: Path, resolve: Callable[[list[str], Path], tuple[str, ...]]
) -> tuple[UserCheck, ...]:
    """Build an agent's own checks; a name that is a built-in check's, or repeated, is a config error."""
    out: list[UserCheck] = []
    for i, entry in enumerate(entries):
        name = entry["name"]
        if name in BUILTIN_CHECKS:
            raise ConfigError(f"{name} is a built-in check's name", field=f"agents.{agent}.checks[{i}].name")
        if any(c.name == name for c in out):
            raise ConfigError(f"{name} is given twice", field=f"agents.{agent}.checks[{i}].name")
        timeout = float(entry.get("timeout", DEFAULT_CHECK_TIMEOUT_S))
        out.append(UserCheck(name, resolve(entry["command"], base), timeout))
    return tuple(out)
