"""Run a hook (``before``, ``after``, ``land``: contract section 15) like an agent.

A hook is an argv from the config, never a shell, with the placeholders
``{job_id}``, ``{workspace}``, ``{branch}``, ``{head}`` and ``{result}``; it runs in
its own process group with its own timeout (300 s unless given), the agent's
environment rules and the config's ``kill_grace``, its output kept in
``<name>-stdout.log`` and ``<name>-stderr.log`` beside the attempt or job it serves.

``after`` is owed to every job once it is final (done or failed), and runs once.
A job entering review/ is not final: its hook waits for `approve` or `reject`
(``afterowed``: a durable marker that a daemon carries out, at once on the
decision's hint, else at its next rescan or start), and after `revise` for the
job's next end. It is owed too to a job that never ran an attempt (cancelled in
its claim, a join that failed), which never got a workspace; it then runs in the
job's ``work/`` (``{workspace}`` names it, ``{branch}`` and ``{head}`` are empty),
as for an agent without ``workspace``.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dispatcher import fsutil
from dispatcher.clock import iso
from dispatcher.job.runner import AgentProcess
from dispatcher.lifecycle import Stop
from dispatcher.shortage import PAUSE_MIN_S, SHORT
from dispatcher.spec.settings import Hook
from dispatcher.text import exit_text, redact

PLACEHOLDERS = ("job_id", "workspace", "branch", "head", "result")
_RE = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
_LAST_LINE_MAX = 200


@dataclass(frozen=True, slots=True)
class HookRun:
    """How one hook run ended."""

    name: str
    argv: tuple[str, ...]
    exit_code: int | None
    timed_out: bool
    started: float
    ended: float
    last_line: str
    error: str | None = None  # it could not start
    aborted: str | None = None  # a stop or a cancel ended it (``Stop``)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.exit_code == 0

    @property
    def why(self) -> str:
        """Return one line saying how it failed (empty when it passed)."""
        if self.error is not None:
            return f"{self.name} hook cannot start: {self.error}"
        if self.timed_out:
            return f"{self.name} hook timed out"
        if self.aborted is not None and self.exit_code != 0:
            by = "the daemon's stop" if self.aborted == Stop.STOPPED else "a cancel"
            again = "; `dispatcher land ID` runs it again" if self.name == "land" else ""
            return f"{self.name} hook ended by {by} ({exit_text(self.exit_code)}){again}"
        if self.exit_code != 0:
            tail = f": {self.last_line}" if self.last_line else ""
            ended = f"exited {self.exit_code}" if (self.exit_code or 0) > 0 else exit_text(self.exit_code)
            return f"{self.name} hook {ended}{tail}"
        return ""

    def to_json(self) -> dict[str, Any]:
        """Return the run as plain JSON values (recorded in the job folder)."""
        return {
            "hook": self.name,
            "argv": [redact(a) for a in self.argv],  # a password in a URL of the command is shown as ***
            "ok": self.ok,
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "started": iso(self.started),
            "ended": iso(self.ended),
            "duration_ms": max(0, round((self.ended - self.started) * 1000)),
            "detail": self.why or "exit 0",
        }


def render(argv: tuple[str, ...], values: Mapping[str, str]) -> list[str]:
    """Replace the hook placeholders in each argv element; other braces pass unchanged."""
    return [_RE.sub(lambda m: values.get(m.group(1), m.group(0)), a) for a in argv]


class RunningHooks:
    """The hooks of this process that run now, so that a stop can end them as it ends agents (contract 9, 15).

    Hooks run like agents: a stop lets them run until its ``stop_timeout``, then ends their
    groups, and a second stop ends them at once. A hook that starts after that ends at once
    too; a cut ``after`` or ``land`` hook is recorded as failed (``dispatcher land`` runs a
    landing again).
    """

    def __init__(self) -> None:
        self._procs: set[AgentProcess] = set()
        self.stopped = False
        self._now = False

    def add(self, proc: AgentProcess) -> None:
        self._procs.add(proc)
        if self.stopped:
            proc.abort(Stop.STOPPED, now=self._now)

    def discard(self, proc: AgentProcess) -> None:
        self._procs.discard(proc)

    def stop_all(self, *, now: bool = False) -> None:
        """End every running hook's group now, and each one that starts from now on (``now``: by SIGKILL)."""
        self.stopped = True
        self._now = self._now or now
        for proc in list(self._procs):
            proc.abort(Stop.STOPPED, now=self._now)


RUNNING = RunningHooks()


async def run_hook(
    name: str,
    hook: Hook,
    values: Mapping[str, str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    kill_grace_s: float,
    log_dir: Path | None,
    max_log_bytes: int,
    attach: Callable[[AgentProcess | None], None] | None = None,
    keep_fd: int | None = None,
) -> HookRun:
    """Run one hook to its end (own group, timeout, kill grace) and say how it ended.

    ``attach`` hands the running process to the job's stop channel (a cancel ends the hook too).
    ``keep_fd``: the lock of its ``.running`` marker (``owed``), which the hook's processes hold
    too: the marker stays locked while any of them runs, also after its daemon died (``owed.look``).
    """
    argv = render(hook.command, values)
    proc = AgentProcess(
        argv,
        cwd=cwd,
        env=env,
        timeout_s=hook.timeout_s,
        kill_grace_s=kill_grace_s,
        log_dir=log_dir,
        max_log_bytes=max_log_bytes,
        log_prefix=f"{name}-",
        keep_fd=keep_fd,
    )
    started = time.time()
    while True:
        try:
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                for stream in ("stdout", "stderr"):
                    (log_dir / f"{name}-{stream}.log").touch()
            proc.start()
            break
        except OSError as exc:
            # a shortage is waited out (section 13), within the hook's own timeout and until a stop
            if time.time() - started < hook.timeout_s and not RUNNING.stopped and SHORT.note(exc, f"{name}.start"):
                await asyncio.sleep(max(SHORT.wait_s(), PAUSE_MIN_S))
                continue
            why = exc.strerror or str(exc)
            why = f"{why}: {exc.filename}" if exc.filename else why
            return HookRun(name, tuple(argv), None, False, started, time.time(), "", why)
    if attach is not None:
        attach(proc)
    RUNNING.add(proc)
    try:
        out = await proc.wait()
    finally:
        RUNNING.discard(proc)
    if attach is not None:
        attach(None)
    err = fsutil.read_tail(log_dir / f"{name}-stderr.log", 4096) if log_dir is not None else out.stderr_tail
    tail = (err.strip() or out.stdout_tail[-4096:].strip()).decode(errors="replace").splitlines()
    last = tail[-1][:_LAST_LINE_MAX] if tail else ""
    return HookRun(name, tuple(argv), out.exit_code, out.timed_out, out.started, out.ended, last, aborted=out.aborted)
