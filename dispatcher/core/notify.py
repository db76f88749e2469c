"""Notifications (contract section 11): an argv run after job.failed, job.review and budget.held.

The command runs like an agent (never through a shell, in its own process group,
with an agent's environment rules) on the daemon's event loop, with its own
timeout of 30 s. Whatever it does, the job's state is already decided: a notify
that fails, hangs or cannot start is logged as ``notify.failed`` and nothing else.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog

from dispatcher.errors import oneline
from dispatcher.job.runner import AgentProcess, build_env
from dispatcher.spec.config import Config
from dispatcher.text import exit_text

log = structlog.get_logger("dispatcher")
NOTIFY_TIMEOUT_S = 30.0
PLACEHOLDERS = ("event", "job_id", "agent", "reason", "result")
_RE = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
_OUTPUT_MAX = 64 * 1024


def render(text: str, values: Mapping[str, str]) -> str:
    """Replace the notify placeholders in one argv element; leave every other brace alone."""
    return _RE.sub(lambda m: values.get(m.group(1), m.group(0)), text)


class Notifications:
    """Run the config's notify command for events, off the loop's critical path."""

    def __init__(self, config: Callable[[], Config], cwd: Path) -> None:
        self._config = config
        self._cwd = cwd
        self._running: set[asyncio.Task[None]] = set()

    def fire(self, event: str, job_id: str | None, agent: str | None, reason: str | None, result: Path | None) -> None:
        """Start the notify command for one event (on the loop; returns at once)."""
        argv = self._config().notify
        if not argv:
            return
        values = {
            "event": event,
            "job_id": job_id or "",
            "agent": agent or "",
            "reason": oneline(reason or ""),
            "result": str(result) if result is not None else "",
        }
        task = asyncio.get_running_loop().create_task(
            self._run([render(a, values) for a in argv], event, job_id, agent)
        )
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, argv: list[str], event: str, job_id: str | None, agent: str | None) -> None:
        cfg = self._config()
        env = build_env({}, {"DISPATCH_EVENT": event, "DISPATCH_JOB_ID": job_id or ""})
        proc = AgentProcess(
            argv,
            cwd=self._cwd,
            env=env,
            timeout_s=NOTIFY_TIMEOUT_S,
            kill_grace_s=cfg.kill_grace_s,
            log_dir=None,
            max_log_bytes=_OUTPUT_MAX,
        )
        try:
            proc.start()
        except OSError as exc:
            log.warning(
                "notify.failed", event_name=event, job_id=job_id, agent=agent, error=f"cannot start: {exc.strerror}"
            )
            return
        out = await proc.wait()
        if out.timed_out or out.exit_code != 0:
            why = f"timed out after {NOTIFY_TIMEOUT_S:g} s" if out.timed_out else exit_text(out.exit_code)
            stderr = out.stderr_tail.decode("utf-8", "replace").strip().splitlines()[-3:]
            log.warning(
                "notify.failed",
                event_name=event,
                job_id=job_id,
                agent=agent,
                error=why,
                stderr=" | ".join(stderr) or None,
            )

    async def close(self) -> None:
        """Let running notify commands end (each is bounded by its own timeout)."""
        if self._running:
            await asyncio.wait(set(self._running), timeout=NOTIFY_TIMEOUT_S + 10)
