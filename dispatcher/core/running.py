"""The jobs a daemon runs, and the slots they hold: until their agents exit, or until they finish.

``max_jobs`` and an agent's ``concurrency`` count agents while they run (contract,
section 3), so a job gives both back when its agent exits and the next job starts while
it is checked and finished. Two kinds of job keep them until they finish (``keeps_slots``).
Slots given back in a turn wait in ``idle``, handed to the next claim of their agent.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from dispatcher.spec.settings import Config

if TYPE_CHECKING:
    from dispatcher.metrics import Metrics  # prometheus_client is imported only when metrics_file is set


class _Job(Protocol):
    """What the slots need of a job (``job.job.Job``; this module sits below it, beside the scheduler)."""

    job_id: str

    @property
    def agent(self) -> str: ...


J = TypeVar("J", bound=_Job)


@dataclass
class Running(Generic[J]):
    """A job's task, and what it holds."""

    job: J
    task: asyncio.Task[Any]
    slot: int | None
    holds: bool = True  # counts against max_jobs and holds its agent's slot
    since: float = 0.0  # when its agent started (the loop's clock)


class RunningJobs(Generic[J]):
    """The running jobs by id; how many hold a slot; the slots given back and not yet taken (``idle``)."""

    def __init__(self, metrics: Metrics | None) -> None:
        self.jobs: dict[str, Running[J]] = {}
        self.holding = 0
        self.idle: dict[str, list[int]] = {}
        self._metrics = metrics

    def set_metrics(self, metrics: Metrics | None) -> None:
        """Report to these metrics from now on (a reload set or unset ``metrics_file``), the running agents at once."""
        self._metrics = metrics
        self._count()

    def free(self, max_jobs: int) -> int:
        """Return how many more jobs may start: ``max_jobs`` less the holders, at most ``max_jobs`` finishing."""
        return min(max_jobs - self.holding, 2 * max_jobs - len(self.jobs))

    def freed_room(self, max_jobs: int) -> bool:
        """Return True if the job just popped, holding no slot, was over the cap of ``free`` (one more may start)."""
        return len(self.jobs) + 1 > max_jobs + self.holding

    def add(self, job: J, task: asyncio.Task[Any], slot: int | None) -> None:
        """Count a job that starts, with the agent's slot it holds."""
        self.jobs[job.job_id] = Running(job, task, slot, since=asyncio.get_running_loop().time())
        self.holding += 1
        self._count()

    def give_back(self, r: Running[J]) -> bool:
        """Give back what r holds (its place in ``max_jobs``, its agent's slot into ``idle``); False if nothing."""
        if not r.holds:
            return False
        r.holds = False
        self.holding -= 1
        if r.slot is not None:
            self.idle.setdefault(r.job.agent, []).append(r.slot)
            r.slot = None
        return True

    def running_s(self, agent: str, now: float) -> list[float]:
        """Return how long each of agent's jobs that hold a slot has been running (``now``: the loop's clock)."""
        return [now - r.since for r in self.jobs.values() if r.holds and r.job.agent == agent]

    def pop(self, job_id: str) -> tuple[Running[J] | None, bool]:
        """Forget a job that ended; return it and whether it still held its slots (now given back)."""
        r = self.jobs.pop(job_id, None)
        self._count()
        return r, r is not None and self.give_back(r)

    def _count(self) -> None:
        if self._metrics is not None:
            self._metrics.set_running(collections.Counter(r.job.agent for r in self.jobs.values()))


def keeps_slots(cfg: Config, agent_name: str, *, workspace: bool) -> bool:
    """Return True for a job of agent_name that keeps its slots after its agent exits, until it finishes.

    Under a daily cost cap (the agent's or the root's) the next attempt's check must see
    this job's cost, recorded at its finish. With a workspace, the next job's worktree
    starts from ``base`` after this one's ``land`` and ``after`` hooks, as with one agent
    at a time. An agent a reload removed starts no attempt any more: its own cap holds
    nothing back, and its jobs give their slots back as others do (section 13).
    """
    agent = cfg.agents.get(agent_name)
    if cfg.max_daily_cost_usd is not None or (agent is not None and agent.max_daily_cost_usd is not None):
        return True
    return workspace
