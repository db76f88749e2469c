"""The one owner of a job's finish: stage, commit with the token, land, fsync, log, count, release.

A job hands its result to ``Finisher.finish`` and learns whether it landed
(``False``: another daemon holds the claim now, and nothing was changed outside
this daemon's staging names). The steps, each safe to interrupt (README,
"Guarantees"):

1. in the ledger lane, for every job that finished in the same turn at once
   (``GroupCommit``), the result is staged in the job folder (written and fsynced
   under a staging name);
2. the ledger records their ends in one transaction, each conditional on its claim's token;
3. then each landed job's staged result is put in place, its folder moved to done/, failed/
   or review/, each target folder fsynced once per batch, and only then is the job logged
   (``job.done``, ``job.failed``, ``job.review``) and counted: whoever reads the line finds
   its result.json in place;
4. a failed or review job is notified; a done job's follow-ups are released into inbox/
   (each new file is a hint to the inbox, which wakes the loop).

The daemon is not on this path: it builds one Finisher at start and hands it to
every job and to recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import structlog

from dispatcher import faults, fsutil
from dispatcher.clock import parse_iso
from dispatcher.errors import oneline
from dispatcher.finished import FinishedCounts
from dispatcher.job.followups import release_followups
from dispatcher.lanes import GroupCommit, Handoff, Lanes
from dispatcher.layout import Layout
from dispatcher.ledger.base import Entry, Finish, Ledger
from dispatcher.lifecycle import Row, State, landed_state, notified_event
from dispatcher.shortage import PAUSE_MIN_S, SHORT
from dispatcher.spec.jobspec import JobSpec, is_cost
from dispatcher.spec.result import Result
from dispatcher.spec.settings import Config
from dispatcher.store.jobstore import JobFolder
from dispatcher.text import usd

if TYPE_CHECKING:
    from dispatcher.metrics import Metrics  # prometheus_client is imported only when metrics_file is set

log = structlog.get_logger("dispatcher")
S = TypeVar("S")


class Notify(Protocol):
    """Where notifications go (``core.notify.Notifications``): never blocks, never fails the job."""

    def fire(self, event: str, job_id: str | None, agent: str | None, reason: str | None, result: Path | None) -> None:
        """Queue the notify command for one event."""


class AfterHooks(Protocol):
    """Where the ``after`` hook of a job finished without a Job goes (``repowork.FinalHooks``), on the loop."""

    def start(self, spec: JobSpec, state: Row) -> None:
        """Run the job's after hook in the background (nothing when its agent has none)."""

    def own(self, spec: JobSpec) -> bool:
        """Write the job's after marker, held, before its finish is committed (blocking); False when it has no hook."""

    def let_go(self, job_id: str) -> None:
        """Give up the held marker of a job whose finish was not committed (or whose hook will not start)."""


class Hints(Protocol):
    """Where a released follow-up's file name goes (``core.watcher.Inbox``), on the loop."""

    def hint(self, kind: str, name: str) -> None:
        """Note a file that appeared in inbox/."""


@dataclass(frozen=True, slots=True)
class Landing:
    """One job's finish, as the ledger lane commits it (``staged``: its result is on disk already)."""

    folder: JobFolder
    finish: Finish
    result: Result
    staged: bool = False


def this_claim(folder: JobFolder, result: Result) -> tuple[float | None, float | None]:
    """Return the seconds and the cost of the job since it was last claimed: what the metrics count.

    A job that `dispatcher retry` or `revise` reopened keeps its earlier attempts, whose
    cost was counted when it finished before, and the time it then sat in failed/ or
    review/ is no work: only attempts after the last one that keeps that earlier
    ``result.json`` (``attempts/0/`` for a job that ended before any attempt) count, from the
    start of the first of them. A kept result of a job
    that entered review/ was never counted (review is not a finish): its attempts count.
    """
    duration = result.duration_s
    if folder.claimed is not None:  # claim to finish, not the time the order waited in inbox/ or held/
        with contextlib.suppress(TypeError, ValueError):
            duration = round(parse_iso(result.finished or "") - folder.claimed, 3)
    numbers = sorted((a["n"] for a in result.attempts if isinstance(a.get("n"), int)), reverse=True)
    numbers.append(0)  # attempts/0/: the result kept of a job that ended before any attempt (cancelled, a join)
    kept = next((n for n in numbers if _kept_state(folder, n) not in (None, "review")), None)
    if kept is None:
        return duration, result.cost_usd
    mine = [a for a in result.attempts if isinstance(a.get("n"), int) and a["n"] > kept]
    costs = [a["cost_usd"] for a in mine if is_cost(a.get("cost_usd")) and a["cost_usd"] > 0]
    try:
        duration = round(parse_iso(result.finished or "") - min(parse_iso(a["started"]) for a in mine), 3)
    except (KeyError, TypeError, ValueError):  # no attempt since: the reopened job ended without one
        duration = None
    return duration, sum(costs) if costs else None


def _kept_state(folder: JobFolder, n: int) -> str | None:
    """Return the state of the earlier result attempts/<n>/ keeps (None: it keeps none; unreadable: done)."""
    try:
        names = sorted(p for p in os.listdir(folder.attempts_dir / str(n)) if p.startswith("result"))
    except OSError:
        return None
    if not names:
        return None
    try:
        state = json.loads((folder.attempts_dir / str(n) / names[-1]).read_bytes()).get("state")
    except (OSError, ValueError, AttributeError):
        return "done"  # counted, as far as anyone can tell: never twice
    return state if isinstance(state, str) else "done"


class Finisher:
    """Finish jobs: the sequence above, batched per turn, for every job of one daemon."""

    def __init__(
        self,
        layout: Layout,
        ledger: Ledger,
        lanes: Lanes,
        config: Callable[[], Config],
        *,
        notify: Notify | None = None,
        hints: Hints | None = None,
        metrics: Metrics | None = None,
        after_hooks: AfterHooks | None = None,
    ) -> None:
        self.layout = layout
        self.ledger = ledger
        self.lanes = lanes
        self.config = config
        self.notify = notify
        self.hints = hints
        self.metrics = metrics
        self.finished = FinishedCounts()  # since this daemon started, metrics file or not
        self.after_hooks = after_hooks
        self._commit: GroupCommit[Landing, bool | OSError] = GroupCommit(lanes, self.commit)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: ends ``after_commit`` must not notify: commit queued it, or could not move the job (job.stuck),
        #: in which case whoever lands it notifies
        self._told: set[str] = set()
        #: called (ledger lane) with the ids that just reached done or failed: wakes the joins that name them
        self.on_final: Callable[[Sequence[str]], None] | None = None
        #: True once a stop began (the daemon's): a wait for a shortage's end gives up then
        self.stopping: Callable[[], bool] = lambda: False

    async def finish(self, folder: JobFolder, finish: Finish, result: Result, *, release: bool) -> bool:
        """Steps 1 to 4: stage, commit, land, then notify or release; False when fenced.

        Raises the OSError that kept the result from being staged (a full disk: the job
        waits and calls again). ``release`` False says the job surely has no follow-ups
        (no trip to the ledger for them).
        """
        return await self._land(Landing(folder, finish, result), release=release)

    async def land(self, folder: JobFolder, finish: Finish, result: Result, *, release: bool) -> bool:
        """Steps 2 to 4 for a result already staged or in place (a landing cut short by a crash)."""
        return await self._land(Landing(folder, finish, result, staged=True), release=release)

    def handoff(
        self, folder: JobFolder, finish: Finish, result: Result, wrap: Callable[[bool | OSError], S]
    ) -> Handoff[S]:
        """Steps 2 and 3 for a result the io pool just staged, from there: its caller gets wrap(answer).

        The post-exit trip (``job.settle``) returns this, so that a job ending in it
        makes one trip off the loop; the job then calls ``after_commit`` with the answer.
        """
        return self._commit.handoff(Landing(folder, finish, result, staged=True), wrap)

    async def _land(self, landing: Landing, *, release: bool) -> bool:
        ok = await self._commit.submit(landing)
        return await self.after_commit(landing.finish, landing.result, ok, release=release)

    async def after_commit(self, finish: Finish, result: Result, ok: bool | OSError, *, release: bool) -> bool:
        """Step 4 on the loop once the ledger answered: notify, release follow-ups; False when fenced."""
        self._loop = asyncio.get_running_loop()
        if isinstance(ok, OSError):
            raise ok
        if not ok:
            log.warning("job.fenced", step="finish")
            return False
        state = finish.state
        told = finish.job_id in self._told
        event = notified_event(state)
        if event is not None and self.notify is not None and not told:
            target = self.layout.job(landed_state(state), finish.job_id) / "result.json"
            self.notify.fire(event, finish.job_id, result.agent or "", result.reason, target)
        self._told.discard(finish.job_id)
        if state == Row.DONE and release:
            await self._release_waiting(finish.job_id)
        return True

    def landed_for_the_dead(self, job_id: str, state: State, folder: JobFolder, result: Result | None) -> None:
        """Count and notify a job whose end a dead daemon recorded and this daemon landed (on the loop).

        The dead daemon died before its move, so it counted and notified nothing; its end line
        ``recovery`` logged as it landed it.
        """
        if result is None:
            return
        self._count_end(result, state, this_claim(folder, result) if self.metrics is not None else None)
        event = notified_event(state)
        if event is not None and self.notify is not None:
            self.notify.fire(event, job_id, result.agent or "", result.reason, folder.path / "result.json")

    async def _release_waiting(self, job_id: str) -> None:
        """Release a done job's follow-ups; a shortage is waited out (section 13), never the job's answer.

        The job is committed done already, so its finish is never tried again: the release is
        (it picks up where it stopped). A stop ends the wait; the next start finishes the release.
        """
        while True:
            try:
                await self.lanes.io(self.release, job_id)
                return
            except (OSError, MemoryError) as exc:
                if self.stopping() or not SHORT.note(exc, "release"):
                    raise
                await asyncio.sleep(max(SHORT.wait_s(), PAUSE_MIN_S))

    def finish_now(
        self,
        folder: JobFolder,
        finish: Finish,
        result: Result,
        spec: JobSpec | None = None,
        landed: Callable[[], None] | None = None,
    ) -> bool:
        """Stage and commit one failed job from the ledger lane itself (a claim under a cancel, a failed join).

        Such a job has no Job to run its agent's ``after`` hook, which is owed once the job
        is final (contract 15): with ``spec``, its marker is written (held, ``afterowed.own``)
        before the commit, and ``after_hooks`` runs it on the loop; a crash between the two
        leaves it owed to the next pass. ``landed`` is called on the loop once it is in failed/.
        """
        hooks = self.after_hooks if spec is not None else None
        hooked = hooks is not None and spec is not None and hooks.own(spec)
        handed = False
        try:
            ok = self.commit([Landing(folder, finish, result)])[0]  # its job.failed notification queued there
            self._told.discard(finish.job_id)
            if isinstance(ok, OSError):
                raise ok
            if ok and hooked and hooks is not None and spec is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(hooks.start, spec, finish.state)
                handed = True
            if ok and landed is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(landed)
        finally:
            if hooks is not None and hooked and not handed:
                hooks.let_go(finish.job_id)  # not committed: whoever ends the job owes the hook
        return ok

    def commit(self, batch: Sequence[Landing]) -> list[bool | OSError]:
        """Steps 1 to 3 for a batch (ledger lane): stage, ledger, land, fsync each target once, log, count.

        An item whose result cannot be staged answers with its OSError and is not committed.
        """
        answers: list[bool | OSError] = [False] * len(batch)
        ready: list[int] = []
        written: list[tuple[int, tuple[str, ...]]] = []
        for i, landing in enumerate(batch):
            if landing.staged:
                ready.append(i)
                continue
            try:
                written.append((i, landing.folder.write_staged(landing.result)))
            except OSError as exc:
                answers[i] = exc
        # every staged result of the batch is fsynced at once, before the ledger records any end
        errors = iter(fsutil.fsync_many([path for _, paths in written for path in paths]) if written else ())
        for i, paths in written:
            error = next((e for e in [next(errors) for _ in paths] if e is not None), None)
            if error is None:
                ready.append(i)
            else:
                answers[i] = error
        ready.sort()
        oks = self.ledger.finish([batch[i].finish for i in ready]) if ready else []
        touched: set[State] = set()
        moves: list[tuple[Landing, State]] = []
        counted: list[tuple[float | None, float | None] | None] = []
        for i, ok in zip(ready, oks, strict=True):
            answers[i] = ok
            if ok:
                landing = batch[i]
                state = landed_state(landing.finish.state)
                moves.append((landing, state))
                # read in active/, before the move: the earlier results a retried job keeps there
                counted.append(None if self.metrics is None else this_claim(landing.folder, landing.result))
        if moves:
            faults.point("finish.recorded")  # the ledger has the end, the folders are still in active/
        placed: list[int] = []  # the moves whose folder is in its state's folder (a stuck job stays in active/)
        try:
            self._move(moves, touched, placed)
            for state in touched:
                fsutil.fsync_dir(self.layout.folder_str(state))
        finally:  # logged once its folder is in place: a reader of the line finds result.json in done/ or failed/
            for k in placed:  # a stuck job (job.stuck, still in active/): whoever lands it later logs and counts it
                self._log_end(*moves[k])
                self._count_end(moves[k][0].result, moves[k][1], counted[k])
            self._told.update(moves[k][0].finish.job_id for k in set(range(len(moves))) - set(placed))
        if self.notify is not None and self._loop is not None:  # queued before the joins' ends (on_final) queue
            for landing, _ in (moves[k] for k in placed):  # theirs: notifications go in the order of the events
                finish = landing.finish
                event = notified_event(finish.state)
                if event is not None:
                    target = self.layout.job(landed_state(finish.state), finish.job_id) / "result.json"
                    agent, reason = landing.result.agent or "", landing.result.reason
                    self._told.add(finish.job_id)
                    self._loop.call_soon_threadsafe(self.notify.fire, event, finish.job_id, agent, reason, target)
        final_ids = [  # review is not final
            batch[i].finish.job_id
            for i, ok in zip(ready, oks, strict=True)
            if ok and batch[i].finish.state != Row.REVIEW
        ]
        if final_ids and self.on_final is not None:
            try:
                self.on_final(final_ids)
            except Exception as exc:  # the periodic sweep finds the joins again
                log.exception("daemon.error", step="joins", error=str(exc))
        return answers

    def _log_end(self, landing: Landing, state: State) -> None:
        log_end(landing.finish.job_id, landing.result, state)

    def _count_end(self, result: Result, state: State, claim: tuple[float | None, float | None] | None) -> None:
        """Count a job's end the ledger recorded among the finished jobs (claim: ``this_claim``, for the metrics)."""
        if state is not State.REVIEW:
            self.finished.add(state.value, result.agent)
            if self.metrics is not None and claim is not None:
                self.metrics.job_finished(state.value, result.agent, *claim)

    def _move(self, moves: Sequence[tuple[Landing, State]], touched: set[State], placed: list[int]) -> None:
        """Name each staged result result.json, fsync those folders at once, then move each into its state.

        ``placed`` gets the index of each move whose folder is then in its state's folder.
        """
        named: list[tuple[int, Landing, State]] = []
        synced: list[str] = []
        for k, (landing, state) in enumerate(moves):
            try:
                folder = landing.folder.name_result()
            except FileNotFoundError:  # landed already (a crash between land and this)
                placed.append(k)
                continue
            except OSError as exc:  # its result's name taken (an agent wrote outside work/): it stays in active/
                stuck(landing.finish.job_id, landing.result.agent, f"its result cannot be named result.json: {exc}")
                continue
            named.append((k, landing, state))
            if folder is not None:
                synced.append(folder)
        # else a power cut can bring a folder back in done/ without its result.json
        for error in fsutil.fsync_many(synced):
            if error is not None:
                raise error
        for k, landing, state in named:
            try:
                landing.folder.move_to(self.layout, state)
            except FileNotFoundError:  # landed already (a crash between land and this)
                placed.append(k)
                continue
            except OSError as exc:  # done/<id> taken by something else: recovered at a start once it is free
                stuck(landing.finish.job_id, landing.result.agent, f"cannot move it into {state.value}/: {exc}")
                continue
            placed.append(k)
            touched.add(state)

    def release(self, parent: str) -> int:
        """Release a done parent's follow-ups (blocking: io pool); each new file hints the inbox."""
        return release_followups(
            self.layout,
            self.ledger,
            parent,
            max_chain_cost_usd=self.config().max_chain_cost_usd,
            released=self._released,
            held=self._held,
        )

    def release_orphaned(self) -> None:
        """Release the follow-ups that daemons which died left reserved (blocking: io pool)."""
        ledger = self.ledger
        parents = {e.parent for e in ledger.pending_releases() if e.parent and not ledger.alive(e.owner or "")}
        for parent in sorted(parents):
            self.release(parent)

    def _released(self, name: str) -> None:
        if self.hints is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.hints.hint, "moved", name)

    def _held(self, entry: Entry, name: str) -> None:
        if self.notify is not None and self._loop is not None:
            reason = f"chain cost {usd(entry.chain_cost_usd)} is above max_chain_cost_usd"
            self._loop.call_soon_threadsafe(self.notify.fire, "budget.held", entry.job_id, entry.agent, reason, None)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Name the loop that released follow-ups are hinted to (set at start, before any release)."""
        self._loop = loop


def log_end(job_id: str, result: Result, state: State) -> None:
    """Log the end of a job whose folder is in its state's folder (``job.done``, ``job.failed``, ``job.review``).

    Whoever moved the folder logs it, once it is there: the daemon that finished the job, or
    the daemon or command that landed the end a dead daemon had recorded.
    """
    fields = {
        "job_id": job_id,
        "agent": result.agent,
        "attempts": len(result.attempts),
        "duration_s": result.duration_s,
        "cost_usd": result.cost_usd,
        "chain_cost_usd": result.chain_cost_usd,
    }
    if state is State.DONE:
        log.info("job.done", children=list(result.children) or None, **fields)
    elif state is State.REVIEW:
        log.info("job.review", children=list(result.children) or None, **fields)
    else:
        log.warning("job.failed", reason=result.reason, **fields)


def stuck(job_id: str, agent: str | None, why: str) -> None:
    """Say that a job cannot be finished and stays in active/ as it is, for a person to look at; the daemon goes on.

    Only what no agent may do makes one: the daemon's own files of the job folder, or its
    place in done/ or failed/, taken by something else (an agent without a sandbox writing
    outside work/, a person). Nothing is removed or overwritten to get past it.
    """
    log.error("job.stuck", job_id=job_id, agent=agent, reason=oneline(why))
