"""The claim phase in one trip to the ledger lane: read new orders, take slots, claim, reload.

The scheduler hands a batch of work to ``Claims.run`` (in the ledger lane): names of
files in inbox/ not read yet, and parked work (orders read earlier, recovered jobs,
retries). For each name the order is read and validated there, off the loop, so a
large order never stalls pickup; a file larger than ``BIG_ORDER_BYTES`` is handed back
(``Big``) to be read in the scan lane, so it never holds up the ledger lane either. Then
concurrency slots are taken (slots handed over by jobs of the same agent that just
ended first), and the orders are claimed in one ledger transaction. Every answer is
data for the loop: ``Launch``, ``NoSlot``, ``Dropped``, ``Gone`` or ``Big``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from dispatcher.core.gatekeeper import gated_agents
from dispatcher.core.work import Answer, Big, Dropped, Gone, Handover, Kind, Later, Launch, NoSlot, Parked
from dispatcher.job import intake, recovery, revise
from dispatcher.job.finish import Finisher
from dispatcher.job.intake import Cancelled, Refused, Waiting
from dispatcher.job.joins import Joins
from dispatcher.layout import Layout
from dispatcher.ledger.base import EVERY_AGENT, Gate, Ledger
from dispatcher.lifecycle import State
from dispatcher.procs import open_for_writing
from dispatcher.shortage import SHORT
from dispatcher.spec.order import Order
from dispatcher.spec.orderchild import APART_YAML_BYTES
from dispatcher.spec.orders import deferred_until, order_format, validate_order
from dispatcher.spec.settings import Agent, Config
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.placing import Pick, Skipped, Started
from dispatcher.store.refusals import Refusal, refuse

log = structlog.get_logger("dispatcher")
RECEIVED_MAX = 4096  # files remembered as received (order.received is logged once per file)
BIG_ORDER_BYTES = 64 * 1024  # orders above this are read in the scan lane, not in the claim's trip
# YAML parses about 20 times slower than JSON even with libyaml: above this, in the scan lane and a child process
BIG_YAML_BYTES = APART_YAML_BYTES


class Claims:
    """The claim phase's blocking step, run in the ledger lane."""

    def __init__(
        self,
        layout: Layout,
        ledger: Ledger,
        config: Callable[[], Config],
        finisher: Finisher,
        on_refused: Callable[[Path, Refusal], None],
        joins: Joins | None = None,
        on_gate: Callable[[Gate], None] | None = None,
    ) -> None:
        self.joins = joins  # a claimed order with `after` becomes a wait there
        # no watch of the control folder (``watch: poll``, or none could start): the hint a `pause` drops is not
        # heard, so the gates are read in each claim's trip, as on a shared ledger
        self.unwatched: Callable[[], bool] = lambda: False
        self.stopping: Callable[[], bool] = lambda: False  # a stop began: no new order is claimed (section 9)
        self.on_gate = on_gate  # a gate the ledger has and the loop's snapshot may not (called from this lane)
        self.layout = layout
        self.ledger = ledger
        self.config = config
        self.finisher = finisher
        self.on_refused = on_refused
        self._known: dict[str, Agent] = dict(config().agents)  # every agent the config has had since the start
        self._others_key: tuple[int, int] | None = None  # .state/daemons/ as last seen (``_others_here``)
        self._others = False
        # files whose order.received is logged: a file read again (its claim put off by a shortage,
        # say) is not received again; the oldest are forgotten past RECEIVED_MAX
        self._received: collections.OrderedDict[tuple[str, object, object], None] = collections.OrderedDict()
        self._notes = 0  # configs note_config took: the answer _removed keeps is for one config and count
        self._removed_for: tuple[Config, int, dict[str, Agent]] | None = None

    def note_config(self, cfg: Config) -> None:
        """Remember the agents of a config just loaded: one a later reload removes is waited for, never refused."""
        self._known.update(cfg.agents)
        self._notes += 1

    def _removed(self, cfg: Config) -> dict[str, Agent]:
        """Return the agents a reload removed (as they were): their orders wait, never refused.

        The answer is kept and given again while the config and the agents known stay the same.
        """
        kept, notes = self._removed_for, self._notes  # the count before _known is read (note_config runs on the loop)
        if kept is not None and kept[0] is cfg and kept[1] == notes:
            return kept[2]
        self._known.update(cfg.agents)
        removed = {name: a for name, a in self._known.items() if name not in cfg.agents}
        self._removed_for = (cfg, notes, removed)
        return removed

    def run(
        self,
        batch: Sequence[Parked | str],
        handover: Handover,
        *,
        blocked: frozenset[str] = frozenset(),
        gated: frozenset[str] = frozenset(),
        slotless: bool = False,
        last: bool = True,
        ahead: dict[str, int] | None = None,
        unsure: frozenset[str] = frozenset(),
    ) -> list[Answer]:
        """Read, take slots, claim (ledger lane); ``slotless`` for a cancel, which takes none.

        ``unsure``: names made ready by a close event alone; one that does not validate is
        not refused here but answered ``Gone(unsure=True)`` (``Inbox.recheck``).

        ``last`` gives back the handed-over slots no job of this batch took, so that
        other daemons may use them. ``ahead``: claim new orders without slots, at most
        so many per agent (``core.ahead``); an order that may not be claimed ahead (another
        agent, ``expires``, ``after``) answers ``NoSlot`` and waits as usual.
        """
        ledger, cfg = self.ledger, self.config()
        removed = self._removed(cfg)
        shared = ledger.leases is not None or self.unwatched() or self._others_here()
        if shared and not slotless and any(_new(work) for work in batch):
            gated = self._gated_now(gated, cfg)
        reading = dataclasses.replace(cfg, agents={**removed, **cfg.agents}) if removed else cfg
        out: list[Answer] = []
        picks: list[tuple[Parked, int | None]] = []
        for work in batch:
            if not slotless and SHORT.short():  # a shortage met in this trip: nothing more is claimed (section 13)
                out.append(not_now(work))
                continue
            if isinstance(work, str):
                p = self.read(work, reading, now=slotless, unsure=work in unsure)
                if not isinstance(p, Parked):
                    out.append(p)
                    continue
                late = None
            else:
                p = work
                late = None if slotless else expiry(p, time.time())
            if late is not None:  # read in time, but no slot or gate let it start before its expires
                if p.item is not None and intake.drop_twin_of(
                    self.layout, p.item.order.job_id, p.item.name, p.item.inode, p.agent
                ):
                    out.append(Dropped(p, refused=False))  # a claim cut short left its job's own file: no refusal
                    continue
                folder = refuse(self.layout, late, ledger.owner, self.on_refused)
                out.append(Dropped(p, refused=folder is not None))
                continue
            joins = p.kind is Kind.NEW and p.item is not None and bool(p.item.order.after)
            if p.kind is Kind.NEW and p.agent in gated and not slotless and not joins:
                out.append(NoSlot(p))  # a gate holds its agent (section 14): it waits unclaimed
                continue  # (a join is claimed at once all the same: it waits in waiting/, section 16)
            if p.kind is Kind.NEW and p.agent in removed and not slotless:
                out.append(NoSlot(p))  # unread until a reload brings it back (the scheduler logs order.waiting)
                continue
            if ahead is not None:
                if _may_claim_ahead(p, ahead):
                    ahead[p.agent] -= 1
                    picks.append((p, None))
                else:
                    out.append(NoSlot(p))
                continue
            agent = cfg.agents.get(p.agent)
            slot = None if slotless or joins else handover.take(p.agent)
            if slot is None and not slotless and not joins:  # a join is claimed at once, without a slot: it waits
                if p.agent in blocked:
                    out.append(NoSlot(p))
                    continue
                try:
                    slot = ledger.take_slot(p.agent, agent.concurrency if agent else 1)
                except OSError as exc:  # a slot's lock file cannot be opened now
                    if not SHORT.note(exc, "slot"):
                        _free(ledger, picks)
                        raise
                if slot is None:
                    out.append(NoSlot(p))
                    continue
            if p.kind is Kind.NEW:
                picks.append((p, slot))
            else:
                out.append(self.reload(p, slot))
        if picks and not slotless and (SHORT.short() or self.stopping()):  # short or stopping since these were read
            for p, slot in picks:
                if slot is not None:
                    ledger.free_slot(p.agent, slot)
                out.append(not_now(p))
            picks = []
        if picks:
            agents = reading.agents
            chosen = [Pick(p.item, agents[p.agent]) for p, _ in picks if p.item is not None]
            try:
                answers = intake.claim(self.layout, ledger, chosen, on_refused=self.on_refused, finisher=self.finisher)
            except Exception:
                _free(ledger, picks)
                raise
            for (p, slot), answer in zip(picks, answers, strict=True):
                if isinstance(answer, Started) and not answer.cancelled:
                    out.append(Launch(p, answer.folder, answer.spec, answer.order, answer.token, slot))
                    continue
                if slot is not None:
                    ledger.free_slot(p.agent, slot)
                if isinstance(answer, Waiting) and self.joins is not None:
                    self.joins.record(answer.job_id, answer.token)
                later = isinstance(answer, Skipped) and answer.retry_later
                cancelled = isinstance(answer, Cancelled)
                out.append(Dropped(p, refused=isinstance(answer, Refused), retry_later=later, cancelled=cancelled))
        if last:
            for name, slots in handover.slots.items():
                for kept in slots:
                    ledger.free_slot(name, kept)
            handover.slots.clear()
        return out

    def _others_here(self) -> bool:
        """Return True if other daemons run on this root's SQLite ledger: they may set gates this one's snapshot lacks.

        Asked again only once ``.state/daemons/`` changed (one stat a claim otherwise).
        """
        try:
            st = os.stat(self.layout.daemons)
        except OSError:
            return False
        key = (st.st_ino, st.st_mtime_ns)
        if self._others_key != key:
            self._others_key = key
            self._others = any(d.alive and d.owner != self.ledger.owner for d in self.ledger.daemons())
        return self._others

    def _gated_now(self, gated: frozenset[str], cfg: Config) -> frozenset[str]:
        """Return the agents gated now as the shared ledger has it, beside the loop's snapshot (``gated``).

        On a ledger other hosts share, a `pause` made there reaches this daemon's snapshot
        only at its next refresh (up to a second, more with ``watch: poll``); read here, in
        the trip that would claim the order, no order of an agent paused a moment ago on
        any host is claimed. A gate the snapshot lacks is handed to the loop (``on_gate``).
        """
        now = time.time()
        gates = self.ledger.gates()
        fresh = frozenset(gated_agents(gates, cfg.agents, now))
        missing = fresh - gated
        if missing and self.on_gate is not None:
            for gate in gates:
                if (gate.until is None or gate.until > now) and (gate.agent == EVERY_AGENT or gate.agent in missing):
                    self.on_gate(gate)
        return gated | fresh

    def read(self, name: str, cfg: Config, *, now: bool = False, unsure: bool = False) -> Parked | Gone | Big | Later:
        """Read and validate inbox/<name>: parked work, a refusal carried out, or a name to drop.

        An order whose not_before is to come is ``Later`` (``now``, for a cancel: taken all
        the same); one past its expires is refused as ``expired``. ``unsure``: the file was
        made ready by a close event alone, so it may be half written by another writer: one
        that a process still holds open for writing, or that is invalid, is answered
        ``Gone(unsure=True)`` (it waits for its writers), neither read nor refused.
        """
        path = f"{self.layout.inbox_str}/{name}"
        if unsure and open_for_writing(path):  # one writer closed it, another still writes it (section 1): it waits
            return Gone(name, unsure=True)
        st = _lstat(path)
        if st is not None and (
            st.st_size > BIG_ORDER_BYTES or (st.st_size > BIG_YAML_BYTES and order_format(name) == "yaml")
        ):
            return Big(name)
        try:
            found = intake.inspect(self.layout, name, cfg, seen=st, path=path)  # its lstat is not taken twice
            if isinstance(found, Refusal):
                if unsure:
                    return Gone(name, unsure=True)
                seen = (st.st_dev, st.st_ino) if st is not None else None
                job_id = found.job_id
                if job_id is None and st is not None and st.st_nlink > 1:  # a claim's link, perhaps: whose is it?
                    job_id = intake.job_id_in_file(path, name)
                if intake.drop_twin_of(self.layout, job_id, name, seen, found.agent):
                    return Gone(name)  # a claim cut short left its job's own file, which a rule changed since refuses
                if self._first_sight((name, seen, found.reason)):  # once a file, however often its refusal is tried
                    log.info("order.received", agent=found.agent, file=name, job_id=found.job_id)
                folder = refuse(self.layout, found, self.ledger.owner, self.on_refused)
                return Gone(name, refused=folder is not None)
        except OSError as exc:
            if not SHORT.note(exc, "read"):
                intake.cannot_take(name, "read", exc)  # this one file: the others of the trip go on
            return Gone(name, later=True)  # the file stays in inbox/: read again after the pause
        if found is None:
            return Gone(name)
        timing = when(found.order, name, now=now)
        if isinstance(timing, Later):
            return timing
        if self._first_sight((name, found.inode, found.digest)):
            log.info("order.received", agent=found.order.to, file=name, job_id=found.order.job_id)
        if timing is not None:
            if intake.drop_twin_of(self.layout, found.order.job_id, name, found.inode, found.order.to):
                return Gone(name)  # a claim cut short left its job's own file, expired by now: no refusal
            folder = refuse(self.layout, timing, self.ledger.owner, self.on_refused)
            return Gone(name, refused=folder is not None)
        return Parked(Kind.NEW, found.order.job_id, found.order.to, found, expires=found.order.expires)

    def _first_sight(self, key: tuple[str, object, object]) -> bool:
        """Return True the first time a file (by name and what identifies its content) is read: its order.received."""
        if key in self._received:
            self._received.move_to_end(key)
            return False
        self._received[key] = None
        if len(self._received) > RECEIVED_MAX:
            self._received.popitem(last=False)
        return True

    def reload(self, p: Parked, slot: int | None) -> Launch | NoSlot | Dropped:
        """Load a recovered job, or reopen a failed one for a retry (ledger lane)."""
        layout, ledger = self.layout, self.ledger
        if p.resume is not None:  # queued again after a shortage: nothing to read again
            r = p.resume
            return Launch(p, r.folder, r.spec, r.order, p.token, slot, list(r.attempts))
        try:
            if p.kind in (Kind.RETRY, Kind.REVISE):
                reopen = revise.reopen if p.kind is Kind.REVISE else recovery.reopen
                reopened = reopen(layout, ledger, self.config(), p.job_id)
                if reopened is None:
                    raise LookupError("taken by another daemon")
                spec, token = reopened
                log.info("job.claimed", job_id=p.job_id, agent=spec.agent.name, retry=True, budget=spec.budget)
                if spec.order.get("after") and self.joins is not None:  # a retried join waits again
                    if slot is not None:
                        ledger.free_slot(p.agent, slot)
                    self.joins.rewait(p.job_id, token)
                    return Dropped(p)
            else:
                spec, token = JobFolder(layout.job(State.ACTIVE, p.job_id)).spec(), p.token
            folder = JobFolder(layout.job(State.ACTIVE, p.job_id))
            return Launch(p, folder, spec, validate_order(dict(spec.order)), token, slot, folder.attempts())
        except Exception as exc:
            if slot is not None:
                ledger.free_slot(p.agent, slot)
            if SHORT.note(exc, p.kind.value):
                return NoSlot(p)  # not now: it stays queued
            if not isinstance(exc, LookupError):
                if p.kind is Kind.RECOVER:  # a folder it cannot read back: the job fails, saying why
                    recovery.fail_damaged(layout, ledger, self.finisher, p.job_id, p.token, exc, agent=p.agent)
                else:
                    log.exception("daemon.error", job_id=p.job_id, agent=p.agent, step=p.kind.value, error=str(exc))
            return Dropped(p)


def _new(work: Parked | str) -> bool:
    """Return True for work that would be a new claim: a name in inbox/, or an order read and not claimed."""
    return isinstance(work, str) or work.kind is Kind.NEW


def not_now(work: Parked | str) -> Dropped | NoSlot | Gone:
    """Answer work left unclaimed for now (a shortage, a failed trip): a file is read again, a job stays queued."""
    if isinstance(work, str):
        return Gone(work, later=True)
    return Dropped(work, retry_later=True) if work.kind is Kind.NEW else NoSlot(work)


def when(order: Order, name: str = "", *, now: bool = False) -> Later | Refusal | None:
    """Return ``Later`` for an order not due yet, a Refusal (``expired``) for one past its expires, else None."""
    t = time.time()
    if order.expires is not None and order.expires <= t:  # expired before it was due, too: refused at its expires
        return Refusal(name, "expired", order.job_id, agent=order.to)
    if not now and (until := deferred_until(order.not_before, order.expires, t)) is not None:
        return Later(name, until, order.priority)
    return None


def expiry(p: Parked, at: float) -> Refusal | None:
    """Return the ``expired`` refusal of a parked new order whose expires has come by ``at``, else None."""
    if p.kind is not Kind.NEW or p.item is None:
        return None
    order = p.item.order
    if order.expires is None or order.expires > at:
        return None
    return Refusal(p.item.name, "expired", order.job_id, agent=order.to, inode=p.item.inode)


def claimable_ahead(p: Parked) -> bool:
    """Return True if p is an order that may be claimed before its agent has a free slot (``core.ahead``).

    Never one with ``expires`` (refused, not failed, if it does not start in time) or ``after``.
    """
    order = p.item.order if p.kind is Kind.NEW and p.item is not None else None
    return order is not None and order.expires is None and not order.after


def _may_claim_ahead(p: Parked, ahead: dict[str, int]) -> bool:
    """Return True if p may be claimed ahead now: its kind, and room left for its agent in this batch."""
    return claimable_ahead(p) and ahead.get(p.agent, 0) > 0


def _free(ledger: Ledger, picks: list[tuple[Parked, int | None]]) -> None:
    """Give back the slots taken for a batch whose claim failed (ledger lane)."""
    for p, slot in picks:
        if slot is not None:
            ledger.free_slot(p.agent, slot)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None
