"""What the daemon does beside starting jobs: recovery, requests, rescans, settling, metrics.

Each periodic concern is its own named task on the loop (``housekeeping.rescan``,
``housekeeping.requests``, ``housekeeping.writers``, ``housekeeping.metrics``).
Blocking steps run in a lane and return data; only the loop changes the
scheduler's and the inbox's state. Housekeeping is handed what it uses (the
job context, the scheduler, the inbox, a way to restart the watch), never the
daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from dispatcher import logs, procs
from dispatcher.core.watcher import Inbox, list_inbox
from dispatcher.core.work import Ranked
from dispatcher.finished import FinishedCounts
from dispatcher.job import recovery, repowork, revise
from dispatcher.job.context import JobContext
from dispatcher.job.joins import Joins
from dispatcher.job.review import settle_reviews
from dispatcher.layout import Layout, job_of_hint
from dispatcher.ledger.base import LedgerUnavailable, Request
from dispatcher.lifecycle import Row, State, is_landed
from dispatcher.procs import end_group
from dispatcher.shortage import SHORT
from dispatcher.spec.jobspec import is_cost
from dispatcher.spec.orders import parse_time
from dispatcher.store.counts import queue_counts
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.orphans import leftover_groups
from dispatcher.store.queued import find_queued, ids_of
from dispatcher.store.relay import pass_on

if TYPE_CHECKING:
    from dispatcher.metrics import Metrics

log = structlog.get_logger("dispatcher")
GATE_WAITS_S = 2.0  # how long a metrics write waits for the ledger's gate waits
METRICS_EVERY_S = 5.0  # the contract asks for at least every 10 s


class Counts(Protocol):
    """What the scheduler counts of the jobs a daemon finished (``core.readaside.Stats``)."""

    def count(self, state: str) -> None:
        """Count one job finished in ``state``."""


class Parking(Protocol):
    """What housekeeping asks of the scheduler (``core.scheduler.Scheduler``): park, cancel, take back."""

    left: set[str]  # jobs stopped while the daemon went on (fenced): taken back by recovery

    @property
    def stats(self) -> Counts:
        """What it finished, for `run --once`'s exit code."""

    @property
    def running(self) -> Mapping[str, object]:
        """The jobs this daemon runs now, by id."""

    def park_recovered(
        self,
        adopted: list[tuple[str, int, str]],
        ranks: Mapping[str, Ranked] | None = None,
        *,
        host_lost: bool = False,
    ) -> None:
        """Queue adopted jobs of dead daemons first (those never started by their rank among the orders)."""

    def park_retry(self, job_id: str, agent: str, *, revise: bool = False) -> None:
        """Queue a failed job for `dispatcher retry` (or a job for `dispatcher revise`)."""

    def cancel(self, job_id: str, entry_state: str | None) -> bool:
        """Carry out a cancel request; False when the order must first be found in inbox/."""

    def claim_now(self, name: str) -> None:
        """Claim an order in inbox/ at once, without a slot."""


class Housekeeping:
    """Recovery, rescans, requests and the open-writer check, for one daemon."""

    def __init__(
        self,
        ctx: JobContext,
        sched: Parking,
        inbox: Inbox,
        *,
        check_watch: Callable[[], None],
        wake: Callable[[], None],
        shared: bool = False,
        joins: Joins | None = None,
        stop_asked: Callable[[], bool] = lambda: False,
    ) -> None:
        self.ctx = ctx
        self.stop_asked = stop_asked  # a stop came, handled or not yet (start-up handles signals after READY)
        self.joins = joins  # waiting jobs: recovered and swept at every recovery pass
        self.sched = sched
        self.inbox = inbox
        self.check_watch = check_watch  # restarts the watch of inbox/ if it died
        self.wake = wake
        self.shared = shared  # a ledger with leases: a dead daemon's jobs were lost with their host
        self._tasks: set[asyncio.Task[Any]] = set()
        self._hooks: set[asyncio.Task[Any]] = set()  # the "land" tasks: owed after and land hooks run there
        # dead daemons' jobs left in active/ at the last recovery: their agents run on out of sight (another pid
        # namespace under this host's name); a later rescan takes them over (``recovery.orphans``)
        self.apart: frozenset[str] = frozenset()
        #: live daemons whose jobs in active/ the last recovery left to them (``run --once`` looks again at its end)
        self.kept: frozenset[str] = frozenset()
        self._checking = False
        self._settle_due: float | None = None
        self._metrics_due = 0.0
        self._metrics_failing: str | None = None  # the error of the last metrics write, while they fail
        self._in_requests = False
        self._requests_again = False
        self._revising: set[str] = set()  # revisions this daemon took on, until their requests are cleared
        self._writing = False
        # one recovery at a time: two at once (a rescan beside the one a renewed lease starts) would both
        # adopt a job this daemon stopped while fenced, and run two copies of it
        self._recovering: asyncio.Lock | None = None
        self._no_agent: set[tuple[str, str]] = set()  # (job, request) waiting for its agent: logged once

    @property
    def busy(self) -> bool:
        return bool(self._tasks)

    @property
    def hooks_busy(self) -> bool:
        """True while an owed after or land hook may run: a stop waits for it as for an agent (section 9)."""
        return bool(self._hooks)

    def start(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Run a housekeeping coroutine as the named task (errors are logged, never fatal)."""
        task = asyncio.get_running_loop().create_task(self._guard(coro), name=f"housekeeping.{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if name == "land":
            self._hooks.add(task)
            task.add_done_callback(self._hooks.discard)

    def run_owed(self) -> None:
        """Run the owed after hooks and landings in the background (the "land" task a stop waits for)."""
        ctx = self.ctx
        owed = repowork.housekeep(
            ctx.layout, ctx.lanes, ctx.config(), ctx.finisher.notify, startup=False, busy=self.sched.running,
            stopping=ctx.stopping,
        )  # fmt: skip
        self.start(owed, "land")

    async def _guard(self, coro: Coroutine[Any, Any, Any]) -> None:
        try:
            await coro
        except LedgerUnavailable as exc:  # a stop gave up the wait: the next start does it again
            if not self.ctx.stopping():
                log.exception("daemon.error", step="housekeeping", error=str(exc))
        except Exception as exc:
            if not SHORT.note(exc, "housekeeping"):  # a shortage: the next turn or rescan does it again
                log.exception("daemon.error", step="housekeeping", error=str(exc))
        finally:
            task = asyncio.current_task()
            if task is not None:
                self._tasks.discard(task)  # not busy any more before the loop wakes to ask
                self._hooks.discard(task)
            self.wake()

    async def close(self) -> None:
        """End housekeeping in flight (the hooks' tasks ended first: the stop waited for them until its deadline)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- recovery -------------------------------------------------------------------------------
    async def recover(self, *, startup: bool) -> None:
        """Finish what dead daemons left: staging, claims, active jobs (agents ended first); one pass at a time."""
        if self._recovering is None:
            self._recovering = asyncio.Lock()
        async with self._recovering:
            await self._recover(startup=startup)

    async def _recover(self, *, startup: bool) -> None:
        left = frozenset(self.sched.left)
        adopted, taken, lost, landed = await self.ctx.lanes.ledger(self._recover_in_lane, startup, left)
        self.sched.left -= taken
        for moved in landed:  # a dead daemon's decision this daemon carried out: `run --once` counts it as finished
            self.sched.stats.count(moved.state.value)
            self.ctx.finisher.landed_for_the_dead(moved.job_id, moved.state, moved.folder, moved.result)
        ends = []
        agents = {job_id: agent or None for job_id, _, agent in adopted}
        leftovers, ranks = await self.ctx.lanes.scan(_leftovers, self.ctx.layout, adopted)
        for job_id, pgid in leftovers:
            log.warning("agent.orphan_ended", job_id=job_id, agent=agents.get(job_id), pid=pgid)
            ends.append(end_group(pgid, self.ctx.config().kill_grace_s, hurry=self.stop_asked))  # a stop: SIGKILL
        await asyncio.gather(*ends)  # before any of these jobs is queued: none runs beside its orphan
        if startup:  # READY=1 waits for their decisions (one that never started has none to make)
            self.ctx.unrecovered.update(job_id for job_id, _, _ in adopted if job_id not in ranks)
        # a host lost: a shared ledger's dead daemon that did not stop cleanly. Not this daemon's own jobs, stopped
        # while its lease went unrenewed (it knows no other host ran them), nor those of a daemon that stopped
        lost_ones = [a for a in adopted if a[0] in lost and a[0] not in left]
        self.sched.park_recovered(lost_ones, ranks, host_lost=True)
        self.sched.park_recovered([a for a in adopted if a[0] not in lost or a[0] in left], ranks, host_lost=False)
        await self.ctx.lanes.io(self.ctx.finisher.release_orphaned)

    def _recover_in_lane(
        self, startup: bool, left: frozenset[str]
    ) -> tuple[list[tuple[str, int, str]], set[str], set[str], list[recovery.Landed]]:
        """Recovery's blocking steps (ledger lane); return the adopted jobs, the left ids taken back, the jobs
        whose host was lost (their daemon's lease ran out on a shared ledger; not one that stopped cleanly), and
        the dead daemons' decided jobs landed here (``recovery.Landed``)."""
        layout, ledger = self.ctx.layout, self.ctx.ledger
        recovery.finish_staging(layout, ledger, ledger.alive)
        for decided in settle_reviews(layout, ledger):  # decided reviews land first: their follow-ups are released
            count_decided(self.ctx.metrics, self.ctx.finisher.finished, decided)  # from done/
        recovery.settle_ledger(layout, ledger, ledger.alive)
        if self.joins is not None:
            self.joins.recover(ledger.alive)
        if startup:
            recovery.reconcile_active(layout, ledger)
        out, taken, lost = [], set(), set()
        landed: list[recovery.Landed] = []
        apart: list[str] = []
        kept: set[str] = set()
        for job_id, token, owner in recovery.orphans(layout, ledger, ledger.alive, left, landed, apart, kept):
            taken.add(job_id)
            entry = ledger.get(job_id)
            out.append((job_id, token, (entry.agent if entry else None) or ""))
            if self.shared and not (owner and ledger.stopped_cleanly(owner)):
                lost.add(job_id)
        if self.joins is not None:  # after the dead daemons' finished jobs landed: a join's parents are in place
            self.joins.sweep()  # the backstop of the Finisher's hook: a parent finished by a command, max_wait
        self.apart = frozenset(apart)  # `run --once` waits for them: taken over at a later rescan
        self.kept = frozenset(kept)
        return out, taken, lost, landed

    async def rescan(self) -> None:
        """List inbox/ again (events are hints), restart a dead watch, find dead daemons' work."""
        self.check_watch()  # first: a file that arrives while inbox/ is listed is then seen by the new watch
        for path in self.ctx.ledger.take_back_locks():
            why = "its lock file was deleted or replaced under the running daemon; locked again at its path"
            log.error("lock.lost", path=path, reason=why)
        self.inbox.merge(await self.ctx.lanes.scan(list_inbox, self.ctx.layout.inbox))
        if not self.ctx.stopping():
            await self._refuse_taken_deferred()
            await self.recover(startup=False)
            self.run_owed()  # land approved jobs (section 15), in the background: a hook may take minutes
        await self.requests()

    async def _refuse_taken_deferred(self) -> None:
        """Read now the orders held back by not_before whose job id was taken since (a due copy ran, a cancel took a
        copy): refused as known at once, instead of staying queued in inbox/ until their time beside the job."""
        deferred = self.inbox.deferred()
        if not deferred:
            return
        ids = await self.ctx.lanes.scan(ids_of, self.ctx.layout.inbox, deferred)
        if not ids:
            return
        rows = await self.ctx.lanes.ledger(self.ctx.ledger.known, set(ids.values()))
        for name, job_id in ids.items():
            entry = rows.get(job_id)
            if entry is not None and entry.state not in (Row.RELEASED, Row.HELD, Row.RESERVED):  # not its own row
                self.sched.claim_now(name)  # the claim answers "known": refused as any copy of a known id

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
        for line in await lanes.io(pass_on, layout, hints, logs.relay):  # a command's log lines: onto this stdout
            count_decision(self.ctx.metrics, self.ctx.finisher.finished, line)
        cancels = await lanes.io(ledger.requests, Request.CANCEL)
        # jobs running or queued here are stopped in this very step, all of them: a slot an ended one gives back
        # is never handed on to a job claimed ahead whose cancel comes later in the list (``core.ahead``)
        acted = {job_id for job_id in cancels if self.sched.cancel(job_id, None)}
        for job_id in cancels:
            if job_id in acted:
                continue
            entry = await lanes.io(ledger.get, job_id)
            if entry is not None and entry.state == Row.WAITING and self.joins is not None:
                if await lanes.ledger(self.joins.cancel, job_id):
                    await lanes.ledger(ledger.clear_request, job_id, Request.CANCEL)
                continue
            if self.sched.cancel(job_id, entry.state if entry else None):
                if entry is not None and is_landed(entry.state):
                    await lanes.ledger(ledger.clear_request, job_id, Request.CANCEL)
                continue
            found = await lanes.scan(find_queued, layout.inbox, [job_id])
            if job_id in found:
                self.sched.claim_now(found[job_id])  # the claim's transaction answers "cancelled"
            elif entry is None and not self.inbox.has_pending() and not self._other_daemons():
                # no order with this id is left anywhere: a later order reusing the id is not cancelled
                await lanes.ledger(ledger.clear_request, job_id, Request.CANCEL)
                log.info("cancel.dropped", job_id=job_id, agent=None, reason="no queued order has this job id")
        if not self.ctx.stopping():  # a request parked here keeps `run --once` going (scheduler.busy)
            for job_id in await lanes.io(ledger.requests, Request.RETRY):
                folder = JobFolder(layout.job(State.FAILED, job_id))
                try:
                    agent = (await lanes.io(folder.spec)).agent.name
                except ValueError as exc:
                    where = await lanes.io(layout.find, job_id)
                    if where is not None and where[0] is State.ACTIVE:
                        continue  # another daemon carries it out this moment (it clears the request)
                    await lanes.ledger(ledger.clear_request, job_id, Request.RETRY)
                    log.warning("retry.dropped", job_id=job_id, agent=None, reason=f"failed/{job_id}: {exc}")
                    continue
                if self._agent_here(job_id, agent, "retry"):
                    self.sched.park_retry(job_id, agent)
            revisions = await lanes.io(ledger.requests, Request.REVISE)
            self._revising.intersection_update(revisions)  # carried out: their requests are cleared
            for job_id in revisions:
                where = await lanes.io(layout.find, job_id)
                if where is None or where[0] not in (State.REVIEW, State.FAILED):
                    if where is not None and where[0] is State.ACTIVE:  # moved, the request not cleared
                        if job_id in self._revising:
                            continue  # this daemon's revision under way: it clears its request
                        entry = await lanes.io(ledger.get, job_id)
                        owner = entry.owner if entry is not None else None
                        if owner == ledger.owner or (owner is not None and await lanes.io(ledger.alive, owner)):
                            continue  # another live daemon's, under way; or adopted here, its request cleared then
                        # its daemon died between the move and clearing the request: the revision was carried out
                        await lanes.ledger(ledger.clear_request, job_id, Request.REVISE, drop_reserved=True)
                        await lanes.io(revise.log_cut_revision, layout, job_id)  # its job.revised line too
                    continue
                try:
                    agent = (await lanes.io(JobFolder(where[1]).spec)).agent.name
                except ValueError as exc:
                    now_at = await lanes.io(layout.find, job_id)
                    if now_at is None or now_at[1] != where[1]:
                        continue  # moved meanwhile (a decision landed it, a daemon reopened it): the next pass sees
                    await lanes.ledger(ledger.clear_request, job_id, Request.REVISE)
                    log.warning("revise.dropped", job_id=job_id, agent=None, reason=f"{where[0].value}/{job_id}: {exc}")
                    continue
                if self._agent_here(job_id, agent, "revision"):
                    self._revising.add(job_id)
                    self.sched.park_retry(job_id, agent, revise=True)
        await lanes.io(_drop_hints, layout, hints)
        decided = [job_of_hint(h) for h in hints if h.startswith(("approve-", "reject-"))]
        if decided and self.joins is not None and not self.ctx.stopping():  # joins waiting for them: now
            await lanes.ledger(self.joins.on_final, decided)
        if not self.ctx.stopping() and decided:
            self.run_owed()  # a decided review: its after hook and landing are owed now, not at the next rescan
        self.wake()

    def _agent_here(self, job_id: str, agent: str, what: str) -> bool:
        """Return True if the config has the job's agent; else its retry or revision waits (logged once).

        A retried or revised job runs with its agent's settings as the config has them
        (section 6); an agent no longer in the config has none: the request stays in the
        ledger, as a queued order of that agent stays in inbox/, until a reload brings it back.
        """
        if agent in self.ctx.config().agents:
            self._no_agent.discard((job_id, what))
            return True
        if (job_id, what) not in self._no_agent:
            self._no_agent.add((job_id, what))
            reason = f"its agent is not in the config: the {what} waits until a reload brings it back"
            log.warning("order.waiting", job_id=job_id, agent=agent, reason=reason)
        return False

    def _other_daemons(self) -> bool:
        return any(d.alive and d.owner != self.ctx.ledger.owner for d in self.ctx.ledger.daemons())

    # -- settling -------------------------------------------------------------------------------
    def promote_settled(self) -> None:
        """Make settled files ready; ask the io pool whether a writer still holds them open."""
        check, wait = self.inbox.promote_settled()
        self._settle_due = None if wait is None else time.monotonic() + wait
        if check:
            self.start(self._check_writers(check), "writers")

    async def settle_now(self) -> None:
        """Run the open-writer check of the files already settled, in place: at start, the orders found in inbox/
        are ready before the first claims, so that they take their places by priority beside recovered jobs."""
        check, wait = self.inbox.promote_settled()
        self._settle_due = None if wait is None else time.monotonic() + wait
        if check:
            await self._check_writers(check)

    async def _check_writers(self, names: list[str]) -> None:
        inbox = self.ctx.layout.inbox
        held = await self.ctx.lanes.scan(procs.held_for_writing, {os.path.abspath(inbox / n) for n in names})
        self.inbox.writers_checked(names, held)

    def next_due(self, now: float) -> float:
        """Return seconds until the next settle check or metrics write (a large number when none is due).

        The metrics write is a timer of its own: an idle loop still turns for it (section 10).
        """
        due = 3600.0 if self._settle_due is None else self._settle_due - now
        if self.joins is not None and self.joins.due is not None:  # a wait reaches max_wait
            due = min(due, self.joins.due - time.time())
        if self.ctx.metrics is not None and not self._writing:  # a write in flight wakes the loop when done
            due = min(due, self._metrics_due - now)
        return due

    def joins_due(self) -> None:
        """Sweep the waiting jobs when the first of them reaches max_wait (section 16)."""
        joins = self.joins
        if joins is not None and joins.due is not None and time.time() >= joins.due and not self.ctx.stopping():
            joins.due = None  # the sweep sets it again
            self.start(self.ctx.lanes.ledger(joins.sweep), "joins")

    def metrics_now(self) -> None:
        """Make the next metrics write due at once (metrics_file was just set by a reload)."""
        self._metrics_due = 0.0
        self._metrics_failing = None  # a new file: its first failure is logged

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
            self.start(self.write_metrics(), "metrics")

    async def write_metrics(self) -> None:
        """Count the queue and rewrite the metrics file (io pool)."""
        metrics = self.ctx.metrics
        if metrics is None:
            return
        try:
            gated = await self._gate_waits()
            elsewhere = await self._elsewhere(metrics)
            await self.ctx.lanes.scan(_write_metrics, metrics, self.ctx.layout, gated, elsewhere)
            self._metrics_failing = None
        except OSError as exc:
            if exc.strerror != self._metrics_failing:  # once per failing spell, not at every write (each 5 s)
                log.warning("metrics.failed", file=str(metrics.path), error=exc.strerror)
            self._metrics_failing = exc.strerror
        finally:
            self._writing = False

    async def _elsewhere(self, metrics: Metrics) -> frozenset[int] | None:
        """Return the pids of the other live daemons when their metrics files may share this one's ``{pid}``
        pattern (section 10: only this host's stopped daemons' files go; a pid of another host or pid
        namespace is not one of this /proc's); None if the ledger does not answer in time (no file is
        removed in this write)."""
        if not metrics.has_pid_pattern():
            return frozenset()
        try:
            daemons = await asyncio.wait_for(self.ctx.lanes.ledger(self.ctx.ledger.daemons), GATE_WAITS_S)
        except Exception:  # noqa: BLE001 - the file is written whatever the ledger does (section 10)
            return None
        return frozenset(d.pid for d in daemons if d.alive and d.owner != self.ctx.ledger.owner)

    async def _gate_waits(self) -> frozenset[str]:
        """Return the jobs a gate holds (in active/, counted waiting as `status` counts them); none when no gate
        holds, without a query. A ledger that does not answer in time leaves them active in this write."""
        if not self.ctx.gates():
            return frozenset()
        try:
            waits = await asyncio.wait_for(self.ctx.lanes.ledger(self.ctx.ledger.gate_waits), GATE_WAITS_S)
        except Exception:  # noqa: BLE001 - the file is written whatever the ledger does (section 10)
            return frozenset()
        return frozenset(waits)


_DECIDED = {"job.approved": "done", "job.rejected": "failed"}


def count_decision(metrics: Metrics | None, finished: FinishedCounts, line: str) -> None:
    """Count a review decision a command made (its relayed ``job.approved``/``job.rejected``) as the finish it is."""
    if '"job.approved"' not in line and '"job.rejected"' not in line:
        return
    try:
        event = json.loads(line)
    except ValueError:
        return
    if isinstance(event, dict):
        count_decided(metrics, finished, event)


def count_decided(metrics: Metrics | None, finished: FinishedCounts, event: dict[str, Any]) -> None:
    """Count one ``job.approved``/``job.rejected`` line's fields as the finish it is (done or failed)."""
    state = _DECIDED.get(str(event.get("event")))
    if state is None:
        return
    agent = event.get("agent") if isinstance(event.get("agent"), str) else None
    finished.add(state, agent)
    if metrics is not None:
        # the part since the job's last finish (a revised job's earlier attempts were counted then)
        duration = event.get("counted_duration_s", event.get("duration_s"))
        cost = event.get("counted_cost_usd", event.get("cost_usd"))
        metrics.job_finished(
            state,
            agent,
            duration if isinstance(duration, (int, float)) and not isinstance(duration, bool) else None,
            cost if is_cost(cost) else None,
        )


def _write_metrics(metrics: Metrics, layout: Layout, gated: frozenset[str], elsewhere: frozenset[int] | None) -> None:
    counts = queue_counts(layout)
    held = sum(1 for job_id in gated if os.path.isdir(layout.job(State.ACTIVE, job_id)))
    counts["active"] -= held  # section 14: a job a gate holds is `waiting`, as status counts it
    counts["waiting"] += held
    metrics.set_queue(counts)
    metrics.write(elsewhere)


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


def _leftovers(layout: Layout, adopted: list[tuple[str, int, str]]) -> tuple[list[tuple[str, int]], dict[str, Ranked]]:
    """Return (job id, process group) of the agents the adopted jobs' last attempts left running (scan lane), and
    the rank (-priority, received) and expires of each adopted job that never started an attempt.

    One walk of /proc for all of them: it grows with the machine's processes, not with one job.
    A job that never started (a join that waited for a slot, an order claimed ahead) has nothing
    to recover: it takes its place among the orders by priority and age, as it had before.
    """
    folders = [JobFolder(layout.job(State.ACTIVE, job_id)) for job_id, _, _ in adopted]
    numbers = [folder.attempt_numbers() for folder in folders]
    last = [(folder, max(ns, default=0)) for folder, ns in zip(folders, numbers, strict=True)]
    groups = leftover_groups([(folder, n) for folder, n in last if n], layout.slots)
    ranks: dict[str, Ranked] = {}
    for (job_id, _, _), folder, ns in zip(adopted, folders, numbers, strict=True):
        if ns:
            continue
        try:
            spec = folder.spec()
        except (OSError, ValueError):
            continue  # recovered first, as any: its job decides what a damaged job.json means
        priority, expires = spec.order.get("priority", 5), spec.order.get("expires")
        try:
            at = parse_time(expires) if isinstance(expires, str) else None
        except ValueError:
            at = None
        ranks[job_id] = ((-priority if isinstance(priority, int) else -5, spec.received), at)
    return [(job_id, pgid) for job_id, _, _ in adopted for pgid in groups.get(job_id, [])], ranks
