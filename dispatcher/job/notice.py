"""The notify command of one event (contract section 11): its argv, and its start from a command.

The daemon runs notifications on its loop (``core.notify``). A command that raises an
event itself (``approve`` holding a follow-up over the chain budget: ``budget.held``)
starts the same argv, with the same environment, detached: in its own process group,
its output discarded, not waited for, so that the command returns at once.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

from dispatcher.errors import oneline
from dispatcher.job.runner import build_env

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


def start_detached(
    notify: Sequence[str], cwd: Path, event: str, job_id: str | None, agent: str | None, reason: str | None
) -> None:
    """Start the notify command for one event and return at once (a command's own event); log if it cannot start."""
    if not notify:
        return
    argv = argv_for(notify, event, job_id, agent, reason, None)
    env = build_env({}, {"DISPATCH_EVENT": event, "DISPATCH_JOB_ID": job_id or ""})
    try:
        subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
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
