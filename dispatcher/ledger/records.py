"""The ledger's records: the rows, requests, claims, finishes, waits and gates it keeps and answers with.

Plain frozen values, shared by the interface (``ledger.base``), its engines and
their callers.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from dispatcher.errors import DispatchError, UsageError
from dispatcher.lifecycle import Row


class Request(enum.StrEnum):
    """What an operator asked a daemon to do for a job."""

    RETRY = "retry"
    CANCEL = "cancel"
    REVISE = "revise"


class GateKind(enum.StrEnum):
    """Why an agent is gated (no new attempt of it starts on any host)."""

    LIMIT = "limit"  # the agent's CLI said "come back at T" (a usage limit)
    PAUSE = "pause"  # `dispatcher pause AGENT`, until `dispatcher resume AGENT`
    BUDGET = "budget"  # a daily cost cap was reached; ``agent`` "*" is the root's cap


#: the gate ``agent`` of the root's own daily cap: it holds every agent
EVERY_AGENT = "*"


@dataclass(frozen=True, slots=True)
class Gate:
    """One gate: no attempt of ``agent`` starts before ``until`` (None: until lifted by hand)."""

    agent: str
    kind: str
    until: float | None
    reason: str | None = None

    def holds(self, agent: str, at: float) -> bool:
        """Return True when this gate keeps ``agent`` from starting at time ``at``."""
        return self.agent in (agent, EVERY_AGENT) and (self.until is None or self.until > at)


def held_until(own: float | None, agent: str, gates: list[Gate], now: float) -> float | None:
    """Return until when a job of ``agent`` waiting at a gate since ``own`` (None: until resumed) waits: its own
    time, moved later by a gate that holds its agent now (another attempt's limit, a pause: None)."""
    until = own
    for gate in gates:
        if until is not None and gate.holds(agent, now):
            until = None if gate.until is None else max(until, gate.until)
    return until


@dataclass(frozen=True, slots=True)
class Entry:
    """One row of the ledger."""

    job_id: str
    state: str
    agent: str | None
    owner: str | None
    token: int
    source: str | None
    digest: str | None
    parent: str | None
    hops: int
    cost_usd: float | None
    chain_cost_usd: float | None
    updated: float
    # when cost_usd was counted, if not at ``updated`` (a review decided later); carried by the bulk steps
    # (rebuild, migrate) only: the rows the daemon's own steps read leave it None
    spent: float | None = None


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """Claim ``job_id`` for the file ``source`` (its bytes hash to ``digest``).

    ``may_take_over`` is the caller's word that no job folder exists for the id,
    so that a claim left by a dead daemon for this very file may be taken over.
    """

    job_id: str
    agent: str
    source: str
    digest: str
    may_take_over: bool = True


@dataclass(frozen=True, slots=True)
class Claimed:
    """The id is ours, with the lineage the ledger holds and a new fencing token."""

    job_id: str
    token: int
    parent: str | None = None
    hops: int = 0
    previous: str | None = None  # the state a taken-over or released row had
    parent_chain_cost_usd: float | None = None
    previous_owner: str | None = None  # the dead daemon a claim was taken over from
    cancelled: bool = False  # a cancel request was open at the claim: the job ends failed, no attempt


@dataclass(frozen=True, slots=True)
class Known:
    """The id was seen before: the file must be refused."""

    entry: Entry


@dataclass(frozen=True, slots=True)
class Busy:
    """A live daemon is claiming this very file right now: leave it alone."""

    entry: Entry


ClaimAnswer = Claimed | Known | Busy


@dataclass(frozen=True, slots=True)
class Finish:
    """Record a job's end (or its wait in review/), if ``token`` still holds its claim."""

    job_id: str
    token: int
    state: Row
    cost_usd: float | None = None
    chain_cost_usd: float | None = None


@dataclass(frozen=True, slots=True)
class Child:
    """A follow-up to reserve: its id, its agent and its file name in the parent's outbox/."""

    job_id: str
    agent: str
    source: str


@dataclass(frozen=True, slots=True)
class Wait:
    """A job that waits for others (``after``): the ids it names, its rule and when it began to wait."""

    job_id: str
    after: tuple[str, ...]
    rule: str
    since: float


def fold_waits(rows: Iterable[tuple[str, str, str, float]]) -> list[Wait]:
    """Fold (job_id, parent, rule, since) rows into one ``Wait`` per job, in first-seen order."""
    found: dict[str, list[str]] = {}
    first: dict[str, tuple[str, float]] = {}
    for job_id, parent, rule, since in rows:
        found.setdefault(job_id, []).append(parent)
        first.setdefault(job_id, (rule, float(since)))
    return [Wait(j, tuple(sorted(ps)), first[j][0], first[j][1]) for j, ps in found.items()]


@dataclass(frozen=True, slots=True)
class GateWait:
    """A claimed job that waits for a gate of ``agent`` (``until`` None: until it is lifted), since ``since``."""

    job_id: str
    agent: str
    until: float | None
    since: float


@dataclass(frozen=True, slots=True)
class Extras:
    """What a ledger holds beside its rows, as `ledger migrate` copies it.

    ``requests`` are (job_id, kind, at), oldest first; ``waits`` are every join's
    recorded wait (also of jobs that run or ended: recovery reads them); ``gates``
    and ``gate_waits`` are section 14's.
    """

    requests: tuple[tuple[str, Request, float], ...] = ()
    waits: tuple[Wait, ...] = ()
    gates: tuple[Gate, ...] = ()
    gate_waits: tuple[GateWait, ...] = ()

    def counts(self) -> dict[str, int]:
        """Return how many of each there are, by name."""
        return {
            "requests": len(self.requests),
            "waits": len(self.waits),
            "gates": len(self.gates),
            "gate_waits": len(self.gate_waits),
        }


@dataclass(frozen=True, slots=True)
class DaemonInfo:
    """One daemon process sharing the ledger, as `status` lists it."""

    owner: str
    pid: int
    host: str
    started: float
    alive: bool = True
    #: the digest of the config file the daemon loaded last (at start or reload)
    config_digest: str | None = None


class LedgerUnavailable(DispatchError):
    """The ledger cannot be reached or written right now; the step is retried, never guessed.

    A command that meets it (its patience ran out) prints this one line and exits 1.
    """


REBUILD_HINT = "run `dispatcher ledger rebuild` (with no daemon running) to rebuild it from the job folders"


class LedgerDamaged(UsageError):
    """The SQLite ledger's file is damaged (SQLITE_CORRUPT, SQLITE_NOTADB) where a step read it: one line naming
    `dispatcher ledger rebuild`, exit 2, as for a ledger found unreadable when it was opened (contract 12)."""


def takes_release(entry: Entry, source: str, digest: str) -> bool:
    """Return True if a claim of ``source`` (with ``digest``) takes the follow-up ``entry`` reserved or released.

    The released file is its bytes under any name, or whatever file now has the name it was
    released under: an operator may edit a released (or held and released) follow-up before it
    runs, and its lineage still comes from the row. Any other file with the id is a duplicate.
    """
    if entry.state == Row.RELEASED and entry.source == source:
        return True
    return entry.state in (Row.RESERVED, Row.RELEASED) and entry.digest == digest


def folder_may_be_lost(host: str | None, started: float | None, this_host: str, booted: float) -> bool:
    """Could a dead daemon have lost the folder of a claim it committed? Only then is its claim taken over.

    A claim's folder is made before its claim commits and fsynced after: a crash of the
    daemon leaves it for recovery to put in place, and only a power cut or a crash of the
    system between the two loses it; both boot the host again. A daemon that ran on this
    host (``host``) after its last boot (``started`` later than ``booted``) lost nothing:
    a claim of it without any folder of the id was removed by hand, and a new file of that
    id is refused (contract 6: never run again by a new file). Another host's daemon, or
    one whose start is unknown, may have lost it.
    """
    if host is None or started is None or host != this_host:
        return True
    return started < booted
