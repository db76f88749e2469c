"""The agent's final JSON object on stdout, as headless agent CLIs print it (contract section 5)."""

from __future__ import annotations

import json
import re
from typing import Any

AGENT_RESULT_MAX = 64 * 1024
AGENT_RESULT_KEYS = (
    "total_cost_usd",
    "session_id",
    "num_turns",
    "is_error",
    "duration_ms",
    "usage",
)


def parse_agent_result(tail: bytes) -> dict[str, Any] | None:
    """Return the JSON object that ends stdout, as headless agent CLIs print it, or None."""
    text = tail.decode("utf-8", errors="replace").rstrip()
    if not text.endswith("}"):
        return None
    decoder = json.JSONDecoder()
    starts = [m.start() for m in re.finditer(r"(?m)^[ \t]*\{", text)]
    for pos in reversed(starts):
        try:
            value, end = decoder.raw_decode(text, text.index("{", pos))
        except (json.JSONDecodeError, RecursionError):
            continue
        if end == len(text) and isinstance(value, dict):
            if len(text[pos:].encode()) > AGENT_RESULT_MAX:
                return {k: value[k] for k in AGENT_RESULT_KEYS if k in value}
            return value
    return None
