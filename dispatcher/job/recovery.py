"""Find what a dead daemon left behind and make it whole: staging folders, claims, active jobs.

Every function here is blocking (the disk, the ledger, /proc) and runs in the
ledger lane or the io pool, never on the loop. Nothing a user dropped is ever
deleted: a staging folder is removed only when the file it links is still in
inbox/ (or was put back there).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from dispatcher import faults, fsutil, procs
from dispatcher.errors import oneline
from dispatcher.job import revise
from dispatcher.job.finish import Finisher, log_end, stuck
from dispatcher.layout import Layout
from dispatcher.ledger.base import Entry, Finish, Ledger, Request
from dispatcher.lifecycle import Row, State, is_landed, landed_state, state_to_row
from dispatcher.spec.jobspec import JobSpec
from dispatcher.spec.result import Result
from dispatcher.spec.settings import Config
from dispatcher.store import refusals
from dispatcher.store.counts import job_entries, visible_entries
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.results import build_result
from dispatcher.store.staging import drop_inbox_twin, remove_stage

log = structlog.get_logger("dispatcher")


def finish_staging(layout: Layout, ledger: Ledger, alive: Callable[[str], bool]) -> None:
    """Complete or undo the staging folders of dead daemons."""
    try:
        stages = sorted(os.listdir(layout.staging))
    except FileNotFoundError:
        return
    for name in stages:
        stage = layout.staging / name
        owner, _, rest = name.partition(".")
        if not owner or alive(owner):
            continue
        try:
            _finish_stage(layout, ledger, owner, rest, stage)
        except FileNotFoundError:
            # another live daemon is finishing the same folder (each step is a rename, a link or a ledger update
            # only one of them wins): whatever it leaves is finished at the next rescan
            continue


def _finish_stage(layout: Layout, ledger: Ledger, owner: str, rest: str, stage: Path) -> None:
    if not stage.is_dir() or stage.is_symlink():
        stage.unlink()  # a follow-up copy a dead daemon was releasing: released again from the ledger
    elif rest.startswith("claim-"):
        _finish_claim(layout, ledger, owner, rest[len("claim-") :].rsplit("-", 1)[0], stage)
    elif rest.startswith("refuse-") and any(p.name.startswith("order") or p.name == "entry" for p in stage.iterdir()):
        refusals.finish_stage(layout, stage)
    else:
        remove_stage(stage)


def _finish_claim(layout: Layout, ledger: Ledger, owner: str, job_id: str, stage: Path) -> None:
    entry = ledger.get(job_id)
    mine = entry is not None and entry.state == Row.CLAIMED and entry.owner == owner
    order = next((p for p in stage.iterdir() if p.name.startswith("order")), None)
    if mine and entry is not None and _complete(stage) and layout.find(job_id) is None and order:
        # a join goes to waiting/: its wait is recorded by the joins' recovery (``Joins.recover``)
        state = State.WAITING if JobFolder(stage).spec().order.get("after") else State.ACTIVE
        os.rename(stage, layout.job(state, job_id))
        drop_inbox_twin(layout, entry.source or "", layout.job(state, job_id) / order.name)
        fsutil.fsync_dir(layout.folder(state))
        log.info("job.recovered", job_id=job_id, agent=entry.agent, step="claim")
        return
    if mine and entry is not None and layout.find(job_id) is None:  # claimed, its folder never completed: nothing ran
        # undone as the dead daemon would have: its claim made this daemon's first, then given back, so that the
        # file put back below is claimed again (a dead daemon of this boot lost no folder: its claim is not taken over)
        token = ledger.adopt(job_id, owner, entry.token)
        if token is not None:
            ledger.unclaim(job_id, token, Row.RELEASED if entry.parent else None)
    if order is not None and entry is not None and entry.source and os.lstat(order).st_nlink == 1:
        with contextlib.suppress(FileExistsError):  # the inbox name is gone: put the user's file back
            os.link(order, layout.inbox / entry.source)
    remove_stage(stage)


def _complete(stage: Path) -> bool:
    """Return True if a claim's staging folder was built whole (its job.json, written last, reads back)."""
    try:
        JobFolder(stage).spec()
    except ValueError:
        return False
    return True


def settle_ledger(layout: Layout, ledger: Ledger, alive: Callable[[str], bool]) -> None:
    """Bring claims of dead daemons in line with the folders (a crash after a move)."""
    for entry in ledger.in_state(Row.CLAIMED):
        if entry.owner is not None and not alive(entry.owner):
            settle_claim(layout, ledger, entry)


def settle_claim(layout: Layout, ledger: Ledger, entry: Entry) -> None:
    """Put back the row of one claim of a dead daemon whose folder is not in active/ or waiting/.

    Its folder landed before the ledger heard (a crash after the move), or is still in failed/
    or review/ (a retry or revision claimed, the daemon dead before the move): the row says
    what the folder says, and an open request stays for the next daemon.
    """
    found = layout.find(entry.job_id)
    if found is None or found[0] in (State.ACTIVE, State.WAITING):  # waiting/: ``Joins.recover``
        return
    state, folder = found
    job = JobFolder(folder)
    # a reopen cut after it moved result.json aside: put back, cost and all (a revision may have set the reviewed
    # attempt's outbox aside too: then it is carried out again, never withdrawn, so that no follow-up is lost)
    midway = state in (State.FAILED, State.REVIEW) and job.unkeep_result()
    result = job.result()
    row = state_to_row(state, result.state if result else None)
    cost, chain = (result.cost_usd, result.chain_cost_usd) if result else (None, None)
    # a cancel asked while the dead daemon carried out a retry or revision withdraws it, as it would have before
    # (the finish below clears the cancel: the job is no longer claimed)
    withdraw = state is State.FAILED or (state is State.REVIEW and not midway)
    cancelled = withdraw and entry.job_id in ledger.requests(Request.CANCEL)
    ledger.finish([Finish(entry.job_id, entry.token, row, cost, chain)])
    if cancelled:
        for kind in (Request.RETRY, Request.REVISE):
            if entry.job_id in ledger.requests(kind):
                ledger.clear_request(entry.job_id, kind)


def reconcile_active(layout: Layout, ledger: Ledger) -> None:
    """Put back the claim row of any active/ job the ledger lost (a power loss, a lost WAL)."""
    for job_id in _active_ids(layout):
        entry = ledger.get(job_id)
        if entry is None or entry.state in (Row.RESERVED, Row.RELEASED):
            folder = JobFolder(layout.job(State.ACTIVE, job_id))
            try:
                spec = folder.spec()
            except ValueError:
                spec = None
            if ledger.reconcile(
                job_id, spec.agent.name if spec else None, spec.parent if spec else None, spec.hops if spec else 0
            ):
                log.warning(
                    "ledger.repaired",
                    job_id=job_id,
                    agent=spec.agent.name if spec else None,
                    reason="active job without a claim row",
                )


def orphans(
    layout: Layout,
    ledger: Ledger,
    alive: Callable[[str], bool],
    left: frozenset[str] = frozenset(),
    landed: list[Landed] | None = None,
    apart: list[str] | None = None,
    kept: set[str] | None = None,
) -> list[tuple[str, int, str | None]]:
    """Adopt active/ jobs whose daemon is dead (one daemon wins each); return (job_id, token, its dead owner).

    ``left`` are jobs of this very daemon that it stopped while fenced: they are
    taken back the same way once its lease is renewed.

    A job whose row already says done, failed or review (its daemon died while
    landing it) is landed here and not returned; it is added to ``landed``
    (``run --once`` counts a job it landed in failed/ as one it failed). A folder
    whose job.json is missing is returned too: it is failed with a reason when it is loaded.
    A job whose agent runs on out of sight (``_agent_apart``) is left, and added to ``apart``.
    The live daemons whose jobs were left to them are added to ``kept``.
    """
    out = []
    for job_id in _active_ids(layout):
        entry = ledger.get(job_id)
        if entry is None:
            continue
        if entry.owner == ledger.owner and job_id not in left:  # ours, and running (or starting)
            continue
        if entry.owner != ledger.owner and entry.owner is not None and alive(entry.owner):
            if kept is not None:
                kept.add(entry.owner)
            continue
        if is_landed(entry.state):
            state = landed_state(entry.state)
            moved = _land(layout, job_id, state, entry.agent)
            if moved is not None and landed is not None:
                landed.append(moved)
            continue
        if entry.state != Row.CLAIMED:
            continue
        if _agent_apart(layout, job_id):
            if apart is not None:
                apart.append(job_id)
            continue  # its agent still runs where this daemon cannot see it: taken over once it has let go
        # a folder without a readable job.json (torn by a power cut) is adopted all the same:
        # loading it fails, and the job is failed with that reason (fail_damaged), never skipped
        token = ledger.adopt(job_id, entry.owner, entry.token)
        if token is not None:
            _carried_out(layout, ledger, job_id)
            out.append((job_id, token, entry.owner))
    return out


def _agent_apart(layout: Layout, job_id: str) -> bool:
    """Return True while the last agent of job_id runs in another pid namespace under this host's name, unseen here.

    Such an agent (its daemon died in a container that shares the host name and the root) cannot
    be found nor ended from here: its pid means another process, and no walk of this /proc shows
    it. It inherited its slot's lock, so while that lock is held by no process this /proc shows
    (`/proc/locks` leaves out the locks of processes it cannot see), the job is left alone: taken
    over, it would run a second copy beside the first. A lock held by a process seen here is
    not that agent's (a job of a live daemon took the slot since), and an agent on another host
    is the lease's business (section 12).
    """
    folder = JobFolder(layout.job(State.ACTIVE, job_id))
    n = max(folder.attempt_numbers(), default=0)
    info = folder.pid_record(n) if n else None
    if info is None or "slot_ino" not in info or info.get("host") != procs.this_host():
        return False
    if procs.seen_here(info.get("host"), info.get("pidns")):
        return False  # this /proc's: found and ended as any dead daemon's agent
    slot = next((p for p in visible_entries(layout.slots) if p.inode() == info["slot_ino"]), None)
    return slot is not None and procs.locked_unseen(slot.path)


def _carried_out(layout: Layout, ledger: Ledger, job_id: str) -> None:
    """Clear a retry or revise request the dead daemon carried out but did not clear (it died between).

    Such a request is taken only from failed/ or review/, so a job in active/ with one still
    open was moved by it: left open, it would be carried out a second time once the job
    ended again (one `retry` or `revise`, two more attempts).
    """
    if job_id in ledger.requests(Request.RETRY):
        ledger.clear_request(job_id, Request.RETRY)
    if job_id in ledger.requests(Request.REVISE):
        ledger.clear_request(job_id, Request.REVISE, drop_reserved=True)
        revise.log_cut_revision(layout, job_id)  # its job.revised line, which the dead daemon did not write


def land_recorded_end(layout: Layout, ledger: Ledger, job_id: str) -> Landed | None:
    """Move a job whose end its dead daemon recorded (the row final, its folder still in active/) into its state's
    folder, as the next daemon would; nothing for any other job (a live daemon moves its own). Return what it
    landed (the caller notifies a failed or review one, as a daemon would)."""
    entry = ledger.get(job_id)
    if entry is None or entry.owner is None or not is_landed(entry.state) or ledger.alive(entry.owner):
        return None
    if os.path.isdir(layout.job(State.ACTIVE, job_id)):
        return _land(layout, job_id, landed_state(entry.state), entry.agent)
    return None


def _land(layout: Layout, job_id: str, state: State, agent: str | None) -> Landed | None:
    """Move a job its dead daemon decided into its state's folder and log its end; None if this call did not move it.

    The dead daemon logged no end for it (it logs one after the move): ``job.recovered``, then
    the job's ``job.done``, ``job.failed`` or ``job.review`` line, as it would have.
    """
    folder = JobFolder(layout.job(State.ACTIVE, job_id))
    try:
        folder.land(layout, state)
        fsutil.fsync_dir(layout.folder(state))
    except FileNotFoundError:  # landed meanwhile (another daemon)
        return None
    except OSError as exc:  # its files or its target taken by something else (an agent outside work/)
        stuck(job_id, agent, f"cannot move it into {state.value}/: {exc}")
        return None
    log.info("job.recovered", job_id=job_id, agent=agent, step="land", state=state.value)
    moved = JobFolder(layout.job(state, job_id))
    result = moved.result()
    if result is not None:
        log_end(job_id, result, state)
    with contextlib.suppress(OSError, ValueError):  # its claim: the metrics count from it
        moved.claimed = moved.spec().claimed
    return Landed(job_id, state, moved, result)


@dataclass(frozen=True)
class Landed:
    """A job whose end a dead daemon recorded, landed here: the daemon counts it and notifies a failed or review one."""

    job_id: str
    state: State
    folder: JobFolder
    result: Result | None


def _active_ids(layout: Layout) -> list[str]:
    """Return the ids of the job folders in active/ (a stray file there is no job)."""
    return sorted(de.name for de in job_entries(layout.folder(State.ACTIVE)))


def fail_damaged(
    layout: Layout,
    ledger: Ledger,
    finisher: Finisher,
    job_id: str,
    token: int,
    exc: Exception,
    *,
    agent: str | None = None,
) -> None:
    """Fail a job whose folder cannot be read back (say, torn by a power loss); keep every file.

    It finishes as any failed job does (``Finisher.finish_now``): ``job.failed`` with its
    figures, the finished count, the notification. One that cannot even be failed (its
    result's place taken) is ``stuck``: it stays in active/ and the daemon goes on.
    """
    try:
        _fail_damaged(layout, ledger, finisher, job_id, token, exc)
    except OSError as err:
        stuck(job_id, agent, f"recovery: it cannot be read back ({exc}) nor failed: {err}")


def _fail_damaged(layout: Layout, ledger: Ledger, finisher: Finisher, job_id: str, token: int, exc: Exception) -> None:
    folder = JobFolder(layout.job(State.ACTIVE, job_id))
    entry = ledger.get(job_id)
    reason = oneline(f"recovery: the job folder cannot be read back: {type(exc).__name__}: {exc}")
    result = build_result(
        job_id=job_id,
        state="failed",
        agent=entry.agent if entry else None,
        reason=reason,
        received=os.path.getmtime(folder.path),
    )
    finisher.finish_now(folder, Finish(job_id, token, Row.FAILED), result)


def reopen(layout: Layout, ledger: Ledger, config: Config, job_id: str) -> tuple[JobSpec, int] | None:
    """Move a failed job back to active/ for `dispatcher retry`; return its new spec and token.

    Order, for crashes: the ledger claim; the earlier result.json into
    attempts/<n>/; the new spec (the agent's settings as the config has them
    now, and max_attempts more attempts) in job.json; the rename into active/;
    then the request is cleared. A reopen cut short is finished later:
    ``settle_ledger`` puts a claim whose folder is still in failed/ back to
    failed (the request stays), and a job found in active/ with a kept result
    goes on with a new attempt. None if another daemon took it first.
    """
    token = ledger.take_retry(job_id)
    if token is None:
        return None
    faults.point("retry.claimed")
    folder = JobFolder(layout.job(State.FAILED, job_id))
    spec = folder.spec()
    kept = folder.result()
    failed_checks = kept.failed_checks() if kept else []
    folder.keep_result()
    last = max(folder.attempt_numbers(), default=0)
    agent = config.agents.get(spec.agent.name, spec.agent)
    max_attempts = int(spec.order.get("max_attempts") or agent.max_attempts)
    spec = spec.with_agent(agent, last + max_attempts)
    if agent.repair and failed_checks and os.path.isdir(folder.work):
        # repair applies to the first new attempt too: it gets the checks the last one failed
        spec = spec.with_given("feedback.json", folder.give_feedback(last, failed_checks))
    elif "feedback.json" in spec.given and os.path.isdir(folder.work):
        folder.stash(last, feedback=True)  # a revision's (or repair's) note was for the attempts before, not this
        spec = spec.without_given("feedback.json")
    spec = replace(spec, since=time.time())  # back in active/ from now: its age
    folder.write_spec(spec, sync=True)
    fsutil.rename_into(folder.path, layout.job(State.ACTIVE, job_id))
    fsutil.fsync_dir(layout.folder(State.ACTIVE))
    faults.point("retry.moved")
    ledger.clear_request(job_id, Request.RETRY)
    return spec, token
