"""The ledger interface: what a daemon needs from a durable job ledger, and its types.

The ledger is the one place that decides "may this job id be taken?". Every
engine (SQLite on one host, PostgreSQL shared by many) implements ``Ledger``;
the daemon, the job store and the commands only ever see this interface.

Calls block (a disk or a network round trip), so the daemon makes them from its
ledger lane, never from its event loop. Every finishing step carries the claim's
fencing ``token`` and is refused (returns False) when the claim was taken over.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence

from dispatcher.ledger.records import (
    EVERY_AGENT,
    Busy,
    Child,
    ClaimAnswer,
    Claimed,
    ClaimRequest,
    DaemonInfo,
    Entry,
    Extras,
    Finish,
    Gate,
    GateKind,
    GateWait,
    Known,
    LedgerUnavailable,
    Request,
    Wait,
    fold_waits,
)
from dispatcher.lifecycle import Row, State, spoken

__all__ = [
    "EVERY_AGENT",
    "Busy",
    "Child",
    "ClaimAnswer",
    "ClaimRequest",
    "Claimed",
    "DaemonInfo",
    "Entry",
    "Extras",
    "Finish",
    "Gate",
    "GateKind",
    "GateWait",
    "Known",
    "Leases",
    "Ledger",
    "LedgerUnavailable",
    "Request",
    "Wait",
    "fold_waits",
    "now",
]


class Leases(ABC):
    """The lease side of an engine whose daemons' liveness is a lease (contract section 12).

    A daemon on such an engine runs a lease keeper: it renews its own lease,
    reaps daemons whose lease ran out, and fences itself while it cannot renew.
    """

    @abstractmethod
    def renew(self) -> bool:
        """Renew this daemon's lease (one try); return False when it could not."""

    @abstractmethod
    def reap(self) -> list[str]:
        """Mark daemons whose lease ran out as dead; return the newly dead."""

    def lost_daemon(self, owner: str) -> tuple[str, int] | None:
        """Return the host and pid of a daemon ``reap`` found dead (None when unknown)."""
        return None

    @abstractmethod
    def may_reap(self) -> bool:
        """Return True once this daemon has renewed its own lease without a gap for a full lease."""

    @abstractmethod
    def lease_ok(self) -> bool:
        """Return False while this daemon must fence itself: no renewal for lease/2."""

    @abstractmethod
    def ok_for_s(self) -> float | None:
        """Return how long ``lease_ok`` stays True if no renewal succeeds meanwhile (None: not ok now)."""

    @property
    @abstractmethod
    def lost(self) -> bool:
        """True once another daemon declared this one dead: it must stop."""


class Ledger(ABC):
    """A durable set of job ids with their states, lineage, requests, slots and daemons."""

    #: this process's identity in the ledger ("" for a command that is not a daemon)
    owner: str = ""
    #: True when free_slot never blocks (local flocks): the daemon may call it from its loop
    slots_local: bool = False
    #: what ends every wait for the ledger early (see ``set_give_up``); None: nothing does
    _give_up: Callable[[], bool] | None = None

    # -- lifecycle and liveness ---------------------------------------------------------
    @abstractmethod
    def close(self) -> None:
        """Release the connection and anything held for this process."""

    def take_back_locks(self) -> list[str]:
        """Lock again this daemon's lock files found deleted or replaced (by hand, a tmp cleaner); return them.

        Called by the daemon at each rescan, on its loop: a few ``stat`` calls. A ledger
        whose liveness and slots are not lock files has none.
        """
        return []

    def sever_stuck(self, older_than_s: float) -> int:
        """Cut the connections of calls hung for longer than older_than_s on a silent server; return how many.

        Called from a thread of its own while a stop waits (``core.stopwatch``): a call that
        blocks in a read never gets back to its wait's ``give_up``. An embedded ledger has
        no connection to cut.
        """
        return 0

    @abstractmethod
    def register(self, info: DaemonInfo) -> None:
        """Announce a daemon start under a new identity (never reused)."""

    @abstractmethod
    def record_config(self, digest: str | None) -> None:
        """Record in this daemon's entry the digest of the config it has just loaded (a reload)."""

    @abstractmethod
    def alive(self, owner: str) -> bool:
        """Return True while the daemon ``owner`` lives."""

    @abstractmethod
    def daemons(self) -> list[DaemonInfo]:
        """Return every daemon known on this ledger, live or dead, newest first."""

    def stopped_cleanly(self, owner: str) -> bool:
        """Return True if the dead daemon ``owner`` ended by a clean stop (not declared lost with its host).

        Only a ledger shared by hosts tells them apart; on one host a dead daemon was never a lost host.
        """
        return False

    @property
    def leases(self) -> Leases | None:
        """The engine's leases when a daemon's liveness is a lease; None when it is a local lock."""
        return None

    def lease_ok(self) -> bool:
        """Return False while this daemon must fence itself (always True without leases)."""
        leases = self.leases
        return leases is None or leases.lease_ok()

    @property
    def lost(self) -> bool:
        """True once another daemon declared this one dead: it must stop (never without leases)."""
        leases = self.leases
        return leases is not None and leases.lost

    def set_give_up(self, give_up: Callable[[], bool]) -> None:
        """End every wait for a busy or unreachable ledger once ``give_up()`` is True.

        The step waiting then raises ``LedgerUnavailable``. A daemon forced to
        stop sets this; a command waits out its patience instead.
        """
        self._give_up = give_up

    def giving_up(self) -> bool:
        """Return True when a wait for the ledger must end now (see ``set_give_up``)."""
        return self._give_up is not None and self._give_up()

    # -- reads --------------------------------------------------------------------------
    @abstractmethod
    def get(self, job_id: str) -> Entry | None:
        """Return the row of job_id, or None if the id was never seen."""

    @abstractmethod
    def known(self, job_ids: Iterable[str]) -> dict[str, Entry]:
        """Return the rows of those ids that the ledger knows."""

    @abstractmethod
    def children(self, job_id: str) -> list[str]:
        """Return the follow-up ids whose parent is job_id, in id order."""

    @abstractmethod
    def in_state(self, *states: Row) -> list[Entry]:
        """Return the rows in any of these states."""

    # -- claims -------------------------------------------------------------------------
    @abstractmethod
    def claim(self, requests: Sequence[ClaimRequest]) -> list[ClaimAnswer]:
        """Claim many ids for this daemon in one transaction; one answer per request, in order.

        A new id is inserted. A released follow-up is taken when the file's digest
        is the one released. A row claimed by a dead daemon for this same file is
        taken over when the request allows it. Anything else is ``Known``, or
        ``Busy`` when a live daemon is claiming this same file.
        """

    @abstractmethod
    def unclaim(self, job_id: str, token: int, previous: str | None, previous_owner: str | None = None) -> None:
        """Undo a claim whose job folder could not be put in place (nothing ran).

        A claim taken over from ``previous_owner`` goes back to it, with its token.
        """

    @abstractmethod
    def adopt(self, job_id: str, expected_owner: str | None, expected_token: int) -> int | None:
        """Take over a claimed job of a dead daemon; return the new token, or None if another won."""

    @abstractmethod
    def take_retry(self, job_id: str, kind: Request = Request.RETRY) -> int | None:
        """Turn a failed job with an open retry request into a claim by this daemon; return the token.

        None when the job is not failed or its request was carried out already.
        With ``kind`` REVISE, a job in review is taken too (`dispatcher revise`).
        """

    # -- finishing (each conditional on the claim's token) -------------------------------
    @abstractmethod
    def finish(self, items: Sequence[Finish]) -> list[bool]:
        """Record ends in one transaction; False for each item whose claim was taken over."""

    @abstractmethod
    def reserve(self, parent: str, token: int, hops: int, children: Sequence[Child]) -> list[str] | None:
        """Reserve follow-ups of parent; return the ids already taken ([] = all reserved).

        Nothing is reserved unless every id is free (or already reserved by this
        parent, after a crash). None means the parent's claim was taken over.
        """

    @abstractmethod
    def pending_releases(self, parent: str | None = None) -> list[Entry]:
        """Return reserved follow-ups whose parent is done; ``owner`` is the parent's owner."""

    @abstractmethod
    def set_digest(self, job_id: str, digest: str) -> None:
        """Record the digest a reserved follow-up will be released with (before its file exists)."""

    @abstractmethod
    def take_release(self, job_id: str, digest: str, releaser: str) -> bool:
        """Take the turn to release a reserved follow-up, recording its digest; False if not ours to place.

        False when the row is no longer reserved, or another live process holds the turn
        (``releasers.holder_gone``). Taking it again under the same ``releaser`` succeeds.
        """

    @abstractmethod
    def mark_released(self, job_id: str, source: str, digest: str, *, held: bool = False) -> bool:
        """Record that a reserved follow-up's file is in inbox/ (or held/) under source."""

    # -- joins (``after``, contract section 16) ----------------------------------------------
    @abstractmethod
    def wait(self, job_id: str, token: int, after: Sequence[str], rule: str) -> bool:
        """Turn this daemon's claim into a wait for ``after`` (no owner); False if the token moved on.

        The ids and the rule are kept with the row, also once the job runs.
        """

    @abstractmethod
    def waits(self, job_ids: Iterable[str] | None = None) -> list[Wait]:
        """Return the waits recorded for these ids (None: of every job in state waiting)."""

    @abstractmethod
    def waiting_on(self, parents: Iterable[str], *, any_state: bool = False) -> list[str]:
        """Return the ids of waiting jobs that name any of ``parents`` in ``after`` (with ``any_state``: of every
        such job, whatever its state now)."""

    @abstractmethod
    def take_waiting(self, job_id: str) -> int | None:
        """Turn a waiting job into a claim by this daemon; return the new token, None if another won."""

    @abstractmethod
    def set_state(self, job_id: str, state: Row, *, expect: Row) -> bool:
        """Move a row from one open state to another (a held follow-up released by an operator)."""

    @abstractmethod
    def reconcile(self, job_id: str, agent: str | None, parent: str | None, hops: int) -> bool:
        """Put back the claim row of a job found in active/ that the ledger lost; True if a row changed.

        Only a missing, reserved or released row is changed (a power loss, a lost WAL).
        """

    # -- requests -----------------------------------------------------------------------
    @abstractmethod
    def request(self, job_id: str, kind: Request) -> None:
        """Record a request for a daemon to carry out."""

    @abstractmethod
    def requests(self, kind: Request) -> list[str]:
        """Return the job ids with an open request of this kind, oldest first."""

    @abstractmethod
    def clear_request(self, job_id: str, kind: Request, *, drop_reserved: bool = False) -> None:
        """Mark a request as carried out; ``drop_reserved``: a revision carried out (the job moved into active/),
        the reviewed attempt's follow-ups still reserved go with it (the new attempt writes its own outbox)."""

    # -- gates and waits (contract section 14) ----------------------------------------------
    @abstractmethod
    def set_gate(self, gate: Gate, *, at: float) -> bool:
        """Gate an agent (a later ``until`` of the same kind wins, with its reason); return True if none of that
        kind held at ``at``."""

    @abstractmethod
    def lift_gates(
        self, agent: str | None = None, *, kind: str | None = None, expired_at: float | None = None
    ) -> list[Gate]:
        """Remove gates: every gate of ``agent`` (only of ``kind`` if given), or (``expired_at``) those whose
        time has come; return them."""

    @abstractmethod
    def gates(self) -> list[Gate]:
        """Return every gate recorded, in force or not yet lifted, by agent."""

    @abstractmethod
    def set_gate_wait(self, job_id: str, agent: str, until: float | None) -> None:
        """Record that a claimed job waits for a gate (shown as state ``waiting``)."""

    @abstractmethod
    def clear_gate_wait(self, job_id: str) -> None:
        """Record that a job no longer waits."""

    def spoken_row(self, row: str, job_id: str) -> str:
        """Return a ledger state as an operator reads it (``lifecycle.spoken``), a claimed job held by a gate as
        waiting."""
        if row == Row.CLAIMED and job_id in self.gate_waits():
            return "waiting"
        return spoken(row)

    def spoken_state(self, state: State, job_id: str) -> str:
        """Return the state of a job's folder as `status` and `list` say it: a job in active/ held by a gate is
        waiting (a command's error then names the state the user saw)."""
        if state is State.ACTIVE and job_id in self.gate_waits():
            return "waiting"
        return state.value

    @abstractmethod
    def gate_waits(self) -> dict[str, float | None]:
        """Return the waiting jobs with the time each waits for (None: until a gate is lifted)."""

    @abstractmethod
    def note_spend(self, job_id: str, token: int, cost_usd: float) -> None:
        """Record the cost a running job's attempts have reported so far, counted from now (a daily cap's window).

        Only while the job is claimed under ``token``; its finish records its cost as usual.
        """

    @abstractmethod
    def costs_since(self, since: float) -> list[tuple[float, str, float]]:
        """Return (finished, agent, cost_usd) of the jobs that finished since ``since``, oldest first."""

    # -- concurrency slots (an agent's `concurrency` over every daemon) ------------------
    @abstractmethod
    def take_slot(self, agent: str, concurrency: int) -> int | None:
        """Take a free slot of agent for this daemon; return its number, or None if all are busy."""

    @abstractmethod
    def free_slot(self, agent: str, slot: int) -> None:
        """Give a slot back."""

    def slot_fd(self, agent: str, slot: int) -> int | None:
        """Return a descriptor that holds one of this daemon's slots while open, for its agent to inherit; or None.

        An agent that inherits it keeps its slot taken after its daemon died (``kill -9``), until
        it is ended, so that no daemon starts another copy of it beside it (section 3:
        ``concurrency`` over the whole root). Slots kept in a shared ledger have none.
        """
        return None

    # -- bulk (migrate, rebuild, benchmarks) --------------------------------------------
    @abstractmethod
    def rows(self) -> Iterator[Entry]:
        """Yield every row (for `ledger migrate`)."""

    @abstractmethod
    def extras(self) -> Extras:
        """Return everything beside the rows: open requests, waits, gates, gate waits (for `ledger migrate`)."""

    @abstractmethod
    def load_rows(self, entries: Iterable[Entry]) -> int:
        """Insert rows as they are (migrate, rebuild); return how many were new."""

    @abstractmethod
    def count(self) -> int:
        """Return how many job ids the ledger holds."""

    def is_empty(self) -> bool:
        """Return True if the ledger holds no job id at all."""
        return self.count() == 0


def now() -> float:
    """Return the wall-clock time recorded in rows."""
    return time.time()
