"""The notify command of one event (contract section 11): its argv, and its start from a command.

The daemon runs notifications on its loop (``core.notify``). A command that raises an
event itself (``approve`` holding a follow-up over the chain budget: ``budget.held``)
returns at once and leaves the notification to a process of its own, started detached
(``start_detached``): ``python -m dispatcher.core.notify_apart`` runs it as the daemon
would, with the 30 s timeout, and logs ``notify.failed`` into ``log_file`` and to a
running daemon's stdout when it fails, hangs or cannot start.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from dispatcher.errors import oneline

log = structlog.get_logger("dispatcher")
PLACEHOLDERS = ("event", "job_id", "agent", "reason", "result")
_RE = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")


def render(text: str, values: Mapping[str, str]) -> str:
    """Replace the notify placeholders in one argv element; leave every other brace alone."""
    return _RE.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def argv_for(
    notify: Sequence[str], event: str, job_id: str | None, agent: str | None, reason: str | None, result: Path | None
) -> list[str]:
    """Return the notify argv with one event's values in place."""
    values = {
        "event": event,
        "job_id": job_id or "",
        "agent": agent or "",
        "reason": oneline(reason or ""),
        "result": str(result) if result is not None else "",
    }
    return [render(a, values) for a in notify]


@dataclass(frozen=True, slots=True)
class Apart:
    """What a notification run apart from a command needs of the config."""

    notify: tuple[str, ...]
    kill_grace_s: float
    log_file: Path | None


def start_detached(
    apart: Apart,
    root: Path,
    event: str,
    job_id: str | None,
    agent: str | None,
    reason: str | None,
    result: Path | None = None,
) -> None:
    """Start the notify command for one event apart from this command and return at once; log if it cannot start.

    A process of its own (``core.notify_apart``), in a session of its own with its output
    discarded, runs it as the daemon would and logs ``notify.failed`` itself.
    """
    if not apart.notify:
        return
    spec = {
        "notify": list(apart.notify),
        "kill_grace_s": apart.kill_grace_s,
        "log_file": str(apart.log_file) if apart.log_file is not None else None,
        "root": str(root),
        "event": event,
        "job_id": job_id,
        "agent": agent,
        "reason": reason,
        "result": str(result) if result is not None else None,  # {result}: empty where none
    }
    try:
        subprocess.Popen(
            [sys.executable, "-m", "dispatcher.core.notify_apart", json.dumps(spec)],
            cwd=root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        log.warning(
            "notify.failed", event_name=event, job_id=job_id, agent=agent, error=f"cannot start: {exc.strerror}"
        )
