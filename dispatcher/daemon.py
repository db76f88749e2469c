"""The daemon: one loop that takes orders from inbox/ and runs each job in a worker thread.

The lifecycle reads in one screen (``serve``): start up (recover, scan, READY),
loop until asked to stop (``tick``), shut down. A tick waits on one queue (file
events, finished jobs, control hints, signals) with a timeout set by the next
timer (settle, rescan, watchdog), starts what may start and never blocks on
a job. Signal handlers only put a message on that queue (``SimpleQueue.put`` is
reentrant) and return.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from dispatcher import claim, fsutil, recovery
from dispatcher.config import Config, load_config
from dispatcher.errors import ConfigError
from dispatcher.followups import release_followups
from dispatcher.job import CANCELLED, STOPPED, Context, JobRun
from dispatcher.layout import UMASK, Layout, State
from dispatcher.ledger import DONE, FAILED, Entry, Ledger
from dispatcher.sdnotify import Notifier
from dispatcher.slots import Slots, make_lock, owner_alive
from dispatcher.watcher import InboxTracker, start_observer

log = structlog.get_logger("dispatcher")
_SLOT_RETRY_S = 0.25
PARK_LIMIT = 64  # orders read ahead while their agents are busy


@dataclass
class _Running:
    run: JobRun
    slot: str | None
    thread: threading.Thread


@dataclass
class _Parked:
    """Work that waits for a slot: a new order, a recovered job or a retry."""

    kind: str
    job_id: str
    agent: str
    item: claim.Inspected | None = None


@dataclass
class Stats:
    finished: dict[str, int] = field(default_factory=lambda: {"done": 0, "failed": 0, "refused": 0})


class Daemon:
    """`dispatcher run`: watch inbox/, claim, run, verify, move; recover what others left."""

    def __init__(self, config: Config, *, config_path: Path | None, root_override: Path | None, once: bool) -> None:
        self.config = config
        self.config_path = config_path
        self.root_override = root_override
        self.once = once
        self.layout = Layout(config.root)
        host = socket.gethostname().replace(".", "_")  # owner ids never hold a dot (staging names split on it)
        self.owner = f"{host}-{os.getpid()}-{os.urandom(3).hex()}"
        self.q: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.running: dict[str, _Running] = {}
        self.parked: collections.deque[_Parked] = collections.deque()
        self.stats = Stats()
        self.stopping = False
        self.stop_deadline: float | None = None
        self.notifier = Notifier()
        self._next_rescan = 0.0
        self._next_watchdog = 0.0
        self._slot_poll = False
        self._alive_cache: dict[str, bool] = {}

    # -- lifecycle -------------------------------------------------------------
    def serve(self) -> int:
        """Run until stopped (or, with --once, until the inbox is drained); return the exit code."""
        old = self._capture_signals()
        try:
            self.startup()
            while not self._should_exit():
                self.tick()
            return self.shutdown()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def startup(self) -> None:
        os.umask(UMASK)
        self.layout.create()
        self.ledger = Ledger(self.layout.ledger)
        self.slots = Slots(self.layout.slots)
        self._life = make_lock(self.layout.daemons / f"{self.owner}.lock")
        self._life.acquire()
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        fsutil.write_atomic(self.layout.daemons / f"{self.owner}.json", json.dumps(info).encode(), sync=False)
        self.ctx = Context(
            self.layout,
            self.ledger,
            self.owner,
            lambda: self.config,
            lambda name: self.q.put(("fs", "moved", name)),
            self._cancel_requested,
            lambda: self.stopping,
        )
        self.tracker = InboxTracker(self.layout.inbox, self.config.settle_s, wait_for_writers=not self.once)
        log.info(
            "daemon.started",
            root=str(self.layout.root),
            pid=os.getpid(),
            owner=self.owner,
            max_jobs=self.config.max_jobs,
            agents=sorted(self.config.agents),
            once=self.once,
        )
        self.observer = start_observer(self.layout.inbox, self.layout.control, self.q.put)
        self.tracker.scan()  # first, so that recovery's cancel requests can find queued orders
        self._recover()
        self._next_rescan = time.monotonic() + self.config.rescan_interval_s
        self._start_work()
        self.notifier.ready()
        self._status()
        log.info("daemon.ready", active=len(self.running), inbox=len(self.tracker))

    def _should_exit(self) -> bool:
        if self.stopping:
            return not self.running
        if self.once:
            return not (self.running or self.parked or len(self.tracker) or self.ledger.requests("retry"))
        return False

    def tick(self) -> None:
        """Wait briefly for one message, handle everything queued, start what may start."""
        self._alive_cache.clear()
        try:
            self._handle(self.q.get(timeout=self._timeout()))
            while True:
                self._handle(self.q.get_nowait())
        except queue.Empty:
            pass
        now = time.monotonic()
        if now >= self._next_rescan:
            self._rescan()
        if self.notifier.watchdog_interval_s and now >= self._next_watchdog:
            self.notifier.watchdog()
            self._next_watchdog = now + self.notifier.watchdog_interval_s
        if self.stop_deadline is not None and now >= self.stop_deadline:
            self._abort_all(STOPPED)
            self.stop_deadline = None
        self.tracker.due()
        if not self.stopping:
            self._start_work()
        self.slots.flush()

    def _timeout(self) -> float:
        now = time.monotonic()
        waits = [self._next_rescan - now]
        settle = self.tracker.due()
        if settle is not None:
            waits.append(settle)
        can_read = len(self.running) < self.config.max_jobs and len(self.parked) < PARK_LIMIT
        if self.tracker.has_ready() and can_read and not self.stopping:
            return 0.0  # a file just settled: take it now, not at the next event
        if self.notifier.watchdog_interval_s:
            waits.append(self._next_watchdog - now)
        if self.stop_deadline is not None:
            waits.append(self.stop_deadline - now)
        if self._slot_poll:
            waits.append(_SLOT_RETRY_S)
        return max(0.0, min(waits))

    def shutdown(self) -> int:
        self.observer.stop()
        self.notifier.stopping()
        self.ledger.close()
        self._life.release()
        log.info("daemon.stopped", **self.stats.finished)
        if self.once:
            s = self.stats.finished
            return 0 if s["failed"] == 0 and s["refused"] == 0 else 1
        return 0

    # -- messages --------------------------------------------------------------
    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "fs":
            if msg[1] == "rescan":
                self._next_rescan = 0.0
            else:
                self.tracker.event(msg[1], msg[2])
        elif kind == "finished":
            self._finished(msg[1], msg[2])
        elif kind == "control":
            self._control()
        elif kind == "signal":
            self._signal(msg[1])

    def _capture_signals(self) -> dict[int, Any]:
        old: dict[int, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            old[sig] = signal.signal(sig, self.handle_signal)
        return old

    def handle_signal(self, signum: int, frame: Any = None) -> None:
        """Signal handler: only queue the signal for the loop."""
        self.q.put(("signal", signum))

    def _signal(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            self.reload()
            return
        if self.stopping:
            log.warning("daemon.stopping", forced=True)
            self._abort_all(STOPPED)
            return
        self.stopping = True
        self.notifier.stopping()
        log.info(
            "daemon.stopping",
            signal=signal.Signals(signum).name,
            running=len(self.running),
            stop_timeout=self.config.stop_timeout_s,
        )
        self.stop_deadline = time.monotonic() + self.config.stop_timeout_s
        for r in self.running.values():
            if r.run.waiting_retry:
                r.run.abort.trigger(STOPPED)

    def reload(self) -> None:
        """Reload the config (SIGHUP); keep the old one if the new one is bad or moves the root."""
        from dispatcher import logs

        try:
            logs.SINK.open_file(self.config.log_file)  # reopen for logrotate, whatever the new config says
        except OSError as exc:
            log.error("log_file.reopen_failed", error=str(exc))
        if self.config_path is None:
            log.error("config.rejected", error="no config file to reload")
            return
        try:
            new = load_config(self.config_path, root=self.root_override)
        except ConfigError as exc:
            log.error("config.rejected", error=str(exc))
            return
        if new.root != self.config.root:
            log.error("config.rejected", error=f"{self.config_path}: root: cannot change while running")
            return
        if new.log_file != self.config.log_file:
            try:
                logs.SINK.open_file(new.log_file)
            except OSError as exc:
                log.error("config.rejected", error=f"{self.config_path}: log_file: {exc.strerror}")
                return
        self.config = new
        self.tracker.settle_s = new.settle_s
        log.info("config.reloaded", agents=sorted(new.agents), max_jobs=new.max_jobs)

    def _abort_all(self, reason: str) -> None:
        for r in self.running.values():
            r.run.abort.trigger(reason)

    # -- finding work ----------------------------------------------------------
    def _alive(self, owner: str) -> bool:
        """Return True while the daemon ``owner`` lives (its liveness lock is held); cached for one tick."""
        if owner == self.owner:
            return True
        alive = self._alive_cache.get(owner)
        if alive is None:
            alive = self._alive_cache[owner] = owner_alive(self.layout.daemons, owner)
        return alive

    def _recover(self) -> None:
        recovery.finish_staging(self.layout, self._alive)
        recovery.settle_ledger(self.layout, self.ledger, self._alive)
        self._adopt_orphans()
        self._release_orphaned()
        self._control()

    def _release_orphaned(self) -> None:
        """Release the follow-ups of done parents whose daemon died before releasing them."""
        parents = {e.parent for e in self.ledger.pending_releases() if e.parent and not self._alive(e.owner or "")}
        for parent in sorted(parents):
            release_followups(self.layout, self.ledger, self.owner, parent, self.ctx.released)

    def _adopt_orphans(self) -> None:
        for job_id in recovery.orphaned_jobs(self.layout, self.ledger, self.owner, self._alive):
            folder = self.layout.job(State.ACTIVE, job_id)
            # its agent is ended now, before READY=1 and before any slot is free for it
            self._guarded(job_id, recovery.end_leftover_agent, folder, self.config.kill_grace_s)
            agent = recovery.job_agent(folder)
            self.parked.appendleft(_Parked("recover", job_id, agent))

    def _rescan(self) -> None:
        self._next_rescan = time.monotonic() + self.config.rescan_interval_s
        if not self.observer.is_alive():
            log.error("watcher.restarted")
            self.observer = start_observer(self.layout.inbox, self.layout.control, self.q.put)
        self.tracker.scan()
        if not self.stopping:
            # a peer daemon may have died since the start: finish what it left
            recovery.finish_staging(self.layout, self._alive)
            recovery.settle_ledger(self.layout, self.ledger, self._alive)
            self._adopt_orphans()
            self._release_orphaned()
        self._control()

    def _control(self) -> None:
        """Carry out cancel and retry requests recorded in the ledger."""
        for job_id in self.ledger.requests("cancel"):
            self._cancel(job_id)
        if self.stopping:
            return
        for job_id in self.ledger.requests("retry"):
            if any(p.job_id == job_id for p in self.parked) or job_id in self.running:
                continue
            folder = self.layout.job(State.FAILED, job_id)
            if not (folder / claim.JOB_FILE).exists():
                self.ledger.clear_request(job_id, "retry")
                continue
            self.parked.append(_Parked("retry", job_id, recovery.job_agent(folder)))

    def _cancel_requested(self, job_id: str) -> bool:
        return self.ledger.has_request(job_id, "cancel")

    def _cancel(self, job_id: str) -> None:
        if job_id in self.running:
            self.running[job_id].run.abort.trigger(CANCELLED)
            return
        entry = self.ledger.get(job_id)
        if entry is not None and entry.state in (DONE, FAILED):
            self.ledger.clear_request(job_id, "cancel")
            return
        if not any(p.job_id == job_id for p in self.parked):
            self._park_ready()  # the order may still wait unread in inbox/ for a slot
        for p in list(self.parked):
            if p.job_id == job_id:
                self.parked.remove(p)
                self._launch(p, slot=None)
                return
        if entry is None and not self.tracker.has_pending() and not self._any_daemon_but_me():
            # no order with this id is left anywhere (its file was removed): drop the request,
            # so that a later order that reuses the id is not cancelled by it
            self.ledger.clear_request(job_id, "cancel")
            log.info("cancel.dropped", job_id=job_id, reason="no queued order has this job id")

    def _any_daemon_but_me(self) -> bool:
        """Return True if another live daemon shares the root (it may hold the order)."""
        for path in self.layout.daemons.glob("*.lock"):
            owner = path.name[: -len(".lock")]
            if owner != self.owner and self._alive(owner):
                return True
        return False

    def _park_ready(self) -> None:
        """Read every ready inbox file now (refusing bad ones), parking the orders for a slot."""
        while (name := self.tracker.pop()) is not None:
            found = self._take(name)
            if found is not None:
                self.parked.append(found)

    # -- starting work ---------------------------------------------------------
    def _start_work(self) -> None:
        self._slot_poll = False
        blocked: set[str] = set()
        # parked work first (recoveries, retries, orders whose agent was busy), oldest first
        for p in list(self.parked):
            if len(self.running) >= self.config.max_jobs:
                return
            if p.agent in blocked:
                continue
            slot = self._slot(p.agent)
            if slot is None:
                blocked.add(p.agent)
                continue
            self.parked.remove(p)
            self._launch(p, slot)
        # then new orders; reading stops once enough wait for busy agents (memory stays flat)
        while len(self.running) < self.config.max_jobs and len(self.parked) < PARK_LIMIT:
            name = self.tracker.pop()
            if name is None:
                return
            new = self._guarded(name, self._take, name)
            if new is None:
                continue
            slot = None if new.agent in blocked else self._slot(new.agent)
            if slot is None:
                blocked.add(new.agent)
                self.parked.append(new)
                if self._cancel_requested(new.job_id):
                    self._cancel(new.job_id)
                continue
            self._launch(new, slot)

    def _guarded(self, name: str, fn: Any, *args: Any) -> Any:
        """Run one file's or job's step; an unexpected error is logged, never fatal to the loop."""
        try:
            return fn(*args)
        except Exception as exc:  # one bad file or job must not stop the daemon
            log.exception("daemon.error", file=name, error=str(exc))
            self.tracker.forget(name)
            return None

    def _slot(self, agent_name: str) -> str | None:
        agent = self.config.agents.get(agent_name)
        concurrency = agent.concurrency if agent is not None else 1
        if self.slots.held(agent_name) >= concurrency:
            return None
        key = self.slots.acquire(agent_name, concurrency)
        if key is None:
            self._slot_poll = True  # held by another daemon: look again soon
        return key

    def _take(self, name: str) -> _Parked | None:
        """Inspect an inbox file: refuse it now, or return it as work to claim."""
        found = claim.inspect(self.layout, name, self.config)
        if found is None:
            self.tracker.forget(name)
            return None
        log.info(
            "order.received",
            agent=getattr(getattr(found, "order", None), "to", None),
            file=name,
            job_id=getattr(getattr(found, "order", None), "job_id", None),
        )
        if isinstance(found, claim.Refusal):
            self._refuse(found)
            return None
        verdict = self._known(found)
        if verdict != "new":
            return None
        return _Parked("new", found.order.job_id, found.order.to, found)

    def _known(self, item: claim.Inspected, entry: Entry | None = None) -> str:
        """Decide on an order whose id the ledger may know: 'new', 'skip' (another daemon's) or 'refused'."""
        entry = entry or self.ledger.get(item.order.job_id)
        if entry is None or (entry.state in ("reserved", "released") and entry.digest == item.digest):
            return "new"
        if entry.state == "claimed" and entry.source == item.name and entry.digest == item.digest:
            if entry.owner is not None and entry.owner != self.owner and self._alive(entry.owner):
                # another daemon claimed this very file and is moving it out: not ours to refuse
                self.tracker.forget(item.name)
                return "skip"
            if entry.owner is not None and entry.owner != self.owner:
                return "new"  # its claimer died before moving it: take the claim over
        self._refuse(
            claim.Refusal(
                item.name, _known_reason(item.order.job_id, entry.state), item.order.job_id, agent=item.order.to
            )
        )
        return "refused"

    def _refuse(self, refusal: claim.Refusal) -> None:
        def placed(folder: Path) -> None:
            log.warning(
                "job.refused",
                agent=refusal.agent,
                file=refusal.name,
                job_id=refusal.job_id,
                reason=refusal.reason,
                folder=folder.name,
            )

        folder = claim.refuse(self.layout, refusal, self.owner, placed)
        self.tracker.forget(refusal.name)
        if folder is not None:
            self.stats.finished["refused"] += 1

    def _launch(self, p: _Parked, slot: str | None) -> None:
        try:
            run = self._prepare(p)
        except Exception as exc:  # one bad file or job must not stop the daemon
            log.exception("daemon.error", job_id=p.job_id, agent=p.agent, step=p.kind, error=str(exc))
            if p.kind == "recover":
                recovery.fail_damaged(self.layout, self.ledger, p.job_id, p.agent, exc)
            elif p.item is not None:
                self.tracker.forget(p.item.name)
            run = None
        if run is None:
            if slot is not None:
                self.slots.release(slot)
            return
        thread = threading.Thread(target=self._work, args=(run,), name=f"job-{p.job_id}", daemon=True)
        self.running[p.job_id] = _Running(run, slot, thread)
        thread.start()

    def _prepare(self, p: _Parked) -> JobRun | None:
        if p.kind == "recover":
            return JobRun(self.ctx, p.job_id, recovering=True)
        if p.kind == "retry":
            return self._reopen(p.job_id)
        item = p.item
        if item is None:
            return None
        self.tracker.forget(item.name)
        agent = self.config.agents.get(item.order.to)
        if agent is None:
            self._refuse(
                claim.Refusal(
                    item.name,
                    f"to: no agent {item.order.to!r} is defined in the config",
                    item.order.job_id,
                )
            )
            return None
        got = claim.take_claim(self.ledger, self.layout, item, self.owner, self._alive)
        if not got.ok:
            if got.known is not None:
                self._known(item, got.known)  # refuses it, unless another daemon is moving it
            return None
        built = claim.build_job(self.layout, item, agent, got, self.owner)
        if built is None:
            self.ledger.unclaim(item.order.job_id, self.owner, got.previous)  # nothing ran: the id stays free
            log.warning("order.vanished", file=item.name, job_id=item.order.job_id)
            return None
        log.info(
            "job.claimed",
            job_id=item.order.job_id,
            agent=agent.name,
            file=item.name,
            parent=got.parent,
            hops=got.hops,
        )
        _folder, spec, order = built
        return JobRun(self.ctx, item.order.job_id, fresh=(spec, order))

    def _reopen(self, job_id: str) -> JobRun | None:
        """Move a failed job back to active/ for `dispatcher retry` (see ``recovery.reopen``)."""
        spec = recovery.reopen(self.layout, self.ledger, self.owner, job_id)
        if spec is None:
            return None
        with structlog.contextvars.bound_contextvars(job_id=job_id, agent=spec["agent"]["name"]):
            log.info("job.claimed", retry=True, budget=spec["budget"])
        return JobRun(self.ctx, job_id)

    def _work(self, run: JobRun) -> None:
        state: str | None = None
        try:
            state = run.run()
        except Exception as exc:
            with structlog.contextvars.bound_contextvars(job_id=run.job_id, agent=run.agent.name):
                log.exception("job.crashed")
                state = run.fail_after_crash(exc)
        finally:
            self.q.put(("finished", run.job_id, state))

    def _finished(self, job_id: str, state: str | None) -> None:
        r = self.running.pop(job_id, None)
        if r is not None:
            r.run.abort.close()  # closed here, on the loop's thread, so no trigger can hit a reused fd
            if r.slot is not None:
                self.slots.release(r.slot)
        if state is not None:
            self.stats.finished["failed" if state == "crashed" else state] += 1
            if self.ledger.has_request(job_id, "cancel"):
                self.ledger.clear_request(job_id, "cancel")
        self._status()

    def _status(self) -> None:
        if self.notifier.enabled:
            s = self.stats.finished
            self.notifier.status(
                f"running {len(self.running)}, queued {len(self.parked) + len(self.tracker)},"
                f" done {s['done']}, failed {s['failed']}, refused {s['refused']}"
            )


def _known_reason(job_id: str, state: str) -> str:
    return f"job_id: {job_id} is already known (state {state}); a job id is never run twice"
