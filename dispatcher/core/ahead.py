"""Claims made ahead of a free slot, for agents whose runs are short.

Between an agent's exit and the next start on its slot, a new order's claim costs a
trip to the ledger lane and its fsyncs (the claim row, the job folder, ``active/``): a
few milliseconds on a disk. For an agent that runs for minutes that is nothing; for one
that runs for 50 ms it is a tenth of the time. So while every slot of such an agent is
busy, the scheduler claims its next orders ahead: they are claimed jobs in ``active/``
without a slot, queued first, and each starts as soon as a slot is given back, with the
slot handed over on the loop (no trip at all).

Only where it pays and changes little:

- the agent's last ``RUNS_KEPT`` runs each took under ``QUICK_S``, and none of its agents
  running now has run that long (a long run in a quick agent's history stops it);
- and each took at least twice as long as a claim takes now (``claimed``): a claim made
  ahead must be done before the slot frees, or it only adds work beside the claim that
  runs anyway (with agents of a millisecond, the ledger lane is what limits);
- at most the agent's ``concurrency`` jobs are claimed ahead, and at most ``max_jobs``
  for the whole daemon, so another daemon is never kept from work for longer than a
  short run;
- never an order with ``expires`` (it is refused, not failed, if it is not started in
  time: contract 16) or with ``after`` (a join is claimed at once anyway).

An order claimed ahead is claimed: ``hold`` no longer takes it, ``cancel`` fails it, and a
higher-priority order that arrives later runs after it.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from dispatcher.core.claiming import claimable_ahead
from dispatcher.core.gatekeeper import gated_agents
from dispatcher.core.running import Running, RunningJobs
from dispatcher.core.setaside import SetAside
from dispatcher.core.watcher import Inbox
from dispatcher.core.work import Kind, Launch, Parked, Resume
from dispatcher.job.context import JobContext
from dispatcher.shortage import SHORT
from dispatcher.spec.settings import Config

log = structlog.get_logger("dispatcher")

QUICK_S = 0.5  # an agent whose runs take less than this gets its next orders claimed ahead
RUNS_KEPT = 3  # how many of an agent's last runs decide


class Ahead:
    """How long each agent's recent runs took, and how many of its jobs are claimed ahead (on the loop)."""

    def __init__(self) -> None:
        self._runs: dict[str, collections.deque[float]] = {}
        self.ready: dict[str, str] = {}  # job id -> agent: claimed ahead, queued, waiting for a slot
        self.claiming: collections.Counter[str] = collections.Counter()  # in the claim's trip now
        self.claim_s = 0.0  # how long a claim's trip takes, smoothed

    def ran(self, agent: str, seconds: float) -> None:
        """Note that one of agent's agents exited after running for seconds."""
        runs = self._runs.get(agent)
        if runs is None:
            runs = self._runs[agent] = collections.deque(maxlen=RUNS_KEPT)
        runs.append(seconds)

    def claimed(self, seconds: float) -> None:
        """Note how long a claim's trip took (from the loop's handing it over to its answer)."""
        self.claim_s = seconds if self.claim_s == 0.0 else 0.8 * self.claim_s + 0.2 * seconds

    def quick(self, agent: str, running_s: Iterable[float]) -> bool:
        """Return True if agent's last runs were all short (but outlast a claim) and none running has run long."""
        runs = self._runs.get(agent)
        if runs is None or len(runs) < RUNS_KEPT or max(runs) >= QUICK_S or min(runs) < 2 * self.claim_s:
            return False
        return all(s < QUICK_S for s in running_s)

    def room(self, agent: str, concurrency: int) -> int:
        """Return how many more of agent's orders may be claimed ahead now."""
        ready = sum(1 for of in self.ready.values() if of == agent)
        return max(0, concurrency - ready - self.claiming[agent])

    def total(self) -> int:
        """Return how many jobs are claimed ahead or being claimed ahead, for every agent."""
        return len(self.ready) + self.claiming.total()

    def queued(self, job_id: str, agent: str) -> None:
        """Note a job of agent claimed ahead and queued."""
        self.ready[job_id] = agent

    def started(self, job_id: str) -> None:
        """A job left the queue (it starts, or is cancelled); nothing if it was not claimed ahead."""
        self.ready.pop(job_id, None)

    def choose(
        self,
        cfg: Config,
        parked: collections.deque[Parked],
        inbox: Inbox,
        gated: frozenset[str],
        running_s: Callable[[str], list[float]],
    ) -> tuple[list[Parked | str], list[str]]:
        """Take the orders to claim ahead now: parked ones first, then inbox/'s, by priority and age.

        Returns them and, for each, its agent (at a glance for a name not read yet), which
        count as being claimed until ``claiming`` is given them back. ``running_s(agent)``:
        how long each of its agents that hold a slot has been running. No order is passed
        over: the first one that may not be claimed ahead stops its agent (and, in inbox/,
        every agent).
        """
        room = cfg.max_jobs - self.total()
        if room <= 0:
            return [], []
        rooms: dict[str, int] = {}

        def room_of(agent: str) -> int:
            if agent not in rooms:
                a = cfg.agents.get(agent)
                quick = a is not None and self.quick(agent, running_s(agent))
                rooms[agent] = self.room(agent, a.concurrency) if quick and a is not None else 0
            return rooms[agent]

        out: list[Parked | str] = []
        agents: list[str] = []
        passed: set[str] = set()  # agents with an order not claimed ahead: none behind it is
        for p in list(parked):  # read already, waiting for their agent's slot
            if room <= 0:
                break
            if p.kind is not Kind.NEW:  # a ready join, a retry, a job set aside: it waits for its agent's next
                passed.add(p.agent)  # slot, which a claim made ahead behind it would take (section 16)
                continue
            if p.agent in passed:
                continue
            if not claimable_ahead(p) or room_of(p.agent) <= 0:
                passed.add(p.agent)
                continue
            parked.remove(p)
            out.append(p)
            agents.append(p.agent)
            rooms[p.agent] -= 1
            room -= 1
        while room > 0 and not SHORT.short():  # then the next orders in inbox/, while their agent is quick
            upcoming = inbox.next_agent(gated)
            if upcoming is None or upcoming[1] or upcoming[0] in passed or room_of(upcoming[0]) <= 0:
                break
            name = inbox.pop(gated)
            if name is None:
                break
            out.append(name)
            agents.append(upcoming[0])
            rooms[upcoming[0]] -= 1
            room -= 1
        self.claiming.update(agents)
        return out, agents


class ClaimsAhead(abc.ABC):
    """The scheduler's part in claims made ahead: when to claim, where they queue, how they start.

    ``core.scheduler.Scheduler`` supplies its queues and ``_run``; the rules are ``Ahead``'s.
    """

    ctx: JobContext
    inbox: Inbox
    parked: collections.deque[Parked]
    slots: RunningJobs[Any]
    running: dict[str, Running[Any]]
    ahead: Ahead
    inflight: int
    blocked: dict[str, float]
    aside: SetAside[Any]
    wake: Callable[[], None]

    @property
    @abc.abstractmethod
    def config(self) -> Config:
        """The config in force."""

    @abc.abstractmethod
    def _run(self, launch: Launch, *, cancel: bool = False) -> None:
        """Start a claimed job."""

    @abc.abstractmethod
    def free_slots(self) -> int:
        """How many more jobs may start now."""

    def _claim_ahead(self, gated: frozenset[str]) -> tuple[list[Parked | str], list[str]]:
        """Take the next orders of quick agents whose slots are all busy, to be claimed ahead (``core.ahead``)."""
        if self.inflight:  # orders in a claim's trip now come first (they may still need a slot)
            return [], []
        if self.ctx.starts.count:  # after the agents being started now (``job.starting``)
            self.ctx.starts.on_quiet = self.wake
            return [], []
        self.ctx.starts.on_quiet = None
        if not (self.parked or self.inbox.has_ready()) or not SHORT.room():
            return [], []  # nothing to claim, or an agent could not start now (section 13)
        now = asyncio.get_running_loop().time()
        return self.ahead.choose(
            self.config, self.parked, self.inbox, gated, lambda agent: self.slots.running_s(agent, now)
        )

    def _agent_room(self, agent: str) -> int:
        """Return how many more of agent's jobs may start here: its concurrency less those holding a slot."""
        a = self.config.agents.get(agent)
        if a is None:
            return 1 << 30
        return a.concurrency - sum(1 for r in self.running.values() if r.holds and r.job.agent == agent)

    def _at_concurrency(self, agent: str) -> bool:
        """Return True if agent's jobs here hold all its slots (one comes back when one of its agents exits)."""
        a = self.config.agents.get(agent)
        holding = sum(1 for r in self.running.values() if r.holds and r.job.agent == agent)
        return a is not None and holding >= a.concurrency

    def _unqueued(self, p: Parked) -> None:
        """Note that p left the queue (if it was claimed ahead, one fewer is)."""
        self.ahead.started(p.job_id)

    def _start_handed_over(self, p: Parked) -> bool:
        """Start a job claimed ahead with a slot its agent just gave back, on the loop; False if none is idle."""
        free = self.slots.idle.get(p.agent)
        if not free or p.resume is None:
            return False
        r = p.resume
        self._run(Launch(p, r.folder, r.spec, r.order, p.token, free.pop(), list(r.attempts)))
        return True

    def _hand_on(self, agent: str) -> None:
        """Start the job claimed ahead at the head of the queue on the slot agent just gave back, now.

        Started here, the next agent runs before the job that just ended is checked and
        finished (that job's post-exit trip waits for starts under way, ``job.starting``),
        instead of after it, at the scheduler's next turn. Anything else (no such job at
        the head, a stop, a shortage, a fenced lease, a gated agent, a job set aside that
        its gate now lets go and that goes first) is left to that turn.
        """
        if not self.parked or self.ctx.stopping() or self.ctx.fenced() or SHORT.short() or agent in self.blocked:
            return
        p = self.parked[0]
        if p.agent != agent or p.job_id not in self.ahead.ready or not self.slots.idle.get(agent):
            return
        wall = time.time()
        gated = gated_agents(self.ctx.gates(), self.config.agents, wall)
        if self.free_slots() <= 0 or agent in gated or self.aside.due(gated, time.monotonic(), wall):
            return
        self.parked.popleft()
        self._unqueued(p)
        try:
            started = self._start_handed_over(p)
        except Exception:
            log.exception("daemon.error", step="hand_on", job_id=p.job_id, agent=p.agent)
            started = False
        if not started:  # the next turn starts it
            self.parked.appendleft(p)
            self.ahead.queued(p.job_id, p.agent)
            self.wake()

    def _park_ready(self, launch: Launch) -> None:
        """Queue a job claimed ahead: after the other claimed work, before every order not claimed yet."""
        p = launch.parked
        resume = Resume(launch.folder, launch.spec, launch.order, list(launch.attempts), fresh=p.kind is Kind.NEW)
        ready = Parked(Kind.RESUME, p.job_id, p.agent, token=launch.token, resume=resume)
        self.ahead.queued(p.job_id, p.agent)
        at = next((i for i, q in enumerate(self.parked) if q.kind is Kind.NEW), len(self.parked))
        self.parked.insert(at, ready)
