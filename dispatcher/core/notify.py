"""Notifications (contract section 11): an argv run after job.failed, job.review and budget.held.

The command runs like an agent (never through a shell, in its own process group,
with an agent's environment rules) on the daemon's event loop, with its own
timeout of 30 s. Whatever it does, the job's state is already decided: a notify
that fails, hangs or cannot start is logged as ``notify.failed`` and nothing else.

At most ``notify_max_running`` run at once; the others wait in order. A wait longer
than ``QUEUE_MAX`` is summarised: later events are counted, not queued, and one
notification with the event ``notify.dropped`` (reason: the count) takes their place
at the end of the queue; ``notify.dropped`` is logged with the count when it runs.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from dispatcher.job.notice import argv_for
from dispatcher.job.runner import AgentProcess, build_env
from dispatcher.shortage import SHORT
from dispatcher.text import exit_text

log = structlog.get_logger("dispatcher")
NOTIFY_TIMEOUT_S = 30.0
STDERR_TAIL_MAX = 2000  # characters of a failed notify's stderr logged: the end of its last lines
_HURRY_POLL_S = 0.2  # how often a stop waiting for notifications looks for a second stop
_OUTPUT_MAX = 64 * 1024
QUEUE_MAX = 100  # notifications waiting; beyond this they are counted into one notify.dropped


class NotifySettings(Protocol):
    """What notifications read of the config (``Config`` has it; so does a command's ``notify_apart``)."""

    @property
    def notify(self) -> tuple[str, ...] | None: ...

    @property
    def notify_max_running(self) -> int: ...

    @property
    def kill_grace_s(self) -> float: ...


@dataclass
class _Event:
    event: str
    job_id: str | None
    agent: str | None
    reason: str | None
    result: Path | None
    dropped: int = 0  # a summary of this many dropped events (event notify.dropped)


class Notifications:
    """Run the config's notify command for events, off the loop's critical path."""

    def __init__(self, config: Callable[[], NotifySettings], cwd: Path) -> None:
        self._config = config
        self._cwd = cwd
        self._running: set[asyncio.Task[None]] = set()
        self._procs: set[AgentProcess] = set()  # the notify commands running now
        self._queue: collections.deque[_Event] = collections.deque()
        self._summary: _Event | None = None  # the queued notify.dropped that counts events dropped now
        self._retry: asyncio.TimerHandle | None = None
        self._closing = False  # the daemon stops: nothing more is queued
        self._ending = False  # the stop's deadline came: nothing more starts, what runs is ended

    def fire(self, event: str, job_id: str | None, agent: str | None, reason: str | None, result: Path | None) -> None:
        """Queue the notify command for one event and start what may start (on the loop; returns at once)."""
        if not self._config().notify:
            return
        if self._closing:  # an event of the stop's last moments: its command would outlive the daemon
            log.warning("notify.dropped", count=1, reason="the daemon stops", job_id=None, agent=None)
            return
        if len(self._queue) < QUEUE_MAX:
            self._queue.append(_Event(event, job_id, agent, reason, result))
        elif self._summary is not None:
            self._summary.dropped += 1
        else:
            self._summary = _Event("notify.dropped", None, None, None, None, dropped=1)
            self._queue.append(self._summary)
        self._pump()

    def _pump(self) -> None:
        """Start queued notifications, oldest first, while fewer than notify_max_running run."""
        cfg = self._config()
        while self._queue and len(self._running) < cfg.notify_max_running and cfg.notify and not SHORT.short():
            ev = self._queue.popleft()
            if ev is self._summary:
                self._summary = None
                # about no one job, whichever job's context this runs in
                log.warning("notify.dropped", count=ev.dropped, queue_max=QUEUE_MAX, job_id=None, agent=None)
                ev.reason = f"{ev.dropped} notifications dropped: more than {QUEUE_MAX} were waiting"
            argv = argv_for(cfg.notify, ev.event, ev.job_id, ev.agent, ev.reason, ev.result)
            task = asyncio.get_running_loop().create_task(self._run(argv, ev))
            self._running.add(task)
            task.add_done_callback(self._ended)
        if self._queue and SHORT.short() and self._retry is None:
            self._retry = asyncio.get_running_loop().call_later(SHORT.wait_s(), self._after_pause)

    def _after_pause(self) -> None:
        self._retry = None
        self._pump()

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._pump()

    async def _run(self, argv: list[str], ev: _Event) -> None:
        event, job_id, agent = ev.event, ev.job_id, ev.agent
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
        if self._ending:  # queued before the stop's deadline, not started by then: it never is
            log.warning(
                "notify.failed", event_name=event, job_id=job_id, agent=agent, error="not run: the daemon stopped"
            )
            return
        try:
            proc.start()
            self._procs.add(proc)
        except OSError as exc:
            if SHORT.note(exc, "notify") and not self._closing:
                self._queue.appendleft(ev)  # not now: first again once the shortage is over
                return
            log.warning(
                "notify.failed", event_name=event, job_id=job_id, agent=agent, error=f"cannot start: {exc.strerror}"
            )
            return
        try:
            out = await proc.wait()
        finally:
            self._procs.discard(proc)
        if out.timed_out or out.aborted or out.exit_code != 0:
            if out.aborted:
                why = "ended: the daemon stopped"
            else:
                why = f"timed out after {NOTIFY_TIMEOUT_S:g} s" if out.timed_out else exit_text(out.exit_code)
            stderr = out.stderr_tail.decode("utf-8", "replace").strip().splitlines()[-3:]
            tail = " | ".join(stderr)
            if len(tail) > STDERR_TAIL_MAX:  # its end, where a program says what went wrong (a log field keeps a start)
                tail = f"(cut, {len(tail) - STDERR_TAIL_MAX} characters before) ...{tail[-STDERR_TAIL_MAX:]}"
            log.warning(
                "notify.failed",
                event_name=event,
                job_id=job_id,
                agent=agent,
                error=why,
                stderr=tail or None,
            )

    def end_running(self) -> None:
        """End the running notify commands now, as agents are at the stop's deadline (``kill_grace``, then SIGKILL).

        Each is logged as ``notify.failed`` (the daemon stopped) when it ends; ``close`` waits for them.
        """
        if self._running:
            self._ending = True
            for proc in list(self._procs):
                proc.abort("the daemon stopped")

    async def close(
        self,
        until: float | None = None,
        hurry: Callable[[], bool] = lambda: False,
        *,
        drain: bool = False,
        forced: Callable[[], bool] = lambda: False,
        stop_s: float = 0.0,
    ) -> None:
        """Let running notify commands end; the queue is dropped (with ``drain``: run first, in order).

        ``drain`` is the end of `run --once`, which no one asked to stop: every notification
        queued runs, ``notify_max_running`` at a time, until ``hurry()`` says a stop came; the
        ones running then may go on for ``stop_s`` (``stop_timeout``), as at any stop.
        Each is bounded by its own timeout; a stop bounds them all by its deadline
        (``until``, on the monotonic clock), or ends them at once when ``forced()`` says a
        second stop came: their groups are ended (``kill_grace``; by SIGKILL at once after a
        second stop) and each is logged as ``notify.failed``.
        """
        self._closing = True
        while drain and (self._queue or self._running) and not hurry():
            if self._running:  # as each ends, ``_ended`` starts the next queued one
                await asyncio.wait(set(self._running), timeout=_HURRY_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(_HURRY_POLL_S)  # queued behind a shortage: ``_after_pause`` starts them
        if self._queue:
            # a queued summary stands for the events counted into it: each is dropped here too
            count = sum(ev.dropped or 1 for ev in self._queue)
            log.warning("notify.dropped", count=count, reason="the daemon stops", job_id=None, agent=None)
            self._queue.clear()
            self._summary = None
        if self._retry is not None:
            self._retry.cancel()
        if until is None and drain and hurry():  # `run --once` stopped while it drained: the stop's own deadline
            until = time.monotonic() + stop_s
        end = time.monotonic() + NOTIFY_TIMEOUT_S + 10 if until is None else until
        while self._running and time.monotonic() < end and not forced():
            await asyncio.wait(set(self._running), timeout=min(_HURRY_POLL_S, max(0.0, end - time.monotonic())))
        if self._running:
            self._ending = True
            now = forced()  # a second stop: their groups get SIGKILL at once, as agents' do
            for proc in list(self._procs):
                proc.abort("the daemon stopped", now=now)
            await asyncio.wait(set(self._running), timeout=self._config().kill_grace_s + 5)
