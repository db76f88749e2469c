"""What operators and housekeeping ask of the scheduler: stop jobs, queue retries and recoveries, cancel.

``Requests`` is the half of ``core.scheduler.Scheduler`` that carries out requests from
outside the start loop (``dispatcher cancel``, ``retry``, ``revise``, recovery, a join whose
wait is over, a stop); it reads and changes the scheduler's queues through the attributes
the scheduler gives it.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Generic, Protocol, TypeVar

from dispatcher.core.running import Running
from dispatcher.core.setaside import SetAside
from dispatcher.core.watcher import Inbox
from dispatcher.core.work import Kind, Parked, Ranked, Resume, park_ranked
from dispatcher.job.control import Control
from dispatcher.job.joins import Joined
from dispatcher.lifecycle import Row, Stop
from dispatcher.spec.jobspec import Attempt, JobSpec
from dispatcher.spec.order import Order
from dispatcher.store.jobstore import JobFolder


class Job(Protocol):
    """What requests need of a claimed job (``job.job.Job``, which sits above this module)."""

    job_id: str
    token: int
    folder: JobFolder
    spec: JobSpec
    order: Order
    attempts: list[Attempt]
    control: Control

    @property
    def agent(self) -> str: ...


J = TypeVar("J", bound=Job)


class Requests(abc.ABC, Generic[J]):
    """Requests carried out on the scheduler's queues; ``Scheduler`` supplies them and the claim trip."""

    running: dict[str, Running[J]]
    parked: collections.deque[Parked]
    aside: SetAside[J]
    inflight: int
    inbox: Inbox
    wake: Callable[[], None]
    left_new: bool  # a job was stopped while the daemon went on since the last recovery began (``Fencing``)

    @abc.abstractmethod
    def _unqueued(self, p: Parked) -> None:
        """Note that p left the queue other than by starting (a job claimed ahead is one fewer)."""

    @abc.abstractmethod
    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a step in the background."""

    @abc.abstractmethod
    async def _launch(self, batch: list[Parked | str], *, cancel: bool = False) -> None:
        """Claim or reload a batch in the claim's trip (``cancel``: without slots, to fail it)."""

    # -- stopping -----------------------------------------------------------------------------
    def abort_all(self, reason: Stop, *, only_waiting: bool = False, mute: bool = False, now: bool = False) -> None:
        """Stop every running job (or only those waiting before a retry); ``mute`` their log writes too;
        ``now`` kills their agents' groups at once (a second stop signal)."""
        for r in self.running.values():
            if not only_waiting or r.job.control.waiting:
                r.job.control.abort(reason, mute=mute, now=now)

    # -- requests -----------------------------------------------------------------------------
    def park_recovered(
        self,
        adopted: list[tuple[str, int, str]],
        ranks: Mapping[str, Ranked] | None = None,
        *,
        host_lost: bool = False,
    ) -> None:
        """Queue adopted jobs of dead daemons first (their agents were already ended); those that never started an
        attempt (``ranks``: -priority, received; expires) take their place among the orders by priority and age
        instead, and fail `expired` at their expires if still waiting for a slot then (as a ready join does)."""
        ranks = ranks or {}
        for job_id, token, agent in reversed(adopted):
            if job_id not in ranks:
                self.parked.appendleft(Parked(Kind.RECOVER, job_id, agent, token=token, host_lost=host_lost))
        for job_id, token, agent in adopted:
            if (ranked := ranks.get(job_id)) is None:
                continue
            rank, expires = ranked
            p = Parked(Kind.RECOVER, job_id, agent, token=token, host_lost=host_lost, rank=rank, expires=expires)
            park_ranked(self.parked, p)
            if expires is not None:  # still waiting for a slot then: it fails `expired` at that time (section 16)
                asyncio.get_running_loop().call_later(max(0.0, expires - time.time()) + 0.01, self.wake)

    def park_retry(self, job_id: str, agent: str, *, revise: bool = False) -> None:
        """Queue a failed job for `dispatcher retry` (or a job for `dispatcher revise`), once."""
        if job_id in self.running or job_id in self.aside or any(p.job_id == job_id for p in self.parked):
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
                self._unqueued(p)
                self._launch_now(p)
                return True
        if (held := self.aside.take(job_id)) is not None:
            self._launch_now(parked_again(held))
            return True
        return entry_state in (Row.DONE, Row.FAILED, Row.CLAIMED, Row.REVIEW)

    def claim_now(self, name: str) -> None:
        """Claim an order still unread in inbox/ at once, without a slot (a cancel was asked for it)."""
        self.inbox.forget(name)
        self.inflight += 1
        self._background(self._launch([name], cancel=True))

    def _launch_now(self, p: Parked) -> None:
        self.inflight += 1
        self._background(self._launch([p], cancel=True))

    def park_all_joined(self, joined: list[Joined]) -> None:
        """Queue jobs whose waits are over (moved to active/ and taken by this daemon), all before the next turn.

        Among the orders parked for a slot each takes its place by priority, then age, as an
        order read from inbox/ would (``parked_rank``): not behind every order read before it.
        """
        loop = asyncio.get_running_loop()
        for job_id, token, agent, rank, expires in joined:
            park_ranked(self.parked, Parked(Kind.JOINED, job_id, agent, token=token, rank=rank, expires=expires))
            if expires is not None:  # still waiting for a slot then: it fails `expired` at that time (section 16)
                loop.call_later(max(0.0, expires - time.time()) + 0.01, self.wake)
        self.wake()


def parked_again(job: Job) -> Parked:
    """Return a claimed job as parked work again (a shortage, a gate): it needs slots, nothing is read again."""
    resume = Resume(job.folder, job.spec, job.order, list(job.attempts))
    return Parked(Kind.RESUME, job.job_id, job.agent, token=job.token, resume=resume)
