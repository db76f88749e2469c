"""Work the scheduler keeps, and what a claim's trip answers for it: plain data for the loop.

``Parked`` is work waiting for a slot (an order read but not claimed, a recovered job, a
retry, a job claimed ahead or put off for a shortage). ``core.claiming.Claims.run``
answers each piece of a batch with one of ``Launch``, ``NoSlot``, ``Dropped``, ``Gone``,
``Big`` or ``Later``; ``Handover`` carries the slots of jobs that just ended into the
trip, for the next job of the same agent.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field

from dispatcher.spec.jobspec import Attempt, JobSpec
from dispatcher.spec.order import Order
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.placing import Inspected


class Kind(enum.Enum):
    NEW = "new"
    RECOVER = "recover"
    RETRY = "retry"
    REVISE = "revise"
    JOINED = "joined"  # a job that waited for others (``after``), moved to active/ and taken by this daemon
    RESUME = "resume"  # a claimed job waiting for its start: claimed ahead, or its agent could not start for a shortage


@dataclass(frozen=True, slots=True)
class Resume:
    """A claimed job waiting for its start (claimed ahead, or put off for a shortage), kept as it was."""

    folder: JobFolder
    spec: JobSpec
    order: Order
    attempts: list[Attempt]
    fresh: bool = False  # claimed ahead from inbox/ just now: its attempts/ is known to be empty


@dataclass
class Parked:
    """Work that waits for a slot."""

    kind: Kind
    job_id: str
    agent: str
    item: Inspected | None = None
    token: int = 0
    host_lost: bool = False  # recovered from a daemon on another host whose lease ran out
    resume: Resume | None = None  # a claimed job queued again after a shortage, as it was
    rank: tuple[int, float] | None = None  # a ready join, or a recovered job never started: (-priority, received)
    expires: float | None = None  # an order (its `expires`) or a ready join: refused or failed `expired` then


@dataclass(frozen=True, slots=True)
class Launch:
    """A job ready to run, with the slot it holds."""

    parked: Parked
    folder: JobFolder
    spec: JobSpec
    order: Order
    token: int
    slot: int | None
    attempts: list[Attempt] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class NoSlot:
    """Its agent has no free slot: the work waits, parked."""

    parked: Parked


@dataclass(frozen=True, slots=True)
class Dropped:
    """Work that will not run now: refused, cancelled, taken by another daemon, or to try again later."""

    parked: Parked
    refused: bool = False
    retry_later: bool = False
    cancelled: bool = False  # claimed under a cancel request: it went to failed/ without a Job


@dataclass(frozen=True, slots=True)
class Gone:
    """A name that is no order to claim: it vanished, changed while read, or was refused."""

    name: str
    refused: bool = False
    later: bool = False  # the claim failed as a whole (a full disk, an error): try the file again later
    unsure: bool = False  # invalid when read at a close event: refused only if no other writer holds it open


@dataclass(frozen=True, slots=True)
class Later:
    """An order whose not_before is still to come: it waits unclaimed in inbox/ until ``due``."""

    name: str
    due: float
    priority: int


@dataclass(frozen=True, slots=True)
class Big:
    """A name whose file is too large to read in the ledger lane: the loop reads it in the scan lane."""

    name: str


Answer = Launch | NoSlot | Dropped | Gone | Big | Later


@dataclass
class Handover:
    """Slots of jobs that just ended, by agent, for the next job of the same agent (lane-owned)."""

    slots: dict[str, list[int]] = field(default_factory=dict)

    def take(self, agent: str) -> int | None:
        """Return a handed-over slot of agent, if one is left."""
        free = self.slots.get(agent)
        return free.pop() if free else None


def park_ranked(parked: collections.deque[Parked], p: Parked) -> None:
    """Queue p before the first parked order (or ready join) of lower rank (``parked_rank``); others keep their turn."""
    rank = parked_rank(p)
    for i, q in enumerate(parked):
        if ranked(q) and parked_rank(q) > rank:
            parked.insert(i, p)
            return
    parked.append(p)


def ranked(p: Parked) -> bool:
    """Return True if p takes its place among parked orders by rank: an order, a ready join, a job never started."""
    return p.kind is Kind.NEW or (p.kind in (Kind.JOINED, Kind.RECOVER) and p.rank is not None)


Ranked = tuple[tuple[int, float], float | None]  # a recovered job never started: (-priority, received), expires

Rank = tuple[int, float, str]  # (-priority, modification time in epoch seconds, file name): lower goes first


def parked_rank(p: Parked) -> Rank:
    """Return where a parked order (or ready join) goes among parked orders: higher priority first, then older
    (by modification time, then name), as inbox/ ranks unread orders (``Inbox.head_rank``)."""
    if p.item is not None:
        stamp = p.item.stamp
        return (-p.item.order.priority, stamp[1] / 1e9 if stamp is not None else p.item.received, p.item.name)
    return (*p.rank, "") if p.rank is not None else (0, 0.0, "")
