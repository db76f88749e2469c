"""What may start, and when: slots, parked work, claims in batches, cancel and retry requests.

The daemon's loop calls ``start_work`` once a turn. New orders are inspected on
the loop; the claim of a batch (slots, ledger, job folders) runs in the ledger
lane; each claimed job becomes a ``Job`` task on the loop. Work that waits for
a slot (a new order, a recovered job, a retry) is *parked*, oldest first, and
reading ahead stops at ``PARK_LIMIT`` so memory stays flat with any backlog.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from dispatcher.core.gatekeeper import gated_agents
from dispatcher.core.watcher import Inbox
from dispatcher.job import intake, recovery, revise
from dispatcher.job.intake import Cancelled, Inspected, Pick, Refused, Skipped, Started
from dispatcher.job.job import Job, JobContext
from dispatcher.layout import State
from dispatcher.ledger.base import Row
from dispatcher.spec.config import Config
from dispatcher.spec.jobspec import JobSpec, Outcome, Stop
from dispatcher.spec.order import Order
from dispatcher.spec.orders import validate_order
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.refusals import Refusal, refuse

log = structlog.get_logger("dispatcher")
PARK_LIMIT = 64  # orders read ahead while their agents are busy
CLAIM_CHUNK = 32  # orders claimed in one ledger transaction (and one fsync of active/)
SLOT_RETRY_S = 0.25
RETRY_LATER_S = 1.0  # a file whose claim could not be made now (a full disk) is tried again after this


class Kind(enum.Enum):
    NEW = "new"
    RECOVER = "recover"
    RETRY = "retry"
    REVISE = "revise"


@dataclass
class Parked:
    """Work that waits for a slot."""

    kind: Kind
    job_id: str
    agent: str
    item: Inspected | None = None
    token: int = 0
    slot: int | None = None  # a slot handed over from a job of the same agent that just ended
    host_lost: bool = False  # recovered from a daemon on another host whose lease ran out


@dataclass(frozen=True, slots=True)
class Launch:
    """A job ready to run, with the slot it holds."""

    parked: Parked
    folder: JobFolder
    spec: JobSpec
    order: Order
    token: int
    slot: int | None
    attempts: list = field(default_factory=list)  # type: ignore[type-arg]


@dataclass(frozen=True, slots=True)
class NoSlot:
    parked: Parked


@dataclass(frozen=True, slots=True)
class Dropped:
    parked: Parked
    refused: bool = False
    retry_later: bool = False
    cancelled: bool = False  # claimed under a cancel request: it went to failed/ without a Job


@dataclass
class Running:
    job: Job
    task: asyncio.Task[Outcome]
    slot: int | None


@dataclass
class Stats:
    finished: dict[str, int] = field(default_factory=lambda: {"done": 0, "failed": 0, "refused": 0, "review": 0})


class Scheduler:
    """Start what may start; keep the running jobs; carry out cancel and retry requests."""

    def __init__(self, ctx: JobContext, inbox: Inbox, wake: Callable[[], None]) -> None:
        self.ctx = ctx
        self.inbox = inbox
        self.wake = wake
        self.running: dict[str, Running] = {}
        self.parked: collections.deque[Parked] = collections.deque()
        self.inflight = 0
        self.blocked: dict[str, float] = {}  # agents with no free slot -> when to ask the ledger again
        self.slot_poll = False
        self.stats = Stats()
        self.left: set[str] = set()  # jobs stopped while the daemon went on (fenced): taken back later
        self.idle: dict[str, list[int]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # slots of ended jobs, kept for the next job of that agent

    @property
    def config(self) -> Config:
        return self.ctx.config()

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a step of the scheduler's own in the background; shutdown waits for it (``drain``)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the scheduler's background steps (claims, refusals, slots given back)."""
        self._free_idle()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def free_slots(self) -> int:
        """Return how many more jobs this daemon may start now (``max_jobs`` minus what runs)."""
        return self.config.max_jobs - len(self.running) - self.inflight

    def busy(self) -> bool:
        """Return True while anything runs, waits for a slot or is being claimed."""
        return bool(self.running or self.parked or self.inflight)

    # -- starting ---------------------------------------------------------------------------
    def start_work(self) -> None:
        """Launch parked work and read new orders while slots are free."""
        if self.ctx.stopping():
            return
        now = time.monotonic()
        self.blocked = {agent: until for agent, until in self.blocked.items() if until > now}
        self.slot_poll = bool(self.blocked)
        gated = gated_agents(self.ctx.gates(), self.config.agents, time.time())  # section 14: claim none of them
        free = self.free_slots()
        batch: list[Parked] = []
        for p in list(self.parked):
            if free <= 0:
                break
            if p.agent in self.blocked or (p.agent in gated and p.kind is Kind.NEW):
                continue
            self.parked.remove(p)
            batch.append(p)
            free -= 1
        while free > 0 and len(self.parked) < PARK_LIMIT:
            ready = self.inbox.pop()
            if ready is None:
                break
            new = self._read(ready)
            if new is not None and (new.agent in self.blocked or new.agent in gated):
                self.parked.append(new)  # its agent has no free slot: waiting takes no slot from others
            elif new is not None:
                batch.append(new)
                free -= 1
        for p in batch:
            idle = self.idle.get(p.agent)
            if idle:
                p.slot = idle.pop()
        # claimed in chunks: the first agents start while the lane still claims the rest
        for i in range(0, len(batch), CLAIM_CHUNK):
            chunk = batch[i : i + CLAIM_CHUNK]
            self.inflight += len(chunk)
            self._background(self._launch(chunk))
        self._free_idle()

    def _free_idle(self) -> None:
        """Give back slots no job took over this turn, so that other daemons may use them."""
        ledger = self.ctx.ledger
        for agent, slots in self.idle.items():
            for slot in slots:
                if ledger.slots_local:  # a flock on this host: released at once, no trip to the lane
                    ledger.free_slot(agent, slot)
                else:
                    self._background(self.ctx.lanes.ledger(ledger.free_slot, agent, slot))
        self.idle.clear()

    def _read(self, name: str) -> Parked | None:
        found = intake.inspect(self.ctx.layout, name, self.config)
        if found is None:
            self.inbox.forget(name)
            return None
        if isinstance(found, Refusal):
            log.info("order.received", agent=found.agent, file=name, job_id=found.job_id)
            self._background(self._refuse(found))
            return None
        job_id = found.order.job_id
        log.info("order.received", agent=found.order.to, file=name, job_id=job_id)
        return Parked(Kind.NEW, job_id, found.order.to, found)

    async def _refuse(self, refusal: Refusal) -> None:
        folder = await self.ctx.lanes.ledger(refuse, self.ctx.layout, refusal, self.ctx.ledger.owner, self.log_refused)
        self.inbox.forget(refusal.name)
        if folder is not None:
            self.stats.finished["refused"] += 1
        self.wake()

    def log_refused(self, folder: Path, refusal: Refusal) -> None:
        """Log a refusal as its folder lands (before the folder's fsync)."""
        if self.ctx.metrics is not None:
            self.ctx.metrics.job_finished("refused", refusal.agent, None, None)
        log.warning(
            "job.refused",
            agent=refusal.agent,
            file=refusal.name,
            job_id=refusal.job_id,
            reason=refusal.reason,
            folder=folder.name,
        )

    async def _launch(self, batch: list[Parked], *, cancel: bool = False) -> None:
        try:
            results = await self.ctx.lanes.ledger(self._claim_in_lane, batch, slotless=cancel)
        except Exception as exc:
            log.exception("daemon.error", step="claim", error=str(exc))
            results = [Dropped(p, retry_later=True) for p in batch]
        self.inflight -= len(batch)
        for r in results:
            match r:
                case Launch(parked=p):
                    if p.item is not None:
                        self.inbox.forget(p.item.name)
                    self._run(r, cancel=cancel)
                case NoSlot(parked=p):
                    self.parked.appendleft(p)
                    self.blocked[p.agent] = time.monotonic() + SLOT_RETRY_S
                    self.slot_poll = True
                case Dropped(parked=p, refused=refused, retry_later=later, cancelled=cancelled):
                    if p.item is not None and later:  # a full disk, a failed batch: try again in a while
                        asyncio.get_running_loop().call_later(RETRY_LATER_S, self._try_again, p.item.name)
                    elif p.item is not None:
                        self.inbox.forget(p.item.name)
                    if refused:
                        self.stats.finished["refused"] += 1
                    if cancelled:
                        self.stats.finished["failed"] += 1
        self.wake()

    def _try_again(self, name: str) -> None:
        self.inbox.push_back(name)
        self.wake()

    def _claim_in_lane(self, batch: list[Parked], *, slotless: bool = False) -> list[Launch | NoSlot | Dropped]:
        """Take slots and claim (runs in the ledger lane); ``slotless`` for a cancel, which takes none."""
        ledger, layout, cfg = self.ctx.ledger, self.ctx.layout, self.config
        out: list[Launch | NoSlot | Dropped] = []
        picks: list[tuple[Parked, int | None]] = []
        for p in batch:
            agent = cfg.agents.get(p.agent)
            slot = p.slot
            if slot is None and not slotless:
                slot = ledger.take_slot(p.agent, agent.concurrency if agent else 1)
                if slot is None:
                    out.append(NoSlot(p))
                    continue
            if p.kind is Kind.NEW:
                picks.append((p, slot))
            else:
                out.append(self._reload(p, slot))
        if picks:
            chosen = [Pick(p.item, cfg.agents[p.agent]) for p, _ in picks if p.item is not None]
            answers = intake.claim(layout, ledger, chosen, on_refused=self.log_refused, finisher=self.ctx.finisher)
            for (p, slot), answer in zip(picks, answers, strict=True):
                if isinstance(answer, Started):
                    out.append(Launch(p, answer.folder, answer.spec, answer.order, answer.token, slot))
                    continue
                if slot is not None:
                    ledger.free_slot(p.agent, slot)
                later = isinstance(answer, Skipped) and answer.retry_later
                cancelled = isinstance(answer, Cancelled)
                out.append(Dropped(p, refused=isinstance(answer, Refused), retry_later=later, cancelled=cancelled))
        return out

    def _reload(self, p: Parked, slot: int | None) -> Launch | Dropped:
        """Load a recovered job, or reopen a failed one for a retry (ledger lane)."""
        layout, ledger = self.ctx.layout, self.ctx.ledger
        try:
            if p.kind in (Kind.RETRY, Kind.REVISE):
                reopen = revise.reopen if p.kind is Kind.REVISE else recovery.reopen
                reopened = reopen(layout, ledger, self.config, p.job_id)
                if reopened is None:
                    raise LookupError("taken by another daemon")
                spec, token = reopened
                log.info("job.claimed", job_id=p.job_id, agent=spec.agent.name, retry=True, budget=spec.budget)
            else:
                spec, token = JobFolder(layout.job(State.ACTIVE, p.job_id)).spec(), p.token
            folder = JobFolder(layout.job(State.ACTIVE, p.job_id))
            return Launch(p, folder, spec, validate_order(dict(spec.order)), token, slot, folder.attempts())
        except Exception as exc:
            if slot is not None:
                ledger.free_slot(p.agent, slot)
            if not isinstance(exc, LookupError):
                log.exception("daemon.error", job_id=p.job_id, step=p.kind.value, error=str(exc))
                if p.kind is Kind.RECOVER:
                    recovery.fail_damaged(layout, ledger, p.job_id, p.token, exc)
            return Dropped(p)

    def _run(self, launch: Launch, *, cancel: bool = False) -> None:
        p = launch.parked
        job = Job(
            self.ctx,
            launch.folder,
            launch.spec,
            launch.order,
            launch.token,
            attempts=list(launch.attempts),
            recovering=p.kind is Kind.RECOVER,
            host_lost=p.host_lost,
        )
        if cancel:
            job.control.abort(Stop.CANCELLED)
        task = asyncio.get_running_loop().create_task(job.run())
        self.running[job.job_id] = Running(job, task, launch.slot)
        self._count_running()
        task.add_done_callback(functools.partial(self._finished, job.job_id))

    def _finished(self, job_id: str, task: asyncio.Task[Outcome]) -> None:
        r = self.running.pop(job_id, None)
        self._count_running()
        if r is not None and r.slot is not None:
            self.idle.setdefault(r.job.agent, []).append(r.slot)
        outcome = task.result() if not task.cancelled() and task.exception() is None else Outcome.LEFT
        if outcome in (Outcome.DONE, Outcome.FAILED, Outcome.REVIEW):
            self.stats.finished[outcome.value] += 1
        elif outcome is Outcome.LEFT and not self.ctx.stopping():
            self.left.add(job_id)
        self.blocked.pop(r.job.agent if r else "", None)  # a slot of that agent is free again
        self.wake()

    def _count_running(self) -> None:
        if self.ctx.metrics is not None:
            self.ctx.metrics.set_running(collections.Counter(r.job.agent for r in self.running.values()))

    # -- stopping -----------------------------------------------------------------------------
    def abort_all(self, reason: Stop, *, only_waiting: bool = False, mute: bool = False) -> None:
        """Stop every running job (or only those waiting before a retry); ``mute`` their log writes too."""
        for r in self.running.values():
            if not only_waiting or r.job.control.waiting:
                r.job.control.abort(reason, mute=mute)

    # -- requests -----------------------------------------------------------------------------
    def park_recovered(self, adopted: list[tuple[str, int, str]], *, host_lost: bool = False) -> None:
        """Queue adopted jobs of dead daemons first (their agents were already ended)."""
        for job_id, token, agent in reversed(adopted):
            self.parked.appendleft(Parked(Kind.RECOVER, job_id, agent, token=token, host_lost=host_lost))

    def park_retry(self, job_id: str, agent: str, *, revise: bool = False) -> None:
        """Queue a failed job for `dispatcher retry` (or a job for `dispatcher revise`), once."""
        if job_id in self.running or any(p.job_id == job_id for p in self.parked):
            return
        self.parked.append(Parked(Kind.REVISE if revise else Kind.RETRY, job_id, agent))

    def cancel(self, job_id: str, entry_state: str | None) -> bool:
        """Carry out a cancel request; return False when the order must first be found in inbox/.

        A running job is stopped through its ``Control``; parked work is claimed (or
        reloaded) at once without a slot, and the claim's transaction decides (``Cancelled``).
        """
        r = self.running.get(job_id)
        if r is not None:
            r.job.control.abort(Stop.CANCELLED)
            return True
        for p in self.parked:
            if p.job_id == job_id:
                self.parked.remove(p)
                self._launch_now(p)
                return True
        return entry_state in (Row.DONE, Row.FAILED, Row.CLAIMED, Row.REVIEW)

    def claim_now(self, name: str) -> None:
        """Claim an order still unread in inbox/ at once, without a slot (a cancel was asked for it)."""
        self.inbox.forget(name)
        p = self._read(name)
        if p is not None:
            self._launch_now(p)

    def _launch_now(self, p: Parked) -> None:
        if p.slot is not None:
            self.idle.setdefault(p.agent, []).append(p.slot)
            p.slot = None
        self.inflight += 1
        self._background(self._launch([p], cancel=True))
