"""Jobs that wait for others (``after``, contract section 16): when to run them, and how.

A job whose order names ``after`` is claimed at once, put in ``waiting/<job_id>/``
and its claim turned into a wait in the ledger (no owner: no daemon holds it,
no thread or timer waits for it). It is looked at again only when something
may have changed:

- a job finished: the Finisher's commit hands the ids to ``on_final``, and the
  ledger answers which waiting jobs name them;
- a join was just recorded (its parents may be final already);
- the periodic sweep (``sweep``, every rescan) catches what no hook saw: a
  parent approved or rejected by a command, a ``max_wait`` running out.

A ready join is *taken* in one conditional ledger step (of two daemons, on one
host or two, exactly one wins), then ``work/parents.json`` is written and the
folder renamed into active/, and the scheduler runs it like any claimed job. A
join that must fail (a parent failed under ``all_done``, a parent never known
within ``max_wait``, a cancel) is taken the same way and finished from
waiting/. Every step here blocks and runs in the ledger lane.

Crashes: a wait recorded in the ledger with no folder in waiting/ cannot
happen (the folder is placed first). A claimed row of a dead daemon whose
folder is in waiting/ is either a wait never recorded (no ``waits`` rows:
recorded now) or a join taken but not moved (taken again by ``recover`` and
decided again; the parents' states are final, so the answer is the same).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog

from dispatcher import faults, fsutil
from dispatcher.job.finish import Finisher
from dispatcher.layout import Layout
from dispatcher.ledger.base import Entry, Finish, Ledger, Request, Wait
from dispatcher.ledger.cycles import find_cycle
from dispatcher.lifecycle import Row, State, Stop
from dispatcher.spec.orders import parse_time
from dispatcher.spec.settings import Config
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.queued import find_queued
from dispatcher.store.results import build_result

log = structlog.get_logger("dispatcher")
PARENTS = "parents.json"
_EXPIRY_MAX = 100_000  # waiting joins whose `expires` is remembered; past it, read again
ALL_DONE, ALL_FINAL = "all_done", "all_final"

# (job_id, token, agent, rank, expires): a join moved to active/, to be run; rank (-priority, received) orders it
# among orders; expires (epoch seconds, or None): when it fails `expired` if it has not started by then
Joined = tuple[str, int, str, tuple[int, float], float | None]
Ready = Callable[[list[Joined]], None]  # joins moved to active/, best rank first


@dataclass(frozen=True, slots=True)
class Verdict:
    """What becomes of a waiting job now: run it, fail it (``reason``), or go on waiting (neither)."""

    run: bool = False
    reason: str | None = None


WAIT = Verdict()


def decide(
    wait: Wait, parents: Mapping[str, Entry], now: float, max_wait_s: float, queued: Collection[str] = ()
) -> Verdict:
    """Return the verdict for one wait, given the ledger rows of its parents (absent: unknown).

    ``queued``: parents without a row whose order waits in inbox/ or held/. They are known, not
    yet claimed: the join goes on waiting for them past ``max_wait``.
    """
    if wait.rule != ALL_FINAL:
        for job_id in wait.after:
            entry = parents.get(job_id)
            if entry is not None and entry.state == Row.FAILED:
                return Verdict(reason=f"after: {job_id} failed")
    pending = False
    for job_id in wait.after:
        entry = parents.get(job_id)
        if entry is None:
            if now - wait.since >= max_wait_s and job_id not in queued:
                return Verdict(reason=f"after: {job_id} never finished")
            pending = True
        elif entry.state not in (Row.DONE, Row.FAILED):
            pending = True
    return WAIT if pending else Verdict(run=True)


def parents_record(layout: Layout, ledger: Ledger, after: Iterable[str]) -> list[dict[str, Any]]:
    """Return work/parents.json's records: each parent's id, state, folder and result.json path."""
    ids = list(after)
    rows = ledger.known(ids)
    out = []
    for job_id in ids:
        found = layout.find(job_id)
        result = found[1] / "result.json" if found is not None else None
        entry = rows.get(job_id)
        out.append(
            {
                "job_id": job_id,
                "state": entry.state if entry is not None else None,
                "path": str(found[1]) if found is not None else None,
                "result": str(result) if result is not None and result.exists() else None,
            }
        )
    return out


def _as_ordered(named: object, parents: Iterable[str]) -> list[str]:
    """Return the parents in the order the order's ``after`` names them (once each), as `show` and `list` do."""
    wanted = set(parents)
    if not isinstance(named, list):
        return sorted(wanted)
    ordered = list(dict.fromkeys(p for p in named if isinstance(p, str) and p in wanted))
    return ordered + sorted(wanted - set(ordered))


class Joins:
    """Record, wake, take and recover the waiting jobs of one daemon (blocking: the ledger lane)."""

    def __init__(self, layout: Layout, ledger: Ledger, finisher: Finisher, config: Callable[[], Config]) -> None:
        self.layout = layout
        self.ledger = ledger
        self.finisher = finisher
        self.config = config
        self.ready: Ready | None = None  # set by the daemon: parks joins moved to active/
        self._joined: list[Joined] = []  # moved, not yet handed over (``_hand_over``)
        self.failed: Callable[[], None] | None = None  # set by the daemon: counts a failed join, on the loop
        # when the first wait still short of max_wait reaches it (wall clock; None: no such wait). Set
        # here, read by the loop, which sweeps then: a wait fails at max_wait, not at the next rescan
        self.due: float | None = None
        self._expiry: dict[str, float | None] = {}  # waiting joins' `expires` (``_expires``), read once a job
        # the parents the joins seen waiting here wait for: such a job keeps its slot until it ends (``awaits``)
        self.awaited: frozenset[str] = frozenset()

    def awaits(self, job_id: str) -> bool:
        """Return True if a join seen waiting here waits for job_id (read on the loop): its end readies the join,
        which then takes its place among the orders waiting for that job's slot by priority (section 16)."""
        return job_id in self.awaited

    def on_final(self, job_ids: Sequence[str]) -> None:
        """The Finisher's hook: jobs reached done or failed; look at the joins that name them."""
        if job_ids:
            waiting = self.ledger.waiting_on(job_ids)
            if waiting:
                self.check(self.ledger.waits(waiting))

    def sweep(self) -> None:
        """Look at every waiting job (the periodic backstop, and each time ``due`` comes)."""
        self.due = None
        waits = self.ledger.waits()
        self.awaited = frozenset(p for w in waits for p in w.after)  # anew: the parents ended meanwhile drop out
        self.check(waits)

    def check(self, waits: Iterable[Wait]) -> None:
        """Decide each wait; take and run or fail those whose verdict is in."""
        try:
            self._check(waits)
        finally:
            self._hand_over()

    def _check(self, waits: Iterable[Wait]) -> None:
        now = time.time()
        max_wait = self.config().max_wait_s
        for wait in waits:
            verdict = self._decide(wait, now, max_wait)
            if verdict is WAIT and (expires := self._expires(wait.job_id)) is not None:
                if expires <= now:  # not started by its `expires`: it fails at that time, not when its wait ends
                    verdict = Verdict(reason="expired")
                elif self.due is None or expires < self.due:
                    self.due = expires
            if verdict is WAIT:
                if not self.awaited.issuperset(wait.after):
                    self.awaited |= frozenset(wait.after)
                if (ends := wait.since + max_wait) > now and (self.due is None or ends < self.due):
                    self.due = ends  # a wait past max_wait that still waits (its parent queued): the rescan's
                continue
            if wait.job_id in self.ledger.requests(Request.CANCEL):  # an open cancel wins (cancel --tree)
                verdict = Verdict(reason=str(Stop.CANCELLED))
            token = self.ledger.take_waiting(wait.job_id)
            self._expiry.pop(wait.job_id, None)  # its wait ends: a retry that waits again is read afresh
            if token is not None:  # another daemon took it first otherwise
                faults.point("join.taken")
                self._carry_out(wait, token, verdict)

    def _hand_over(self) -> None:
        """Park the joins moved to active/ in one hand-over, by priority then age (section 16): joins whose
        parents ended together must not start in the order the ledger listed them, the first before the
        others are queued."""
        joined, self._joined = self._joined, []
        if joined and self.ready is not None:
            self.ready(sorted(joined, key=lambda j: j[3]))

    def _expires(self, job_id: str) -> float | None:
        """Return when a waiting join that never ran expires (its order's `expires`), or None; read once a job."""
        if job_id not in self._expiry:
            folder = JobFolder(self.layout.job(State.WAITING, job_id))
            try:
                raw = folder.spec().order.get("expires")
                at = parse_time(raw) if isinstance(raw, str) and not folder.attempt_numbers() else None
            except (OSError, ValueError):
                at = None  # unreadable here: its wait decides, as before
            if len(self._expiry) >= _EXPIRY_MAX:
                self._expiry.clear()
            self._expiry[job_id] = at
        return self._expiry[job_id]

    def _decide(self, wait: Wait, now: float, max_wait_s: float) -> Verdict:
        """Decide one wait; a parent given up as never finished is looked for in inbox/ and held/ first."""
        parents = self.ledger.known(wait.after)
        verdict = decide(wait, parents, now, max_wait_s)
        if verdict is WAIT and now - wait.since >= max_wait_s:
            return self._released_gone(wait, parents)
        if verdict.reason is not None and verdict.reason.endswith(" never finished"):
            unknown = [j for j in wait.after if j not in parents]
            queued = self._queued(unknown)
            if len(queued) < len(unknown):
                # one in neither folder may have been claimed since its row was looked for: a claim writes its
                # row before the inbox name goes, so the ledger is asked again
                parents = {**parents, **self.ledger.known([j for j in unknown if j not in queued])}
            verdict = decide(wait, parents, now, max_wait_s, queued)
        if verdict.run and any(os.path.isdir(self.layout.job(State.ACTIVE, j)) for j in wait.after):
            return WAIT  # a parent's end is recorded, its folder not moved yet (its daemon died between): its path
            # and result.json in parents.json must be where it lands
        return verdict

    def _queued(self, ids: list[str]) -> set[str]:
        """Return the ids among these whose order waits in inbox/ or held/.

        inbox/ is looked at again for the rest: a `release` moving an order from held/ into inbox/ between the
        two looks is seen there (a `hold` links into held/ before the inbox name goes: the first two see it).
        """
        found = {*find_queued(self.layout.inbox, ids), *find_queued(self.layout.held, ids)}
        rest = [j for j in ids if j not in found]
        return found | set(find_queued(self.layout.inbox, rest)) if rest else found

    def _released_gone(self, wait: Wait, parents: Mapping[str, Entry]) -> Verdict:
        """Past max_wait, a parent released as a follow-up whose order is in neither inbox/ nor held/ never
        finishes (its file was refused, say as expired, or removed): the join fails, as for an unknown one."""
        released = [j for j in wait.after if j in parents and parents[j].state in (Row.RELEASED, Row.HELD)]
        if not released:
            return WAIT
        queued = self._queued(released)
        gone = [j for j in released if j not in queued]
        if gone:  # claimed since the rows were read (the inbox name goes after the claim's row): not gone
            now_rows = self.ledger.known(gone)
            gone = [j for j in gone if j not in now_rows or now_rows[j].state in (Row.RELEASED, Row.HELD)]
        return Verdict(reason=f"after: {gone[0]} never finished") if gone else WAIT

    def cancel(self, job_id: str) -> bool:
        """Fail a waiting job with reason ``cancelled``; False if it is not waiting (any more)."""
        token = self.ledger.take_waiting(job_id)
        if token is None:
            return False
        waits = self.ledger.waits([job_id])
        wait = waits[0] if waits else Wait(job_id, (), ALL_DONE, time.time())
        self._carry_out(wait, token, Verdict(reason=str(Stop.CANCELLED)))
        return True

    def _put_back(self, job_id: str) -> bool:
        """Put back the claim row of a join in waiting/ its ledger lost; False if its folder cannot be read."""
        try:
            spec = JobFolder(self.layout.job(State.WAITING, job_id)).spec()
        except (OSError, ValueError):
            return False
        if self.ledger.reconcile(job_id, spec.agent.name, spec.parent, spec.hops):
            why = "waiting job without a claim row"
            log.warning("ledger.repaired", job_id=job_id, agent=spec.agent.name, reason=why)
        return True

    def recover(self, alive: Callable[[str], bool]) -> None:
        """Make whole what a dead daemon left in waiting/: an unrecorded wait, a take cut short, a landing."""
        try:
            names = sorted(n for n in os.listdir(self.layout.folder(State.WAITING)) if not n.startswith("."))
        except FileNotFoundError:
            return
        for job_id in names:
            entry = self.ledger.get(job_id)
            if entry is not None and entry.state == Row.WAITING and not self.ledger.waits([job_id]):
                # a wait without its ids: a PostgreSQL ledger filled by an earlier `ledger migrate`, which did
                # not copy waits; recorded again from the order in waiting/
                token = self.ledger.take_waiting(job_id)
                if token is not None:
                    self.record(job_id, token)
                continue
            if entry is None or entry.state in (Row.RESERVED, Row.RELEASED):
                # a folder in waiting/ the ledger lost (a power cut before its claim's commit was durable): its
                # claim is put back, then adopted and its wait recorded from its order, as for a claim cut short
                if not self._put_back(job_id):
                    continue
                entry = self.ledger.get(job_id)
                if entry is None:
                    continue
            if entry.state == Row.WAITING:
                continue
            if entry.state in (Row.DONE, Row.FAILED):  # its landing was cut short
                folder = JobFolder(self.layout.job(State.WAITING, job_id))
                state = State.DONE if entry.state == Row.DONE else State.FAILED
                with contextlib.suppress(FileNotFoundError):  # landed meanwhile by another daemon on this root
                    folder.land(self.layout, state)
                    fsutil.fsync_dir(self.layout.folder(state))
                continue
            if entry.state != Row.CLAIMED or (entry.owner is not None and alive(entry.owner)):  # None: rebuilt
                continue
            token = self.ledger.adopt(job_id, entry.owner, entry.token)
            if token is None:
                continue
            waits = self.ledger.waits([job_id])
            if not waits:  # the claim was never turned into a wait
                self.record(job_id, token)
                continue
            wait = waits[0]
            cancelled = job_id in self.ledger.requests(Request.CANCEL)
            verdict = (
                Verdict(reason=str(Stop.CANCELLED))
                if cancelled
                else self._decide(wait, time.time(), self.config().max_wait_s)
            )
            if verdict is WAIT:  # cannot be (it was taken because it was over): wait again
                self.ledger.wait(job_id, token, wait.after, wait.rule)
                continue
            log.info("job.recovered", job_id=job_id, agent=entry.agent, step="join")
            self._carry_out(wait, token, verdict)
        self._hand_over()

    def record(self, job_id: str, token: int) -> bool:
        """Turn a fresh claim of a job in waiting/ into a wait, then decide it at once."""
        faults.point("join.claimed")
        spec = JobFolder(self.layout.job(State.WAITING, job_id)).spec()
        after = tuple(spec.order.get("after") or ())
        rule = str(spec.order.get("after_rule") or ALL_DONE)
        if not self.ledger.wait(job_id, token, after, rule):
            return False
        log.info("job.waiting", job_id=job_id, agent=spec.agent.name, after=list(after), rule=rule)
        waits = self.ledger.waits([job_id])
        # the claim looked for a cycle before this wait was recorded: another daemon may have claimed the other
        # half of one meanwhile, each claim blind to the other's wait. Looked for again now, the later one sees it
        cycle = find_cycle(self.ledger, job_id, after) if after else None
        if cycle is not None and waits and (taken := self.ledger.take_waiting(job_id)) is not None:
            self._carry_out(waits[0], taken, Verdict(reason="after: would make a cycle (" + " -> ".join(cycle) + ")"))
            return True
        self.check(waits)  # a parent may have finished before the wait was recorded
        return True

    def rewait(self, job_id: str, token: int) -> None:
        """Put a retried join (reopened into active/ by ``retry``) back in waiting/; it waits for its parents again."""
        fsutil.rename_into(self.layout.job(State.ACTIVE, job_id), self.layout.job(State.WAITING, job_id))
        fsutil.fsync_dir(self.layout.folder(State.WAITING))
        self.record(job_id, token)

    def _carry_out(self, wait: Wait, token: int, verdict: Verdict) -> None:
        folder = JobFolder(self.layout.job(State.WAITING, wait.job_id))
        spec = folder.spec()
        expires = spec.order.get("expires")
        never_ran = not folder.attempt_numbers()  # a retried job keeps its earlier result in attempts/0/
        if verdict.run and never_ran and isinstance(expires, str) and parse_time(expires) <= time.time():
            verdict = Verdict(reason="expired")  # not started by then
        if verdict.reason is not None:
            result = build_result(
                job_id=spec.job_id,
                state=str(Row.FAILED),
                agent=spec.agent.name,
                reason=verdict.reason,
                received=spec.received,
                parent=spec.parent,
                chain_cost_usd=spec.parent_chain_cost_usd,
                user_checks=[c.name for c in spec.agent.checks],
            )
            finish = Finish(spec.job_id, token, Row.FAILED, None, spec.parent_chain_cost_usd)
            self.finisher.finish_now(folder, finish, result, spec, self.failed)  # spec: its after hook is owed too
            return
        after = _as_ordered(spec.order.get("after"), wait.after)
        data = fsutil.dump_json(parents_record(self.layout, self.ledger, after))
        # its bytes and its name durable before the job moves: a given file, which writes_scope checks
        # its temporary file outside work/: a crash before the rename leaves nothing there that writes_scope judges
        tmp = folder.path / f".{PARENTS}.{os.getpid()}.tmp"
        fsutil.write_in_place(tmp, data, sync=True)
        faults.point("join.parents")
        os.rename(tmp, folder.work / PARENTS)
        for stale in folder.work.glob(f".{PARENTS}.*.tmp"):  # where an older version's crash left its own
            stale.unlink(missing_ok=True)
        fsutil.fsync_dir(folder.work)
        folder.write_spec(replace(spec.with_given(PARENTS, fsutil.digest(data)), since=time.time()), sync=True)
        fsutil.rename_into(folder.path, self.layout.job(State.ACTIVE, wait.job_id))
        fsutil.fsync_dir(self.layout.folder(State.ACTIVE))
        faults.point("join.moved")
        log.info("job.joined", job_id=wait.job_id, agent=spec.agent.name, after=after)
        priority = spec.order.get("priority", 5)
        rank = (-priority if isinstance(priority, int) else -5, spec.received)
        expires = spec.order.get("expires")
        at = parse_time(expires) if isinstance(expires, str) and not folder.attempt_numbers() else None
        self._joined.append((wait.job_id, token, spec.agent.name, rank, at))
