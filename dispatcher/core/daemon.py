"""The daemon: its lifecycle and its loop, in one screen (uvicorn's ``Server.serve``).

``serve`` starts up (ledger, watch, recovery, the first scan, READY), then loops
until asked to stop, then shuts down. One turn of the loop waits on one wake-up
(a file event, a job's end, a signal, a request) with a timeout set by the next
timer, then runs ``tick``: it pings the watchdog, rescans when due, promotes
settled files, and starts what may start. Agents, their pipes and timers live
on the same asyncio loop (``runner``); blocking work runs in ``lanes``.
Signal handlers only set a flag and wake the loop.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import time
from pathlib import Path

import structlog

from dispatcher import early, procs, storage
from dispatcher.core import announce, startup, stopwatch
from dispatcher.core.fencing import Fencing
from dispatcher.core.fsevents import InotifyWatch, ObserverWatch, start_watch
from dispatcher.core.gatekeeper import GateKeeper, gated_agents
from dispatcher.core.housekeeping import Housekeeping
from dispatcher.core.lease import LeaseKeeper
from dispatcher.core.notify import Notifications
from dispatcher.core.reloading import Reloading
from dispatcher.core.scheduler import SLOT_RETRY_S, Scheduler
from dispatcher.core.sdnotify import Notifier
from dispatcher.core.watcher import Inbox, list_inbox
from dispatcher.core.work import Kind
from dispatcher.job import hooks, intake, repowork, worktree
from dispatcher.job.context import JobContext
from dispatcher.job.finish import Finisher
from dispatcher.job.joins import Joined, Joins
from dispatcher.job.waits import unsupported_budget_gates
from dispatcher.lanes import HOLD_S, Lanes
from dispatcher.layout import Layout
from dispatcher.ledger.base import DaemonInfo
from dispatcher.ledger.flocks import note_ledger
from dispatcher.lifecycle import Stop
from dispatcher.shortage import SHORT
from dispatcher.spec.config import config_mark
from dispatcher.spec.settings import Config
from dispatcher.store.ledgers import open_ledger
from dispatcher.text import plural
from dispatcher.wakeup import Wakeup

log = structlog.get_logger("dispatcher")
READY_WAIT_S = 10.0  # the longest READY=1 waits for the recovery of jobs adopted at start
STATUS_EVERY_S = 1.0  # STATUS= is told at most this often (it was a datagram at every turn of the loop)
GIVE_UP_EARLY_S = 1.5  # ledger waits end this long before a stop's deadline


def once_note(failed: int, refused: int, left: int) -> str:
    """Return the stderr line of `run --once` exiting 1: what it finished that was not done, what it left."""
    parts = [
        *([f"{plural(failed, 'job')} failed"] if failed else []),
        *([f"{plural(refused, 'file')} refused"] if refused else []),
        *([f"{plural(left, 'file')} it could not take left in inbox/"] if left else []),
    ]
    return f"run --once: {', '.join(parts)}"


class Daemon(Reloading, Fencing):
    """`dispatcher run`: watch inbox/, claim, run, verify, move; recover what others left."""

    sched: Scheduler

    def __init__(self, config: Config, *, config_path: Path | None, root_override: Path | None, once: bool) -> None:
        self.config = config
        self.config_path = config_path
        self.root_override = root_override
        self.once = once
        self.layout = Layout(config.root)
        host = socket.gethostname().replace(".", "_")  # owner ids never hold a dot (staging names split on it)
        self.owner = f"{host}-{os.getpid()}-{os.urandom(3).hex()}"
        self.notifier = Notifier()
        self.stopping = False
        self.forced = False  # a second stop signal came
        self.lost = False
        self.exit_note: str | None = None  # the one line on stderr of an exit 1 (section 7)
        self._was_fenced = False
        self.stop_deadline: float | None = None
        self._stop_at: float | None = None  # the stop's deadline as it was set (stop_deadline is cleared when due)
        self._signals: list[int] = []
        self._ready = False
        self._watching = False  # the stop's watch (core.stopwatch) was started
        self._wake: Wakeup | None = None
        self._next_rescan = 0.0
        self._looked_last = False  # `run --once` rescanned once more before its exit (``_last_look``)
        self._next_watchdog = 0.0
        self._status_due: float | None = None  # when the next STATUS= is told (a turn since the last one asks it)
        self._status_told = (0.0, "")  # when the last STATUS= was told, and its text
        self.watch: InotifyWatch | ObserverWatch | None = None  # None: `watch: poll`, or inotify out of reach
        self._watch_error: str | None = None  # why the watch of inbox/ could not start, once logged

    # -- lifecycle -------------------------------------------------------------------------------
    def serve(self) -> int:
        """Run until stopped (or, with --once, until the inbox is drained); return the exit code."""
        startup.raise_fd_limit()  # the soft limit up to the hard one, before the loop takes its descriptors
        loop = startup.new_loop(early.stop_noted)
        if loop is None:  # a stop while short of descriptors for the loop itself: nothing was claimed
            signum = next((sig for sig in early.taken() if sig != signal.SIGHUP), signal.SIGTERM)
            self.notifier.stopping()
            log.info("daemon.stopping", signal=signal.Signals(signum).name, running=0)
            log.info("daemon.stopped", reason="a stop came during start-up, before any job was claimed")
            return 0
        with asyncio.Runner(loop_factory=lambda: loop) as runner:
            return runner.run(self._serve())

    async def _serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in early.CAUGHT:
            loop.add_signal_handler(sig, self.handle_signal, sig)
        for signum in early.taken():  # came while the process started
            self.handle_signal(signum)
        try:
            try:
                await self.startup()
            except Exception:
                if not self._stop_asked():
                    raise
                # a stop given up start-up (the ledger out of reach, a shortage): said as any stop is, no READY=1
                signum = next((sig for sig in self._signals if sig != signal.SIGHUP), signal.SIGTERM)
                self.notifier.stopping()
                log.info("daemon.stopping", signal=signal.Signals(signum).name, running=0)
                log.info("daemon.stopped", reason="a stop came during start-up, before any job was claimed")
                return 0  # nothing was claimed: there is nothing to recover
            while not self.should_exit():
                await self.wait()
                self.tick()
            return await self.shutdown()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    async def startup(self) -> None:
        """Open the ledger, watch inbox/, recover what dead daemons left, scan, then READY=1."""
        procs.one_malloc_arena()  # before the lanes' threads start
        gc.collect()  # what start-up left (the command line's parsers): freed before the daemon settles
        gc.freeze()  # and the rest kept out of every later collection's walk
        self.loop = asyncio.get_running_loop()
        self._wake = Wakeup(self.loop)
        await startup.make_folders(self.layout, self._stop_asked)
        # in the ledger lane, off the loop, so that a stop is heard while the ledger is out of reach (its
        # waits check _give_up); not in asyncio's default pool, whose threads would then idle for good
        memory = storage.in_memory(self.layout.root)
        hold = HOLD_S if memory and self.config.ledger == "sqlite" else 0.0
        self.lanes = Lanes(files_in_memory=memory, hold_ledger_s=hold)
        self.ledger = await startup.while_short(
            lambda: self.lanes.ledger(open_ledger, self.config, self.layout, give_up=self._give_up), self._stop_asked
        )
        self.ledger.set_give_up(self._give_up)
        info = DaemonInfo(
            self.owner, os.getpid(), socket.gethostname(), time.time(), config_digest=config_mark(self.config)
        )
        await startup.while_short(lambda: self.lanes.ledger(self.ledger.register, info), self._stop_asked)
        note_ledger(
            self.layout.daemons, self.owner, self.config.ledger, self.config.lease_s
        )  # what `validate` compares before a reload
        self.notify = Notifications(lambda: self.config, self.layout.root)
        self.metrics = self._metrics(self.config)
        self.inbox = Inbox(self.layout.inbox, self.config.settle_s, wait_for_writers=not self.once, wake=self.wakeup)
        self.final_hooks = repowork.FinalHooks(self.layout, self.lanes, self._config, self.notify)
        finisher = Finisher(
            self.layout,
            self.ledger,
            self.lanes,
            self._config,
            notify=self.notify,
            hints=self.inbox,
            metrics=self.metrics,
            after_hooks=self.final_hooks,
        )
        finisher.bind(self.loop)
        finisher.stopping = lambda: self.stopping
        joins = Joins(self.layout, self.ledger, finisher, self._config)
        finisher.on_final = joins.on_final
        self.gatekeeper = GateKeeper(
            self.ledger,
            self.lanes,
            lambda: self.config.agents,
            self.wakeup,
            self.metrics,
            shared=self.ledger.leases is not None,
            idle_s=self._rescan_interval(),
            stale=lambda gates, now: unsupported_budget_gates(gates, self.config, self.ledger.costs_since, now),
        )
        ctx = JobContext(
            layout=self.layout,
            ledger=self.ledger,
            lanes=self.lanes,
            finisher=finisher,
            config=self._config,
            stopping=self._stopping,
            fenced=self._fenced,
            metrics=self.metrics,
            gates=self.gatekeeper.gates,
            note_gate=self.gatekeeper.note,
            recovered=self._recovered,
        )
        self.sched = Scheduler(ctx, self.inbox, self.wakeup, joins)
        self.claims = self.sched.claims
        self.claims.unwatched = lambda: self.watch is None  # (read in the ledger lane: a snapshot is enough)
        self.claims.stopping = lambda: self.stopping  # a trip under way when a stop begins claims nothing more
        joins.ready, joins.failed = self._joined, self.sched.join_failed
        self.lease: LeaseKeeper | None = None
        leases = self.ledger.leases
        if leases is not None:
            self.lease = LeaseKeeper(
                leases, self.config.lease_s, self._hosts_lost, lambda: self.loop.call_soon_threadsafe(self.wakeup)
            )
            self.lease.start()
        self.house = Housekeeping(
            ctx,
            self.sched,
            self.inbox,
            check_watch=self._check_watch,
            wake=self.wakeup,
            shared=self.lease is not None,
            joins=joins,
            stop_asked=self._stop_asked,
        )
        log.info(
            "daemon.started", root=str(self.layout.root), pid=os.getpid(), owner=self.owner,
            max_jobs=self.config.max_jobs, agents=sorted(self.config.agents), once=self.once, ledger=self.config.ledger,
            files="memory" if self.lanes.files_in_memory else "disk",
        )  # fmt: skip
        announce.config_findings(self.config)
        announce.other_daemons(self.ledger, self.owner, self.config.metrics_file)
        self._check_watch(first=True)  # inotify (or, short of it, the rescans every poll_interval)
        # short of descriptors here too (ulimit -n 12): daemon.short_of, step start, and again, as above
        listed = await startup.while_short(lambda: self.lanes.scan(list_inbox, self.layout.inbox), self._stop_asked)
        self.inbox.merge(listed)
        if self.inbox.wait_for_writers:  # the files already settled by their age: no writer may hold one open
            await startup.while_short(self.house.settle_now, self._stop_asked)
        await startup.while_short(
            lambda: repowork.housekeep(self.layout, self.lanes, self.config, self.notify, startup=True),
            self._stop_asked,
        )
        await startup.while_short(self.gatekeeper.refresh, self._stop_asked)  # gates survive restarts
        self.gatekeeper.start()
        await self.house.recover(startup=True)  # a dead daemon's agents are ended before READY=1
        # a decision a killed approve or reject left half done was finished just now: its after hook and landing are
        # owed from here on, not from the next rescan (which `run --once` would never reach)
        self.house.run_owed()
        await self.house.requests()
        self._next_rescan = time.monotonic() + self._rescan_interval()
        self.tick()
        await self._recovery_decided()
        self._ready = True
        if self.stopping:  # a stop during start-up said STOPPING=1 already: never READY=1 (or its line) after it
            return
        self.notifier.ready()
        log.info("daemon.ready", active=len(self.sched.running), inbox=len(self.inbox))

    async def _recovery_decided(self) -> None:
        """Run the loop until every job adopted at start has its recovery decided (READY=1 comes after).

        Bounded by READY_WAIT_S: a recovered job that waits for a slot (more of them than
        ``max_jobs``) is decided when it gets one, after READY=1.
        """
        ctx = self.house.ctx
        deadline = time.monotonic() + READY_WAIT_S
        while ctx.unrecovered and not self.stopping and time.monotonic() < deadline:
            await self.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            self.tick()
        ctx.unrecovered.clear()

    def _recovered(self, job_id: str) -> None:
        ctx = self.house.ctx
        if job_id in ctx.unrecovered:
            ctx.unrecovered.discard(job_id)
            self.wakeup()

    def _stop_asked(self) -> bool:
        """Return True once SIGTERM or SIGINT came (noted by the handler, or already handled)."""
        return self.stopping or any(sig != signal.SIGHUP for sig in self._signals)

    def _give_up(self) -> bool:
        """Should a ledger wait give up? Before READY at once on a stop; after, ``GIVE_UP_EARLY_S`` before its deadline.

        Called from the lanes' threads. A wait checks this between tries (SQLite's at most
        about half a second apart), and the shutdown that follows takes a moment too: ending
        the waits early keeps the stop within ``stop_timeout`` while the ledger is locked or
        out of reach (section 13). Whatever could not be recorded is recovered at the next start.
        """
        if self._wake is None or not self._ready:
            return self._stop_asked()
        deadline = self.stop_deadline
        return self.stopping and (deadline is None or time.monotonic() >= deadline - GIVE_UP_EARLY_S)

    def should_exit(self) -> bool:
        if self.stopping:  # an owed after or land hook runs like an agent: until the stop's deadline
            return not (self.sched.running or self.sched.inflight or self.house.hooks_busy or self.final_hooks.busy)
        if self.once:
            if self.house.apart:  # a dead daemon's job whose agent runs on out of sight: taken over at a rescan
                return False
            # `run --once` leaves them, as orders due later: unread orders, and claimed jobs (a retry, a
            # revision, a recovered job) set aside in active/ for a pause or a gate beyond max_limit_wait
            # and files it can never take (made immutable): logged at the exit, which is then 1
            aside = self.sched.aside
            names = intake.stuck_names()
            stuck = len(self.inbox.tracked(names)) if names else 0
            if not (self.inbox.any_aside() or aside):
                return self._last_look(not (self.sched.busy() or len(self.inbox) - stuck or self.house.busy))
            held = self._held_for_long() | self.sched.removed  # orders of an agent a reload removed: left too
            left = self.inbox.aside_for(held) if self.inbox.any_aside() else 0
            busy = self.sched.busy(aside=False) or len(aside) > aside.held_for(held)
            return self._last_look(not (busy or len(self.inbox) - left - stuck or self.house.busy))
        return False

    def _last_look(self, done: bool) -> bool:
        """`run --once`'s exit, once more recovery found nothing new: jobs it left to a daemon alive then are
        looked at once more before it exits (that daemon may have died while this one ran: a stop's jobs)."""
        if not done or not self.house.kept or self._looked_last:
            return done
        self._looked_last = True
        self._next_rescan = time.monotonic()  # the next turn rescans: recovery takes over a dead daemon's jobs
        return False

    def _held_for_long(self) -> set[str]:
        """Return the agents a gate holds that will not lift within max_limit_wait (a pause by hand: never)."""
        now = time.time()
        bound = now + self.config.max_limit_wait_s
        return gated_agents(
            [g for g in self.gatekeeper.gates() if g.until is None or g.until > bound], self.config.agents, now
        )

    async def wait(self, at_most: float | None = None) -> None:
        """Wait for a wake-up or the next timer (or ``at_most`` seconds)."""
        assert self._wake is not None  # noqa: S101
        timeout = self._timeout() if at_most is None else min(at_most, self._timeout())
        if timeout > 0 and not self._wake.is_set():
            await self._wake.wait(timeout)
        else:
            await asyncio.sleep(0)  # let callbacks that are ready run (pipes, lanes, timers)
        self._wake.clear()

    def tick(self) -> None:
        """Handle signals, ping the watchdog, rescan when due, promote settled files, start work."""
        while self._signals:
            self._signal(self._signals.pop(0))
        now = time.monotonic()
        if self.notifier.watchdog_interval_s and now >= self._next_watchdog:
            self.notifier.watchdog()
            self._next_watchdog = now + self.notifier.watchdog_interval_s
        if now >= self._next_rescan:
            self._next_rescan = now + self._rescan_interval()
            self.house.start(self.house.rescan(), "rescan")
        if self.stopping and not self._watching:
            self._watch_the_stop()  # its thread could not start at the signal (a shortage of processes)
        if self.stop_deadline is not None and now >= self.stop_deadline:
            self.sched.abort_all(Stop.STOPPED)
            hooks.RUNNING.stop_all()  # hooks run like agents: ended at the stop's deadline too
            worktree.CHECKOUTS.end_all()  # and a worktree's checkout: its job, with no agent yet, waits
            self.notify.end_running()  # and notifications: none outlasts the deadline waiting for the agents
            self.stop_deadline = None
        self.house.promote_settled()
        if self.lease is not None and self._fence():
            return
        self.sched.start_work()
        self.house.joins_due()
        self.house.metrics_due()
        if self.notifier.enabled:
            self._status_when_due(now)

    async def shutdown(self) -> int:
        """Stop watching, flush the ledger lane, release the ledger, exit 0 (1 for a failed --once)."""
        if self.once and not self.stopping:  # no signal: `run --once` ran out of work, and stops as a daemon does
            log.info("daemon.stopping", reason="run --once: no work left", running=0)
        # notifications may run until the stop's deadline, or end at once after a second stop (a forced one)
        notify_until = (self.stop_deadline or self._stop_at or time.monotonic()) if self.stopping else None
        if self.stopping:  # from here on a ledger wait gives up: what it could not record, the next start recovers
            self.stop_deadline = None
        if self.watch is not None:
            self.watch.close()
        if self.lease is not None:
            self.lease.stop(wait=not self.ledger.giving_up())
        self.notifier.stopping()
        await self.gatekeeper.stop()
        await self.house.close()
        await self.sched.drain()
        await self.final_hooks.drain()  # after hooks of jobs cancelled in their claim or failed in a join
        await self.notify.close(
            notify_until,
            hurry=lambda: self.forced or any(sig != signal.SIGHUP for sig in self._signals),
            drain=self.once and not self.stopping,  # `run --once` ran out of work: its notifications all run
            forced=self._forced_now,
            stop_s=self.config.stop_timeout_s,
        )
        if self.metrics is not None:
            await self.house.write_metrics()
        self.lanes.shutdown(wait=True)
        self.ledger.close()
        s = self.sched.stats.finished
        given_up = self._given_up() if self.once and not self.stopping else {}
        log.info("daemon.stopped", **s)
        if self.once:
            if s["failed"] == 0 and s["refused"] == 0 and not given_up:
                return 0
            self.exit_note = once_note(s["failed"], s["refused"], len(given_up))
            return 1
        if self.lost:
            self.exit_note = "run: the lease of this daemon was taken over by another (lease.fenced); it stopped"
            return 1
        return 0

    def _given_up(self) -> dict[str, int]:
        """Log each file `run --once` ends without (it could never take it); return them with their tries."""
        stuck = intake.stuck_names()
        left = {name: stuck[name] for name in self.inbox.tracked(stuck)}
        for name, tries in sorted(left.items()):
            log.error(
                "order.stuck",
                file=name,
                tries=tries,
                reason="the daemon could not take this file (its daemon.error says why); it is left in inbox/",
            )
        return left

    # -- events ----------------------------------------------------------------------------------
    def wakeup(self) -> None:
        """Make the loop run a turn now."""
        if self._wake is not None:
            self._wake.set()

    def _joined(self, joined: list[Joined]) -> None:
        """Waiting jobs were taken and moved to active/ (from the ledger lane): park them on the loop, in one call."""
        self.loop.call_soon_threadsafe(self.sched.park_all_joined, joined)

    def hint(self, kind: str, name: str) -> None:
        """A filesystem hint from the watch (on the loop)."""
        if kind == "control":
            self.house.start(self.house.requests(), "requests")
            self.gatekeeper.kick()  # `pause` and `resume` drop hints too
        elif kind == "rescan":
            self._next_rescan = 0.0
        else:
            self.inbox.hint(kind, name)  # it wakes the loop when the event is one a turn may act on
            return
        self.wakeup()

    def handle_signal(self, signum: int, frame: object = None) -> None:
        """Signal handler: note the signal and wake the loop; at the first stop, start the stop's watch."""
        self._signals.append(signum)  # first: a stop is never lost, whatever the watch below can do
        self.wakeup()
        if signum != signal.SIGHUP:
            self._watch_the_stop()

    def _forced_now(self) -> bool:
        """Return True once a second stop signal came, also one the loop, ended already, never took."""
        pending = sum(sig != signal.SIGHUP for sig in self._signals)
        return self.forced or pending >= (1 if self.stopping else 2)

    def _watch_the_stop(self) -> None:
        """Start the stop's watch once; short of processes (no thread now), the loop tries again at its turns."""
        if self._watching:
            return
        # from when the ledger's waits give up (at once before READY=1): calls hung on a silent server are cut
        wait_s = max(0.0, self.config.stop_timeout_s - GIVE_UP_EARLY_S) if self._ready else 0.0
        try:
            stopwatch.watch(
                lambda: getattr(self, "ledger", None), time.monotonic() + wait_s, self.config.stop_timeout_s
            )
        except RuntimeError:  # "can't start new thread": RLIMIT_NPROC or memory
            return
        self._watching = True

    def _signal(self, signum: int, reason: str | None = None) -> None:
        if signum == signal.SIGHUP:
            before = self.config
            self.reload()
            if self.config is not before:
                self._watch_reloaded(before)
            return
        if self.stopping:
            self.forced = True  # a second stop: what still runs at the shutdown is ended at once too
            log.warning("daemon.stopping", forced=True)
            self.sched.abort_all(Stop.STOPPED, now=True)
            hooks.RUNNING.stop_all(now=True)
            worktree.CHECKOUTS.end_all()
            return
        self.stopping = True
        self.notifier.stopping()
        running, stop_timeout = len(self.sched.running), self.config.stop_timeout_s
        if reason is not None:  # its own stop (declared lost): one line, an error, saying why and no signal
            log.error("daemon.stopping", reason=reason, running=running, stop_timeout=stop_timeout)
        else:
            name = signal.Signals(signum).name
            log.info("daemon.stopping", signal=name, running=running, stop_timeout=stop_timeout)
        self.stop_deadline = self._stop_at = time.monotonic() + self.config.stop_timeout_s
        self.sched.abort_all(Stop.STOPPED, only_waiting=True)

    # -- helpers -------------------------------------------------------------------------------
    def _timeout(self) -> float:
        ready = self.inbox.has_ready()  # (orders held back by not_before and due now are ready from here on)
        if ready and not self.stopping and self.sched.may_read():
            return 0.0
        now = time.monotonic()
        waits = [self._next_rescan - now, self.house.next_due(now)]
        due = self.inbox.next_due_s()  # an order held back by not_before
        if due is not None:
            waits.append(due)
        if SHORT.short():
            waits.append(SHORT.wait_s())
        elif ready and (held := SHORT.claims_wait_s()):
            waits.append(held)  # new orders wait for descriptors to start their agents (``SHORT.room``)
        if self.notifier.watchdog_interval_s:
            waits.append(self._next_watchdog - now)
        if self._status_due is not None:
            waits.append(self._status_due - now)
        if self.stop_deadline is not None:
            waits.append(self.stop_deadline - now)
        if self.sched.slot_poll:
            waits.append(SLOT_RETRY_S)
        if self.lease is not None and (fence_in := self.lease.next_check_s()) is not None:
            waits.append(fence_in)  # an idle loop still fences itself at lease/2 (section 12)
        return max(0.0, min(waits))

    def _rescan_interval(self) -> float:
        polled = self.config.watch == "poll" or self.watch is None  # (a watch that could not start: polled)
        return self.config.poll_interval_s if polled else self.config.rescan_interval_s

    def _watch_reloaded(self, before: Config) -> None:
        """Apply a reloaded `watch`, `poll_interval` and `rescan_interval` now, not at the old listing's time."""
        if before.watch != self.config.watch:
            if self.config.watch == "poll" and self.watch is not None:
                self.watch.close()
                self.watch = None
            else:
                self._check_watch(first=True)  # inotify from now on (the rescans stay its safety net)
            log.info("watcher.changed", watch=self.config.watch, poll_interval=self.config.poll_interval_s)
        self._next_rescan = min(self._next_rescan, time.monotonic() + self._rescan_interval())
        self.wakeup()

    def _config(self) -> Config:
        return self.config

    def _stopping(self) -> bool:
        return self.stopping

    def _check_watch(self, *, first: bool = False) -> None:
        """Start (``first``) or restart the watch of inbox/: it died, or inbox/ was removed or moved away.

        The rescan's check. A missing inbox/ is made again. A watch that cannot start (no inotify instance left) leaves
        the rescans, every ``poll_interval``, to notice files until it can.
        """
        if self.config.watch == "poll" or (self.watch is not None and self.watch.alive()):
            return
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        try:
            if not first:  # (at start the folders were just made)
                for folder in (self.layout.inbox, self.layout.control):
                    os.makedirs(folder, exist_ok=True)
            self.watch = start_watch(self.layout.inbox, self.layout.control, self.hint)
        except OSError as exc:
            if self._watch_error != exc.strerror:
                log.error("watcher.failed", error=exc.strerror or str(exc), poll_interval=self.config.poll_interval_s)
            self._watch_error = exc.strerror
            return
        if not first or self._watch_error is not None:
            log.error("watcher.restarted", reason="inbox/ was removed, moved away or its watch died: watched again")
        self._watch_error = None

    def _status_when_due(self, now: float) -> None:
        """Tell STATUS= at most once a second, after the turns that may have changed it (none while idle)."""
        due = self._status_due
        if due is None:
            due = self._status_due = max(now, self._status_told[0] + STATUS_EVERY_S)
        if now >= due:
            self._status_due = None  # this turn tells it; the next turn that happens asks again
            self._status(now)

    def _queued(self) -> int:
        """Return the work waiting here: inbox/ names (a parked order's among them) and claimed jobs not started."""
        claimed = sum(1 for p in self.sched.parked if p.kind is not Kind.NEW)  # a NEW one is an inbox/ name
        return len(self.inbox) + claimed + len(self.sched.aside)

    def _status(self, now: float) -> None:
        """Tell systemd what runs and waits (asked only when it listens: ``notifier.enabled``), if it changed."""
        s = self.sched.stats.finished
        text = (
            f"running {len(self.sched.running)},"
            f" queued {self._queued()},"
            f" done {s['done']}, failed {s['failed']}, refused {s['refused']}"
        )
        if text != self._status_told[1]:
            self.notifier.status(text)
        self._status_told = (now, text)
