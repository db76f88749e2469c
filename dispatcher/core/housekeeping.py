"""What the daemon does beside starting jobs: recovery, requests, rescans, finishing commits.

Each piece is a short coroutine or a blocking step for a lane; the loop starts
them and never waits on them inside a turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from dispatcher import fsutil, procs
from dispatcher.core.watcher import list_inbox, start_watch
from dispatcher.job import recovery
from dispatcher.job.followups import release_followups
from dispatcher.job.job import JobContext
from dispatcher.job.review import settle_reviews
from dispatcher.job.runner import end_group
from dispatcher.layout import Layout, State, parse_iso
from dispatcher.ledger.base import Entry, Finish, Ledger, Request, Row
from dispatcher.query.report import queue_counts
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.queued import find_queued, queued_ids

if TYPE_CHECKING:
    from dispatcher.core.daemon import Daemon
    from dispatcher.core.metrics import Metrics

log = structlog.get_logger("dispatcher")
METRICS_EVERY_S = 5.0  # the contract asks for at least every 10 s
_STATE_OF = {Row.DONE: State.DONE, Row.FAILED: State.FAILED, Row.REVIEW: State.REVIEW}

__all__ = ["Housekeeping", "commit_finishes", "queued_ids", "release"]


class Housekeeping:
    """Recovery, rescans, requests and the open-writer check, for one daemon."""

    def __init__(self, daemon: Daemon, ctx: JobContext) -> None:
        self.d = daemon
        self.ctx = ctx
        self.retry_pending = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._checking = False
        self._settle_due: float | None = None
        self._metrics_due = 0.0
        self._in_requests = False
        self._requests_again = False
        self._writing = False

    @property
    def busy(self) -> bool:
        return bool(self._tasks)

    def start(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a housekeeping coroutine in the background (errors are logged, never fatal)."""
        task = asyncio.get_running_loop().create_task(self._guard(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, coro: Coroutine[Any, Any, Any]) -> None:
        try:
            await coro
        except Exception as exc:
            log.exception("daemon.error", step="housekeeping", error=str(exc))
        finally:
            self.d.wakeup()

    async def close(self) -> None:
        """Wait for housekeeping in flight (cancelled when the stop is forced)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- recovery -------------------------------------------------------------------------------
    async def recover(self, *, startup: bool) -> None:
        """Finish what dead daemons left: staging, claims, active jobs (their agents ended first)."""
        adopted = await self.ctx.lanes.ledger(self._recover_in_lane, startup)
        ends = []
        for job_id, _token, _agent in adopted:
            folder = JobFolder(self.ctx.layout.job(State.ACTIVE, job_id))
            n = max(folder.attempt_numbers(), default=0)
            for pgid in await self.ctx.lanes.io(recovery.leftover_groups, folder, n) if n else []:
                log.warning("agent.orphan_ended", job_id=job_id, pid=pgid)
                ends.append(end_group(pgid, self.d.config.kill_grace_s))
        await asyncio.gather(*ends)
        self.d.sched.park_recovered(adopted, host_lost=self.d.lease is not None)
        await self.ctx.lanes.io(self._release_orphaned)

    def _recover_in_lane(self, startup: bool) -> list[tuple[str, int, str]]:
        layout, ledger = self.ctx.layout, self.ctx.ledger
        recovery.finish_staging(layout, ledger, ledger.alive)
        recovery.settle_ledger(layout, ledger, ledger.alive)
        settle_reviews(layout, ledger)
        if startup:
            recovery.reconcile_active(layout, ledger)
        out = []
        left = frozenset(self.d.sched.left)
        for job_id, token in recovery.orphans(layout, ledger, ledger.alive, left):
            self.d.sched.left.discard(job_id)
            entry = ledger.get(job_id)
            out.append((job_id, token, (entry.agent if entry else None) or ""))
        return out

    def _release_orphaned(self) -> None:
        ledger = self.ctx.ledger
        parents = {e.parent for e in ledger.pending_releases() if e.parent and not ledger.alive(e.owner or "")}
        for parent in sorted(parents):
            release(self.d, parent)

    async def rescan(self) -> None:
        """List inbox/ again (events are hints), restart a dead watch, find dead daemons' work."""
        self.d.inbox.merge(await self.ctx.lanes.io(list_inbox, self.ctx.layout.inbox))
        watch = self.d.watch
        if watch is not None and not watch.alive():
            log.error("watcher.restarted")
            self.d.watch = start_watch(self.ctx.layout.inbox, self.ctx.layout.control, self.d.hint)
        if not self.d.stopping:
            await self.recover(startup=False)
        await self.requests()

    # -- requests -------------------------------------------------------------------------------
    async def requests(self) -> None:
        """Carry out cancel and retry requests recorded in the ledger; drop the hint files.

        One pass at a time: hints that arrive during a pass make one more pass after it.
        """
        if self._in_requests:
            self._requests_again = True
            return
        self._in_requests = True
        try:
            while True:
                self._requests_again = False
                await self._requests()
                if not self._requests_again:
                    return
        finally:
            self._in_requests = False

    async def _requests(self) -> None:
        lanes, ledger, layout = self.ctx.lanes, self.ctx.ledger, self.ctx.layout
        hints = await lanes.io(_hints, layout)
        for job_id in await lanes.io(ledger.requests, Request.CANCEL):
            entry = await lanes.io(ledger.get, job_id)
            if self.d.sched.cancel(job_id, entry.state if entry else None):
                if entry is not None and entry.state in (Row.DONE, Row.FAILED, Row.REVIEW):
                    await lanes.ledger(ledger.clear_request, job_id, Request.CANCEL)
                continue
            found = await lanes.io(find_queued, layout.inbox, [job_id])
            if job_id in found:
                self.d.sched.cancel_queued(job_id, found[job_id])
            elif entry is None and not self.d.inbox.has_pending() and not self._other_daemons():
                # no order with this id is left anywhere: a later order reusing the id is not cancelled
                await lanes.ledger(ledger.clear_request, job_id, Request.CANCEL)
                log.info("cancel.dropped", job_id=job_id, reason="no queued order has this job id")
        retries = await lanes.io(ledger.requests, Request.RETRY)
        self.retry_pending = bool(retries)
        if not self.d.stopping:
            for job_id in retries:
                folder = JobFolder(layout.job(State.FAILED, job_id))
                try:
                    agent = (await lanes.io(folder.spec)).agent.name
                except ValueError:
                    await lanes.ledger(ledger.clear_request, job_id, Request.RETRY)
                    continue
                self.d.sched.park_retry(job_id, agent)
        await lanes.io(_drop_hints, layout, hints)
        self.d.wakeup()

    def _other_daemons(self) -> bool:
        return any(d.alive and d.owner != self.ctx.ledger.owner for d in self.ctx.ledger.daemons())

    # -- settling -------------------------------------------------------------------------------
    def promote_settled(self) -> None:
        """Make settled files ready; ask the io pool whether a writer still holds them open."""
        check, wait = self.d.inbox.promote_settled()
        self._settle_due = None if wait is None else time.monotonic() + wait
        if check:
            self.start(self._check_writers(check))

    async def _check_writers(self, names: list[str]) -> None:
        inbox = self.ctx.layout.inbox
        held = await self.ctx.lanes.io(procs.held_for_writing, {os.path.abspath(inbox / n) for n in names})
        self.d.inbox.writers_checked(names, held)

    def next_due(self, now: float) -> float:
        """Return seconds until the next settle check (a large number when none is due)."""
        return 3600.0 if self._settle_due is None else self._settle_due - now

    def metrics_due(self) -> None:
        """Note the loop's turn; rewrite the metrics file when due (at least every 10 s; section 10)."""
        metrics = self.ctx.metrics
        if metrics is None:
            return
        now = time.monotonic()
        metrics.loop_turn(time.time())
        if now >= self._metrics_due and not self._writing:
            self._metrics_due = now + METRICS_EVERY_S
            self._writing = True
            self.start(self.write_metrics())

    async def write_metrics(self) -> None:
        """Count the queue and rewrite the metrics file (io pool)."""
        metrics = self.ctx.metrics
        if metrics is None:
            return
        try:
            await self.ctx.lanes.io(_write_metrics, metrics, self.ctx.layout)
        except OSError as exc:
            log.warning("metrics.failed", file=str(metrics.path), error=exc.strerror)
        finally:
            self._writing = False


def _write_metrics(metrics: Metrics, layout: Layout) -> None:
    metrics.set_queue(queue_counts(layout))
    metrics.write()


def _hints(layout: Layout) -> list[str]:
    try:
        return os.listdir(layout.control)
    except FileNotFoundError:
        return []


def _drop_hints(layout: Layout, names: list[str]) -> None:
    """Remove hint files already acted on (they only wake the daemon; the ledger is the truth)."""
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(layout.control / name)


def commit_finishes(
    layout: Layout,
    ledger: Ledger,
    batch: Sequence[tuple[JobFolder, Finish, dict[str, Any]]],
    metrics: Metrics | None = None,
) -> list[bool]:
    """Steps 2 and 3 of the finishing sequence for a batch (ledger lane): ledger, log, land, fsync."""
    oks = ledger.finish([finish for _, finish, _ in batch])
    touched: set[State] = set()
    for (folder, finish, result), ok in zip(batch, oks, strict=True):
        if not ok:
            continue
        state = _STATE_OF[finish.state]
        fields = {
            "job_id": finish.job_id,
            "agent": result.get("agent"),
            "attempts": len(result.get("attempts") or ()),
            "duration_s": _duration(result),
            "cost_usd": result.get("cost_usd"),
            "chain_cost_usd": result.get("chain_cost_usd"),
        }
        if state is State.DONE:
            log.info("job.done", children=result.get("children") or None, **fields)
        elif state is State.REVIEW:
            log.info("job.review", children=result.get("children") or None, **fields)
        else:
            log.warning("job.failed", reason=result.get("reason"), **fields)
        if metrics is not None and state is not State.REVIEW:
            metrics.job_finished(state.value, result.get("agent"), _duration(result), result.get("cost_usd"))
        with contextlib.suppress(FileNotFoundError):  # landed already (a crash between land and this)
            folder.land(layout, state)
            touched.add(state)
    for state in touched:
        fsutil.fsync_dir(layout.folder(state))
    return oks


def _duration(result: dict[str, Any]) -> float | None:
    try:
        return round(parse_iso(result["finished"]) - parse_iso(result["received"]), 3)
    except (KeyError, TypeError, ValueError):
        return None


def release(daemon: Daemon, parent: str) -> None:
    """Release a done parent's follow-ups (io pool); each new file is a hint to the loop."""
    loop = daemon.loop
    release_followups(
        daemon.layout,
        daemon.ledger,
        parent,
        max_chain_cost_usd=daemon.config.max_chain_cost_usd,
        released=lambda name: _hint_from_thread(loop, daemon, name),
        held=lambda entry, name: _held_from_thread(loop, daemon, entry, name),
    )


def _hint_from_thread(loop: asyncio.AbstractEventLoop, daemon: Daemon, name: str) -> None:
    loop.call_soon_threadsafe(daemon.hint, "moved", name)


def _held_from_thread(loop: asyncio.AbstractEventLoop, daemon: Daemon, entry: Entry, name: str) -> None:
    reason = f"chain cost {entry.chain_cost_usd} USD is above max_chain_cost_usd"
    loop.call_soon_threadsafe(daemon.notify.fire, "budget.held", entry.job_id, entry.agent, reason, None)
