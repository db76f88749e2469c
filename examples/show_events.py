#!/usr/bin/env python3
"""Print the daemon's JSON log lines (stdin) one short line each, for the demo.

    dispatcher run --once | python3 examples/show_events.py

Each line shows the time, the event, the job and agent, then the other fields as
``key=value``, cut to the terminal's width. Lines that are not JSON pass unchanged.
"""

from __future__ import annotations

import json
import shutil
import sys

SKIP = {"timestamp", "level", "event", "job_id", "agent", "logger", "pid", "host"}
LEVELS = {"warning": "!", "error": "E", "critical": "E"}


def short(line: str, width: int) -> str:
    """Return one log line as a short readable line."""
    try:
        entry = json.loads(line)
    except ValueError:
        return line
    if not isinstance(entry, dict) or "event" not in entry:
        return line
    clock = str(entry.get("timestamp", ""))[11:23]
    mark = LEVELS.get(str(entry.get("level", "")).lower(), " ")
    who = " ".join(str(entry[k]) for k in ("job_id", "agent") if entry.get(k))
    rest = " ".join(
        f"{k}={json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v}"
        for k, v in entry.items()
        if k not in SKIP
    )
    text = f"  {clock} {mark} {entry['event']:<18} {who:<24} {rest}".rstrip()
    return text if len(text) <= width else text[: width - 3] + "..."


def main() -> int:
    """Filter stdin to stdout until end of input."""
    width = max(60, shutil.get_terminal_size((120, 24)).columns)
    for line in sys.stdin:
        print(short(line.rstrip("\n"), width), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
