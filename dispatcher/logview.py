"""`dispatcher logs`: the JSON log file as lines a person reads."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

_FIRST = ("timestamp", "level", "event", "job_id", "agent")


def format_line(event: dict[str, Any]) -> str:
    """Return one log event as `time level event job agent key=value ...`."""
    head = [
        str(event.get("timestamp", ""))[:23],
        f"{event.get('level', '')!s:<7}",
        f"{event.get('event', '')!s:<18}",
    ]
    if event.get("job_id"):
        head.append(str(event["job_id"]))
    if event.get("agent"):
        head.append(f"({event['agent']})")
    rest = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in event.items() if k not in _FIRST]
    return " ".join(head + rest)


def follow(path: Path, *, job: str | None, forever: bool) -> int:
    """Print the log file (and, with forever, what is appended to it)."""
    try:
        f = path.open("r", encoding="utf-8", errors="replace")
    except FileNotFoundError:
        if not forever:
            return 0
        while not path.exists():
            time.sleep(0.2)
        f = path.open("r", encoding="utf-8", errors="replace")
    with f:
        while True:
            line = f.readline()
            if not line:
                if not forever:
                    return 0
                time.sleep(0.2)
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if job is None or event.get("job_id") == job:
                print(format_line(event), flush=True)
