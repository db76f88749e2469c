"""What may start, and when: slots, parked work, claims in batches, cancel and retry requests.

The daemon's loop calls ``start_work`` once a turn. Names of new files and parked work
go to the ledger lane in batches, where ``claiming.Claims`` reads the orders, takes
slots and claims them in one trip; each claimed job becomes a ``Job`` task on the loop.
Work that waits for a slot (a new order, a recovered job, a retry) is *parked*, oldest
first, and reading ahead stops at ``PARK_LIMIT`` so memory stays flat with any backlog.

A gate (section 14) holds no slot: a gated agent's orders stay unread in inbox/
(``Inbox.set_aside``) and its claimed jobs are set aside without slots (``setaside``).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from dispatcher.core.ahead import Ahead, ClaimsAhead
from dispatcher.core.claiming import Claims, not_now
from dispatcher.core.gatekeeper import gated_agents
from dispatcher.core.readaside import RETRY_LATER_S, ReadAside, Stats
from dispatcher.core.requests import Requests, parked_again
from dispatcher.core.running import RunningJobs, keeps_slots
from dispatcher.core.setaside import SetAside
from dispatcher.core.watcher import Inbox
from dispatcher.core.work import (
    Big,
    Dropped,
    Gone,
    Handover,
    Kind,
    Later,
    Launch,
    NoSlot,
    Parked,
    Rank,
    park_ranked,
    parked_rank,
    ranked,
)
from dispatcher.job.context import JobContext
from dispatcher.job.job import Job
from dispatcher.job.joins import Joins
from dispatcher.ledger.base import Gate, LedgerUnavailable
from dispatcher.lifecycle import Outcome, Stop
from dispatcher.shortage import SHORT
from dispatcher.spec.settings import Config

log = structlog.get_logger("dispatcher")
PARK_LIMIT = 64  # orders read ahead while their agents are busy
PARK_LOW = 16  # an agent read past (``_read_past``) is read again once fewer of its orders are parked
CLAIM_CHUNK = 32  # orders claimed in one ledger transaction (and one fsync of active/)
HELD_CLAIMS = 2  # a claim's trip with more orders never stops the loop in place (``Lanes.ledger_long``)
SLOT_RETRY_S = 0.25
_NOT_GATED: frozenset[str] = frozenset()


class Scheduler(ClaimsAhead, Requests[Job], ReadAside):
    """Start what may start; keep the running jobs; carry out cancel and retry requests (``Requests``)."""

    def __init__(self, ctx: JobContext, inbox: Inbox, wake: Callable[[], None], joins: Joins | None = None) -> None:
        self.ctx = ctx
        self.claims = Claims(ctx.layout, ctx.ledger, ctx.config, ctx.finisher, self.log_refused, joins, self._gate_seen)
        self.inbox = inbox
        self.wake = wake
        self.joins = joins
        self.slots: RunningJobs[Job] = RunningJobs(ctx.metrics)
        self.running = self.slots.jobs  # the same dict, never replaced
        ctx.slot_fd = self._slot_fd
        self.again: dict[str, Job] = {}  # jobs queued for another attempt after giving their slot back
        self.parked: collections.deque[Parked] = collections.deque()
        self.inflight = 0
        self._held_back = False  # ready orders left unread for a claim's trip under way: its answer wakes the loop
        self._loop: asyncio.AbstractEventLoop | None = None  # set at the first turn
        self.sending: collections.Counter[str] = collections.Counter()  # agents of parked orders in a claim's trip
        self.blocked: dict[str, float] = {}  # agents with no free slot -> when to ask the ledger again
        self._cfg_seen: Config | None = None  # the config the last turn ran with (a reload is a new one)
        self._lowered: set[str] = set()  # agents a reload lowered the concurrency of, while more of them run
        self._agents_had: set[str] = set()  # every agent a config of this daemon had
        #: agents a reload removed: their new orders wait unread in inbox/ until a reload brings them back
        self.removed: frozenset[str] = frozenset()
        self._told_waiting: set[str] = set()  # removed agents whose waiting orders were logged (order.waiting)
        self._expiry_turn: float | None = None  # when a turn is due for the next ready order's expires
        self.slot_poll = False
        self.stats = Stats()
        self._past: set[str] = set()  # agents whose further orders are left unread while theirs fill parked
        self.left: set[str] = set()  # jobs stopped while the daemon went on (fenced): taken back later
        self.left_new = False  # one joined ``left`` since the last recovery began
        self.aside: SetAside[Job] = SetAside()  # claimed jobs a gate holds, without slots
        self._tasks: set[asyncio.Task[Any]] = set()  # slots of ended jobs, kept for the next job of that agent
        self.ahead = Ahead()  # orders of quick agents claimed before a slot frees (``core.ahead``)

    @property
    def config(self) -> Config:
        return self.ctx.config()

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a step of the scheduler's own in the background; shutdown waits for it (``drain``)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._step_done)

    def _step_done(self, task: asyncio.Task[Any]) -> None:
        """Forget a finished background step; say what failed, but not a ledger wait a stop gave up."""
        self._tasks.discard(task)
        exc = None if task.cancelled() else task.exception()
        if exc is None or (isinstance(exc, LedgerUnavailable) and self.ctx.stopping()):
            return  # given up at a stop: what it did not record is recovered at the next start
        if not SHORT.note(exc, "background"):
            log.error("daemon.error", step="background", error=str(exc), exc_info=exc)

    async def drain(self) -> None:
        """Wait for the scheduler's background steps (claims, refusals, slots given back)."""
        self._free_idle()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _slot_fd(self, job_id: str, agent: str) -> int | None:
        """Return the descriptor of the agent slot the running job holds (its agent inherits it), or None."""
        r = self.running.get(job_id)
        return self.ctx.ledger.slot_fd(agent, r.slot) if r is not None and r.slot is not None else None

    def free_slots(self) -> int:
        """Return how many more jobs this daemon may start now (``max_jobs`` minus what holds a slot)."""
        return self.slots.free(self.config.max_jobs) - self.inflight

    def may_read(self) -> bool:
        """Return True if a turn would read a new order now: a slot is free, room to park, no shortage.

        With ``PARK_LIMIT`` orders parked for busy agents a turn reads nothing, so the
        loop must not be woken for the orders still waiting in inbox/ (it would spin).
        """
        return (
            self.slots.free(self.config.max_jobs) > self.inflight  # (``free_slots``)
            and len(self.parked) < PARK_LIMIT
            and not self._held_back
            and not SHORT.short()
            and not SHORT.claims_wait_s()
        )

    def busy(self, *, aside: bool = True) -> bool:
        """Return True while anything runs, waits for a slot or a gate (``aside`` False: not a gate), or is claimed."""
        held = aside and bool(self.aside)
        return bool(self.running or self.parked or self.inflight or held or self.ahead.claiming.total())

    # -- starting ---------------------------------------------------------------------------
    def start_work(self) -> None:
        """Launch parked work and read new orders while slots are free."""
        self._held_back = False
        if self.ctx.stopping():
            return
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if SHORT.short():  # short of descriptors, processes or memory: start nothing until the pause ends
            self._free_idle()
            return
        now = time.monotonic()
        idle = self.slots.idle  # an agent with a slot given back is not blocked, whatever a late answer said:
        # its oldest parked order takes that slot before a newer one read from inbox/ in this turn
        if self.blocked:
            self.blocked = {a: until for a, until in self.blocked.items() if until > now and not idle.get(a)}
        self.slot_poll = bool(self.blocked)
        cfg = self.config
        if cfg is not self._cfg_seen:
            if self._cfg_seen is not None:
                self._read_again()
            self._removed_since(cfg)
            self._lowered_since(cfg)
        if self._lowered:  # a reload lowered an agent's concurrency: none of it starts until fewer run
            self._hold_lowered(cfg, now)
        gates = self.ctx.gates()  # section 14; none in the usual turn: no agent gated
        gated = frozenset(gated_agents(gates, cfg.agents, time.time())) if gates else _NOT_GATED
        hold = gated | self.removed if self.removed else gated  # agents whose new orders are left unread
        full = len(self.parked) >= PARK_LIMIT
        unread = hold | self._read_past(full, hold) if full or self._past else hold
        self._gates_changed(gated, now, unread, hold)
        if self.removed:
            self._tell_waiting()
        # (``free_slots``); after a shortage, the starts still on their way count against its window
        free = SHORT.allowance(self.slots.free(cfg.max_jobs) - self.inflight, self.inflight + self.ctx.starts.count)
        self.inbox.make_room(free, self._agent_room, unread)  # orders wait for files found settling only for slots
        batch: list[Parked | str] = []
        wall = time.time()
        # an agent whose next orders are in a claim's trip (made ahead, or parked orders sent by an earlier
        # turn that may come back without a slot): those go first, the orders behind them wait
        behind = {agent for agent, n in (*self.ahead.claiming.items(), *self.sending.items()) if n > 0}
        room: int | None = None  # how many new orders may be claimed (``SHORT.room``): asked once, when one would be
        joined_rank: Rank | None = None  # the best ready join left for an order of higher rank
        expired: list[Parked | str] = []  # ready joins past their expires: they fail `expired`, without a slot
        for p in list(self.parked):
            if p.expires is not None and p.expires <= wall:  # an order refused `expired` in the claim's trip, a ready
                self.parked.remove(p)  # join failed `expired`: without a slot (section 16)
                (expired if p.kind in (Kind.JOINED, Kind.RECOVER) else batch).append(p)
                continue
            if free <= 0 or p.agent in self.blocked or (p.kind is Kind.NEW and p.agent in behind):
                continue
            by_rank = ranked(p) and not (p.kind is Kind.NEW and p.job_id in self.ahead.ready)
            if by_rank and self._outranked(p, unread):
                rank = parked_rank(p)
                joined_rank = rank if joined_rank is None else min(joined_rank, rank)
                continue
            claimed_ahead = p.job_id in self.ahead.ready
            if p.kind is Kind.NEW and not claimed_ahead:
                room = SHORT.room(free) if room is None else room
                if room <= 0:
                    continue  # read, not claimed: it waits until an agent could start (section 13)
                room -= 1
            if claimed_ahead and not self.slots.idle.get(p.agent) and self._at_concurrency(p.agent):
                continue  # claimed ahead: it waits for the slot one of its agent's jobs here gives back
            self.parked.remove(p)
            free -= 1
            if claimed_ahead:  # its agent's slot is handed on
                self._unqueued(p)
                if self._start_handed_over(p):
                    continue
            batch.append(p)
        while (join := self.inbox.pop_join()) is not None:
            batch.append(join)  # an order naming `after` is claimed at once and takes no slot: it waits
        # with parked full, only agents read past are read on, or the order that outranks one left above
        fresh = free > 0 and (not full or unread != gated or joined_rank is not None) and self.inbox.has_ready()
        if fresh:
            room = SHORT.room(free) if room is None else room
            fresh = room > 0  # nothing new is claimed while an agent could not start (section 13)
        while fresh and free > 0:
            upcoming = self.inbox.next_agent(unread) if behind else None
            if upcoming is not None and upcoming[0] in behind:
                self._held_back = True  # not read again at every turn until that trip answers (a spin)
                break  # after the orders of its agent claimed ahead now
            if joined_rank is not None and ((head := self.inbox.head_rank(unread)) is None or head > joined_rank):
                break  # the parked order or ready join left above goes before this order, at the next turn
            ready = self.inbox.pop(unread)  # a gated agent's orders are left unread (section 14), a full one's too
            if ready is None:
                break
            batch.append(ready)  # read in the claim's trip, off the loop
            free -= 1
            if room is not None:
                room -= 1
                fresh = room > 0  # as many as the descriptors free let start
        batch.extend(self.inbox.pop_expired(wall))  # refused `expired` in the claim's trip: no slot needed
        self._turn_at_expiry(wall)
        if expired:
            self.inflight += len(expired)
            self._background(self._launch(expired, slotless=True))
        if not batch:
            self._free_idle()
            # claimed ahead only in a turn that claims nothing else: orders in a claim's trip come first
            ahead, agents = self._claim_ahead(gated)
            if ahead:
                self._background(self._launch(ahead, gated=gated, ahead=agents))
            return
        handover = Handover(self.slots.idle)  # the lane owns these slots now: it uses or frees them
        self.slots.idle = {}
        blocked = frozenset(self.blocked)
        # claimed in chunks: the first agents start while the lane still claims the rest
        chunks = [batch[i : i + CLAIM_CHUNK] for i in range(0, len(batch), CLAIM_CHUNK)]
        for i, chunk in enumerate(chunks):
            self.inflight += len(chunk)
            new = [p.agent for p in chunk if isinstance(p, Parked) and p.kind is Kind.NEW]
            sent = collections.Counter(new) if new else None  # none in the usual chunk: names new in inbox/
            if sent is not None:
                self.sending.update(sent)
            last = i == len(chunks) - 1
            self._background(self._launch(chunk, handover, blocked=blocked, gated=gated, last=last, parked_new=sent))

    def _read_past(self, full: bool, gated: frozenset[str]) -> frozenset[str]:
        """Return the agents whose further orders are left unread, read past, because orders read ahead for them
        fill ``parked`` (an idle agent's order never waits behind a busy one's backlog).

        An agent joins when ``parked`` is full and holds orders of it; it leaves once fewer than
        ``PARK_LOW`` of them are left, so that its unread orders are taken back once per
        ``PARK_LIMIT - PARK_LOW`` of its starts, not at each. It leaves at once when an order of it left
        unread goes before its orders read ahead (section 16: higher priority first), so that it is read.
        """
        counts = collections.Counter(p.agent for p in self.parked if p.kind is Kind.NEW)
        if full:
            self._past.update(counts)
        self._past = {agent for agent in self._past if counts[agent] >= PARK_LOW}
        if self._past:
            self.inbox.head_rank(gated | self._past)  # the orders ranked before the others' head are set aside
            self._past -= {agent for agent in self._past if self._passed_over(agent)}
        return frozenset(self._past)

    def _passed_over(self, agent: str) -> bool:
        """Return True if an order of ``agent`` left unread goes before every order read ahead for it."""
        aside = self.inbox.aside_rank(agent)
        if aside is None:
            return False
        ahead = self.ahead.ready
        mine = [
            parked_rank(p) for p in self.parked if p.agent == agent and p.kind is Kind.NEW and p.job_id not in ahead
        ]
        return bool(mine) and aside < min(mine)

    def _outranked(self, p: Parked, unread: frozenset[str]) -> bool:
        """Return True if an unread order goes before parked p (higher priority, or as high and older): any
        agent's before a ready join, its own agent's before an order read ahead, which waited for its slot."""
        head = self.inbox.head_rank(unread)
        if head is None or head >= parked_rank(p):
            return False
        if p.kind is not Kind.NEW:  # a ready join, a recovered job never started
            return True
        upcoming = self.inbox.next_agent(unread)
        return upcoming is not None and upcoming[0] == p.agent

    def _gate_seen(self, gate: Gate) -> None:
        """A claim's trip read a gate the snapshot may lack (from the ledger lane): note it on the loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.ctx.note_gate, gate)

    def _turn_at_expiry(self, wall: float) -> None:
        """Take a turn when the next order waiting unread in inbox/ expires: it is refused then, not at a free slot."""
        soon = self.inbox.next_expiry()
        if soon is None or (self._expiry_turn is not None and wall < self._expiry_turn <= soon):
            return
        self._expiry_turn = soon
        asyncio.get_running_loop().call_later(max(0.0, soon - wall) + 0.01, self.wake)

    def _gates_changed(self, gated: frozenset[str], now: float, unread: frozenset[str], hold: frozenset[str]) -> None:
        """Leave new orders of gated (or removed) agents unread; take back what the gates let go, oldest first.

        ``unread``: the agents of ``hold`` (gated, or removed by a reload) and those whose orders read ahead
        fill ``parked``; orders left unread for them stay so until they are neither.
        """
        if not hold and not self.aside.held and not self.inbox.any_aside():  # the usual turn: no gate, nothing held
            return
        for p in [p for p in self.parked if p.kind is Kind.NEW and p.agent in hold]:
            self.parked.remove(p)  # read before its agent was gated (or removed)
            self._leave_unread(p)
        self.inbox.take_back(unread)
        back, later = self.aside.take_back(gated, now, time.time())
        self.parked.extendleft(reversed([parked_again(job) for job in back]))
        self.slot_poll |= later

    def _leave_unread(self, p: Parked) -> None:
        if p.item is not None:
            self.inbox.set_aside(p.item.name, p.agent, p.item.order.expires)

    def _read_again(self) -> None:
        """A reload: orders read under the old config and not claimed yet are read again under the new one (its
        ``max_timeout``, ``max_order_bytes`` and agents decide), unread in inbox/ from this turn on."""
        for p in [p for p in self.parked if p.kind is Kind.NEW and p.job_id not in self.ahead.ready]:
            self.parked.remove(p)
            self._leave_unread(p)  # taken back at once (``_gates_changed``), unread, in its first place

    def _removed_since(self, cfg: Config) -> None:
        """Note the agents a reload removed (every agent a config of this daemon had, less the config's)."""
        self._agents_had.update(cfg.agents)
        self.removed = frozenset(self._agents_had.difference(cfg.agents))
        self._told_waiting &= self.removed  # back in the config: a later removal is logged again

    def _tell_waiting(self) -> None:
        """Log once for each removed agent that its orders wait (README: ``order.waiting``, logged once)."""
        for agent in sorted(self.removed - self._told_waiting):
            if self.inbox.aside_for({agent}):
                self._told_waiting.add(agent)
                log.warning("order.waiting", agent=agent, reason="the agent was removed from the config by a reload")

    def _lowered_since(self, cfg: Config) -> None:
        """Note the agents whose concurrency the config now in force lowered (a reload)."""
        before, self._cfg_seen = self._cfg_seen, cfg
        if before is None:
            return
        for name, agent in cfg.agents.items():
            old = before.agents.get(name)
            if old is not None and agent.concurrency < old.concurrency:
                self._lowered.add(name)

    def _hold_lowered(self, cfg: Config, now: float) -> None:
        """Block each agent of ``_lowered`` while as many of its jobs run here as its concurrency allows."""
        for name in list(self._lowered):
            agent = cfg.agents.get(name)
            running = len(self.slots.running_s(name, 0.0))
            if agent is None or running < agent.concurrency:
                self._lowered.discard(name)  # back under its limit: its slots decide again
            else:
                self.blocked[name] = max(self.blocked.get(name, 0.0), now + SLOT_RETRY_S)
                self.slot_poll = True

    def _trim_idle(self, agent: str) -> None:
        """Free (not hand on) the slots agent gave back beyond what its concurrency leaves: a reload lowered it."""
        idle, conf = self.slots.idle.get(agent), self.config.agents.get(agent)
        if not idle or conf is None:
            return
        room = max(0, conf.concurrency - len(self.slots.running_s(agent, 0.0)))
        while len(idle) > room:
            self._free_slot(agent, idle.pop())

    def _free_idle(self) -> None:
        """Give back slots no job took over this turn, so that other daemons may use them."""
        for agent, slots in self.slots.idle.items():
            for slot in slots:
                self._free_slot(agent, slot)
        self.slots.idle.clear()

    def _free_slot(self, agent: str, slot: int) -> None:
        ledger = self.ctx.ledger
        if ledger.slots_local:  # a flock on this host: released at once, no trip to the lane
            ledger.free_slot(agent, slot)
        else:
            self._background(self.ctx.lanes.ledger(ledger.free_slot, agent, slot))

    async def _launch(
        self,
        batch: list[Parked | str],
        handover: Handover | None = None,
        *,
        blocked: frozenset[str] = frozenset(),
        gated: frozenset[str] = frozenset(),
        cancel: bool = False,
        last: bool = True,
        ahead: list[str] | None = None,
        parked_new: collections.Counter[str] | None = None,
        slotless: bool = False,
    ) -> None:
        """Claim a batch in the ledger lane and act on the answers. ``cancel``: claimed to be cancelled, without
        slots; ``slotless``: run without slots (ready joins past their expires, which fail `expired` at once)."""
        claims = self.claims
        caps = dict(collections.Counter(ahead)) if ahead is not None else None
        sent = time.monotonic()
        run = functools.partial(
            claims.run,
            batch,
            handover or Handover(),
            blocked=blocked,
            gated=gated,
            slotless=cancel or slotless,
            last=last,
            ahead=caps,
            unsure=self.inbox.unsure(batch),
        )
        lanes = self.ctx.lanes
        try:  # a few orders: the loop may wait in place for the answer; a burst's chunks: never
            results = await (lanes.ledger(run) if len(batch) <= HELD_CLAIMS else lanes.ledger_long(run))
        except Exception as exc:
            gave_up = isinstance(exc, LedgerUnavailable) and self.ctx.stopping()  # the order stays for later
            if not gave_up and not SHORT.note(exc, "claim"):
                log.exception("daemon.error", step="claim", error=str(exc))
            results = [not_now(p) for p in batch]
            if handover is not None and last:  # give back what the failed trip did not use
                self._background(self.ctx.lanes.ledger(claims.run, [], handover))
        if not cancel and not slotless and any(isinstance(r, Launch) for r in results):
            self.ahead.claimed(time.monotonic() - sent)
        if ahead is None:
            self.inflight -= len(batch)
        else:
            self.ahead.claiming.subtract(ahead)
        if parked_new:
            self.sending.subtract(parked_new)
        again: list[Parked] = []
        for r in results:
            match r:
                case Gone(name=name, unsure=True):
                    self.inbox.recheck(name)  # no refusal before the look for another writer
                case Gone(name=name, refused=refused, later=later):
                    if later:
                        asyncio.get_running_loop().call_later(RETRY_LATER_S, self._try_again, name)
                    else:
                        self.inbox.forget(name)
                    if refused:
                        self.stats.finished["refused"] += 1
                case Big(name=name):
                    self._background(self._read_big(name, cancel=cancel))
                case Later(name=name, due=due, priority=priority):
                    self.inbox.defer(name, due, priority)  # the glance at the file missed its not_before
                case Launch(parked=p) if ahead is not None:
                    if p.item is not None:
                        self.inbox.forget(p.item.name)
                    self._park_ready(r)
                case Launch(parked=p):
                    if p.item is not None:
                        self.inbox.forget(p.item.name)
                    self._run(r, cancel=cancel)
                case NoSlot(parked=p) if p.kind is Kind.NEW and (p.agent in gated or p.agent in self.removed):
                    self._leave_unread(p)  # a gate holds its agent (or a reload removed it): it waits unread
                case NoSlot(parked=p) if p.kind is Kind.NEW and ahead is not None:
                    park_ranked(self.parked, p)  # not to be claimed ahead after all: it waits for a slot
                case NoSlot(parked=p) if p.kind is Kind.NEW:
                    park_ranked(self.parked, p)
                    self.blocked[p.agent] = time.monotonic() + SLOT_RETRY_S
                    self.slot_poll = True
                case NoSlot(parked=p) if p.kind is not Kind.NEW and ranked(p):
                    park_ranked(self.parked, p)  # a ready join keeps its place among orders: priority, then age
                    self.blocked[p.agent] = time.monotonic() + SLOT_RETRY_S
                    self.slot_poll = True
                case NoSlot(parked=p):
                    again.append(p)
                    if p.kind is Kind.RESUME and p.job_id not in self.again:  # claimed ahead: counted so again,
                        self.ahead.queued(p.job_id, p.agent)  # or more would be claimed ahead behind it
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
        self.parked.extendleft(reversed(again))  # first again, in the order they had
        self.wake()

    def _run(self, launch: Launch, *, cancel: bool = False) -> None:
        p = launch.parked
        again = self.again.pop(p.job_id, None) if p.kind is Kind.RESUME else None
        job = (
            again
            or (self.aside.launch(p.job_id) if p.kind is Kind.RESUME else None)
            or Job(
                self.ctx,
                launch.folder,
                launch.spec,
                launch.order,
                launch.token,
                attempts=list(launch.attempts),
                recovering=p.kind is Kind.RECOVER,
                host_lost=p.host_lost,
                fresh=p.kind is Kind.NEW or (p.resume is not None and p.resume.fresh),
            )
        )
        if cancel:
            job.control.abort(Stop.CANCELLED)
        job.gave_back = False
        job.on_exit = functools.partial(self._agent_exited, job.job_id)
        if not job.counted_start:
            job.counted_start = True
            self.ctx.starts.begin()  # from now on: a start goes before checks and claims that can wait
        task = asyncio.get_running_loop().create_task(job.run())
        self.slots.add(job, task, launch.slot)
        task.add_done_callback(functools.partial(self._finished, job.job_id))

    def _agent_exited(self, job_id: str, hand_on: bool) -> bool:
        """A job's agent exited: its slots go to the next job while its checks and finish go on (``running``).

        ``hand_on``: a job of that agent claimed ahead may start on its slot now (not after a usage limit).
        """
        r = self.running.get(job_id)
        if r is None:
            return False
        agent = r.job.agent
        self.ahead.ran(agent, asyncio.get_running_loop().time() - r.since)
        workspace = r.job.spec.agent.repo.workspace is not None
        if keeps_slots(self.config, agent, workspace=workspace) or self._awaited(job_id) or not self.slots.give_back(r):
            return False
        self._trim_idle(agent)
        self.blocked.pop(agent, None)  # a slot of that agent is free again
        if hand_on:
            self._hand_on(agent)
        self.wake()
        return True

    def _awaited(self, job_id: str) -> bool:
        """Return True if a join waits for this job: it keeps its slot until it ends, so that the join its end
        readies is queued for that slot by its priority, before the lower-priority orders (section 16)."""
        return self.joins is not None and self.joins.awaits(job_id)

    def _park_in_claim_order(self, p: Parked, claimed: float | None) -> None:
        """Queue a claimed job whose start met a shortage again, ahead of new orders and of jobs claimed after it.

        Put first, as before, unless jobs put back the same way before it were claimed earlier:
        those keep their turn, so that the starts after a shortage go in the order of the claims.
        """
        at = 0
        for i, q in enumerate(self.parked):
            if q.kind is not Kind.RESUME or q.resume is None:
                break
            if claimed is None or (q.resume.spec.claimed or 0.0) > claimed:
                break
            at = i + 1
        self.parked.insert(at, p)

    def _finished(self, job_id: str, task: asyncio.Task[Outcome]) -> None:
        r, held = self.slots.pop(job_id)
        if held and r is not None:
            self._trim_idle(r.job.agent)
            self.blocked.pop(r.job.agent, None)  # a slot of that agent is free again
        outcome = task.result() if not task.cancelled() and task.exception() is None else Outcome.LEFT
        if outcome is Outcome.SHORT and r is not None and not self.ctx.stopping():
            self._park_in_claim_order(parked_again(r.job), r.job.spec.claimed)
        if outcome is Outcome.AGAIN and r is not None and not self.ctx.stopping():
            self.again[job_id] = r.job  # the same job runs its next attempt once a slot is free
            self.parked.appendleft(parked_again(r.job))
        if outcome is Outcome.GATED and r is not None and not self.ctx.stopping():
            job = r.job
            shown = job.agent in gated_agents(self.ctx.gates(), self.config.agents, time.time())
            # taken back at its expires (it ends expired, gate or not: section 16), or when its usage-limit
            # waits reach max_limit_wait (it fails then, if the limit was moved beyond that meanwhile)
            back_at = min((t for t in (job.expires, job.limit_until) if t is not None), default=None)
            self.aside.put(job_id, job.agent, job.spec.received, job, shown=shown, expires=back_at)
            if back_at is not None:
                asyncio.get_running_loop().call_later(max(0.0, back_at - time.time()) + 0.01, self.wake)
        ended = outcome in (Outcome.DONE, Outcome.FAILED, Outcome.REVIEW)
        if ended:
            self.stats.finished[outcome.value] += 1
        elif outcome is Outcome.LEFT and not self.ctx.stopping():
            self.left.add(job_id)
            self.left_new = True
        # a job that gave its slot back at its agent's exit and ended changes nothing a turn acts on, unless it was
        # the last one running (an exit or a stop may be due) or the cap on finishing jobs held a start back
        quiet = not held and ended and self.running and not self.ctx.stopping()
        if not quiet or self.slots.freed_room(self.config.max_jobs):
            self.wake()
