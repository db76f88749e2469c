"""A person's decision on a job waiting in review/: approve (to done/) or reject (to failed/).

The same finishing sequence as a job's own end, each step safe to interrupt:

1. the decided result (``state`` done or failed, ``reason`` rejected: TEXT) is
   staged in the review folder;
2. the ledger records the decision, conditional on the job's token (a second
   decision, or a decision on a job that was not waiting, changes nothing), and
   the job's owner is cleared, so that any daemon releases its follow-ups;
3. the folder lands in done/ or failed/;
4. an approved job's follow-ups are released, each once (a rejected job's were
   dropped by step 2).

A command killed between steps leaves work that ``settle_reviews`` (run by every
daemon at start and at each rescan) completes: a review folder whose ledger row
is already decided lands with its staged result (or its result.json, when the command
was cut between naming it and moving the folder), and follow-ups of a done job
whose owner is gone are released by the daemons' usual recovery.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog
from filelock import Timeout

from dispatcher import faults, fsutil
from dispatcher.clock import iso
from dispatcher.errors import NotFound, WrongState
from dispatcher.job.finish import stuck, this_claim
from dispatcher.job.followups import release_followups
from dispatcher.job.notice import Apart, start_detached
from dispatcher.layout import Layout
from dispatcher.ledger.base import Entry, Finish, Ledger, Request
from dispatcher.lifecycle import Row, State, is_final, is_landed, landed_state, spoken
from dispatcher.spec.result import Result
from dispatcher.store.decisions import one_decision, review_lock
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.results import cut_reason
from dispatcher.text import plural, usd

log = structlog.get_logger("dispatcher")


def decide(
    layout: Layout, ledger: Ledger, job_id: str, *, approve: bool, reason: str | None = None,
    max_chain_cost_usd: float | None = None, notify: Apart | None = None,
) -> str:  # fmt: skip
    """Approve or reject one job in review/; return the line to print. NotFound/WrongState otherwise.

    ``notify``: the config's notify command, run apart from this command for each follow-up an
    approval holds over the chain budget (``budget.held``).
    """
    folder = JobFolder(layout.job(State.REVIEW, job_id))
    entry = ledger.get(job_id)
    if not folder.path.is_dir():
        found = layout.find(job_id)
        if found is None and entry is None:
            raise NotFound(f"{job_id}: no such job")
        if approve and found is not None and found[0] is State.DONE and entry is not None and entry.state == Row.DONE:
            line = _finish_approval(layout, ledger, JobFolder(found[1]), max_chain_cost_usd, notify)
            if line is not None:
                return line
        where = ledger.spoken_state(found[0], job_id) if found else spoken(entry.state) if entry else "unknown"
        raise WrongState(f"{job_id}: is {where}, not waiting for review")
    with one_decision(layout):
        if not folder.path.is_dir():  # another command decided it while this one waited
            raise WrongState(_lost(ledger, job_id))
        return _decide(
            layout, ledger, folder, approve=approve, reason=reason, max_chain_cost_usd=max_chain_cost_usd, notify=notify
        )


def _decide(
    layout: Layout, ledger: Ledger, folder: JobFolder, *, approve: bool, reason: str | None,
    max_chain_cost_usd: float | None, notify: Apart | None,
) -> str:  # fmt: skip
    job_id = folder.job_id
    entry = ledger.get(job_id)
    if entry is None or not is_landed(entry.state):
        raise WrongState(f"{job_id}: its ledger row is {entry.state if entry else 'missing'}, not review")
    result = folder.result() or Result(job_id, None, entry.agent, None)
    with contextlib.suppress(OSError, ValueError):  # its claim (unknown: counted from when its order came in)
        folder.claimed = folder.spec().claimed
    state = Row.DONE if approve else Row.FAILED
    withdrawn = False  # a revision asked for before this decision and not carried out yet
    if entry.state == Row.REVIEW:
        why = None if approve else cut_reason(f"rejected: {(reason or '').strip() or 'no reason given'}")
        children = result.children if approve else ()  # a rejected job's follow-ups are dropped, never jobs
        # review_since: when the agent's work passed its checks, which the decision's `finished` replaces (the
        # time its cost was counted at: `ledger rebuild` reads it back)
        since = {"review_since": result.finished} if result.finished else {}
        result = replace(
            result, state=str(state), reason=why, finished=iso(time.time()), children=children,
            extra={**result.extra, **since},
        )  # fmt: skip
        folder.stage_result(result)
        faults.point("review.staged")
        item = Finish(job_id, entry.token, state, result.cost_usd, result.chain_cost_usd)
        if not ledger.finish([item])[0]:
            raise WrongState(f"{job_id}: was decided by someone else meanwhile")
        faults.point("review.decided")
        withdrawn = job_id in ledger.requests(Request.REVISE)
        if withdrawn:  # the decision is the later word: the job is not revised after it
            ledger.clear_request(job_id, Request.REVISE)
    elif entry.state != state:
        raise WrongState(f"{job_id}: was already {'approved' if entry.state == Row.DONE else 'rejected'}")
    else:  # decided by this command run before, cut short: its staged result says how
        result = folder.staged_result() or result
    try:  # the line is logged by whoever moves the folder: this command, one run again after a cut, a rescan
        land(layout, folder, state, decision=lambda: decision_fields(folder, result, approve=approve))
    except (FileNotFoundError, FileExistsError):  # landed by a command on another host meanwhile
        if folder.path.is_dir():
            raise
        if entry.state != Row.REVIEW:  # it was decided before this command: someone else's decision
            raise WrongState(_lost(ledger, job_id)) from None
        # this command's decision (its ledger write), landed by a daemon's rescan meanwhile: done all the same
    faults.point("review.landed")
    if approve:
        _release(layout, ledger, job_id, max_chain_cost_usd, notify)
        return f"{job_id}: approved; done" + ("; its requested revision is withdrawn" if withdrawn else "")
    return f"{job_id}: rejected; failed" + ("; its requested revision is withdrawn" if withdrawn else "")


def decision_fields(folder: JobFolder, result: Result, *, approve: bool) -> dict[str, Any]:
    """Return the fields of a decided job's ``job.approved`` or ``job.rejected`` line (``event`` names it).

    A decision ends the job as job.done or job.failed would: the same figures, and the part a
    daemon's metrics count for it (``counted_*``: the time and cost since the job's last finish,
    read from the folder's earlier results, so before it moves).
    """
    duration, cost = this_claim(folder, result)
    event = "job.approved" if approve else "job.rejected"
    fields: dict[str, Any] = {
        "job_id": folder.job_id,
        "agent": result.agent,
        "reason": result.reason,
        "duration_s": result.duration_s,
        "cost_usd": result.cost_usd,
        "chain_cost_usd": result.chain_cost_usd,
        "counted_duration_s": duration,
        "counted_cost_usd": cost,
    }
    return {"event": event, **fields}


def _release(
    layout: Layout, ledger: Ledger, job_id: str, max_chain_cost_usd: float | None, notify: Apart | None
) -> int:
    """Release an approved job's follow-ups, each once (or into held/ over the chain budget); return how many."""

    def held(entry: Entry, name: str) -> None:
        why = f"chain cost {usd(entry.chain_cost_usd)} is above max_chain_cost_usd"
        if notify is not None:
            start_detached(notify, layout.root, "budget.held", entry.job_id, entry.agent, why)

    return release_followups(layout, ledger, job_id, max_chain_cost_usd=max_chain_cost_usd, held=held)


def _finish_approval(
    layout: Layout, ledger: Ledger, folder: JobFolder, max_chain_cost_usd: float | None, notify: Apart | None
) -> str | None:
    """Release what an approval cut short by a crash left reserved (README: "run the same command again").

    Only for a job of an agent with review, landed in done/: its follow-ups still waiting are
    released once. None when there is nothing left to do (the job is plainly done).
    """
    try:
        reviewed = folder.spec().agent.review
    except (OSError, ValueError):
        return None
    if not reviewed:
        return None
    with one_decision(layout):
        count = _release(layout, ledger, folder.job_id, max_chain_cost_usd, notify)
    if not count:
        return None
    return f"{folder.job_id}: approved; done; {plural(count, 'follow-up')} released now (the approval was cut short)"


def _lost(ledger: Ledger, job_id: str) -> str:
    """Return the line for a decision that another command made first."""
    entry = ledger.get(job_id)
    if entry is not None and entry.state in (Row.DONE, Row.FAILED):
        return f"{job_id}: was already {'approved' if entry.state == Row.DONE else 'rejected'}"
    return f"{job_id}: was decided by someone else meanwhile"


def land(
    layout: Layout, folder: JobFolder, state: Row, decision: Callable[[], dict[str, Any]] | None = None
) -> dict[str, Any] | None:
    """Move a decided review folder into done/ or failed/ (its staged result becomes result.json).

    ``decision``: the fields of the decision's ``job.approved``/``job.rejected`` line
    (``decision_fields``, read before the move). Whoever moves the folder (a command, the same
    command run again after a crash, a daemon's rescan) logs the line once the folder is in
    place, so a reader of the line finds result.json in done/ or failed/; its fields are
    returned. A mover that is killed between the move and the line leaves the job decided and
    in place without one.
    """
    target = landed_state(state)
    if folder.name_result(replace=True) is not None:
        fsutil.fsync_dir(folder.path)  # else a power cut can bring the folder back in done/ without result.json
    faults.point("review.named")  # result.json names the decision; the folder is still in review/
    fields = decision() if decision is not None else None
    folder.move_to(layout, target)
    fsutil.fsync_dir(layout.folder(target))
    if fields is not None:
        log.info(fields["event"], **{k: v for k, v in fields.items() if k != "event"})
    return fields


def settle_reviews(layout: Layout, ledger: Ledger) -> list[dict[str, Any]]:
    """Land review folders whose decision the ledger already holds (a command killed midway).

    Not while a decision holds the review lock on this host: that command lands its own
    job (a decision between its ledger write and its move is no command killed midway).
    The next rescan looks again. Return the fields of the ``job.approved``/``job.rejected``
    lines logged here, for the decisions whose command was cut short before it logged one.
    """
    try:
        names = [n for n in os.listdir(layout.folder(State.REVIEW)) if not n.startswith(".")]
    except FileNotFoundError:
        return []
    if not names:
        return []
    lock = review_lock(layout, 0)
    try:
        lock.acquire()
    except (Timeout, OSError):  # a decision is under way (or the lock cannot be made): the next rescan
        return []
    try:
        return _land_decided(layout, ledger, names)
    finally:
        lock.release()


def _land_decided(layout: Layout, ledger: Ledger, names: list[str]) -> list[dict[str, Any]]:
    logged: list[dict[str, Any]] = []
    for job_id in names:
        entry = ledger.get(job_id)
        folder = JobFolder(layout.job(State.REVIEW, job_id))
        if entry is None or not is_final(entry.state):
            continue
        # staged, or already named result.json (cut between that rename and the folder's)
        decided = folder.staged_result() or folder.result()
        if decided is None or decided.state != entry.state:
            continue
        with contextlib.suppress(OSError, ValueError):  # its claim, for the line's counted figures
            folder.claimed = folder.spec().claimed

        approve = entry.state == Row.DONE  # the command was cut short before it moved the folder: its line is owed
        try:
            fields = land(layout, folder, Row(entry.state), decision=functools.partial(
                decision_fields, folder, decided, approve=approve))  # fmt: skip
        except FileNotFoundError:  # landed meanwhile by the command (on another host): its line is its own
            continue
        except OSError as exc:  # done/<id> (failed/<id>) taken by a stray entry: it waits in review/, the rest goes on
            stuck(job_id, entry.agent, f"cannot move it into {landed_state(Row(entry.state)).value}/: {exc}")
            continue
        if fields is not None:
            logged.append(fields)
        log.info("job.recovered", job_id=job_id, agent=entry.agent, step="review", state=entry.state)
    return logged
