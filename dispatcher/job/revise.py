"""`dispatcher revise ID --note TEXT`: one more attempt for a job in review/ or failed/ (contract section 14).

A revision is a request the daemon carries out, like `retry`; each step is safe
to interrupt:

1. the command writes the note into the job folder (``revise.json``, fsynced,
   under a temporary name first), then records a ``revise`` request in the ledger
   (a note without a request is simply overwritten by the next `revise`);
2. a daemon claims the job in the ledger (``take_retry`` with the request still
   open: one request, one revision), writes ``work/feedback.json`` =
   ``{"from": "review", "note": TEXT, "checks": [...]}`` (the last result's
   checks), moves the note to ``attempts/<n>/revision.json`` (which also counts
   the revisions), writes the new spec (one more attempt), moves the folder into
   active/ and clears the request; ``job.revised`` is logged.

A daemon that dies between those steps leaves a claim whose folder is still in
review/ or failed/: ``settle_ledger`` puts the row back and the open request is
carried out again, reading the checks from the result kept in ``attempts/<n>/``.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from dispatcher import faults, fsutil
from dispatcher.errors import NotFound, WrongState
from dispatcher.layout import Layout
from dispatcher.ledger.base import Ledger, Request
from dispatcher.lifecycle import State
from dispatcher.spec.jobspec import JobSpec
from dispatcher.spec.settings import Config
from dispatcher.store.decisions import one_decision
from dispatcher.store.jobstore import JobFolder
from dispatcher.text import is_count

log = structlog.get_logger("dispatcher")
NOTE_FILE = "revise.json"
KEPT_NOTE = "revision.json"
NOTE_MAX = 10_000


def revisions(folder: JobFolder) -> int:
    """Return how many revisions a job has had (each leaves attempts/<n>/revision.json, or revision.<k>.json when
    an earlier revision of the same attempt ran none of its own: it was failed at once, or cancelled)."""
    total = 0
    for n in folder.attempt_numbers():
        try:
            names = os.listdir(folder.attempts_dir / str(n))
        except OSError:
            continue
        total += sum(1 for name in names if _is_kept_note(name))
    return total


def _is_kept_note(name: str) -> bool:
    return name == KEPT_NOTE or (name.startswith("revision.") and name.endswith(".json") and is_count(name[9:-5]))


def _kept_note_path(attempt_dir: Path, asked: Path) -> Path | None:
    """Return where this revision's note is kept in attempt_dir; None if it is there already.

    A note kept after the request's own file (``asked``, rewritten by each `revise`) was made
    by this very revision, which a crash cut short and which is carried out again; a request
    newer than every kept note is a revision of its own (an earlier one ran no attempt).
    """
    try:
        asked_at = os.stat(asked).st_mtime_ns
    except OSError:
        asked_at = 0
    k, path = 1, attempt_dir / KEPT_NOTE
    while True:
        try:
            if os.lstat(path).st_mtime_ns >= asked_at:
                return None
        except FileNotFoundError:
            return path
        k += 1
        path = attempt_dir / f"revision.{k}.json"


def request(config: Config, layout: Layout, ledger: Ledger, job_id: str, note: str) -> str:
    """Record a revision of a job in review/ or failed/ for a daemon; return the line to print.

    Under the root's review lock, as `approve` and `reject`: a decision made meanwhile moves
    the folder before this looks, or after this is recorded (and withdraws it).
    """
    if layout.find(job_id) is None:
        raise NotFound(f"{job_id}: no such job")
    with one_decision(layout):
        return _request(config, layout, ledger, job_id, note)


def _request(config: Config, layout: Layout, ledger: Ledger, job_id: str, note: str) -> str:
    found = layout.find(job_id)
    if found is None:
        raise NotFound(f"{job_id}: no such job")
    state, path = found
    if state not in (State.REVIEW, State.FAILED):
        said = ledger.spoken_state(state, job_id)
        raise WrongState(f"{job_id}: is {said}, only a job in review or failed can be revised")
    folder = JobFolder(path)
    try:
        spec = folder.spec()
    except ValueError:
        raise WrongState(f"{job_id}: its job.json is damaged; it cannot be revised") from None
    agent = config.agents.get(spec.agent.name, spec.agent)
    done = revisions(folder)
    if done >= agent.max_revisions:
        raise WrongState(f"{job_id}: has had {done} revisions (max_revisions {agent.max_revisions})")
    if job_id in ledger.requests(Request.REVISE):
        raise WrongState(f"{job_id}: a revision is already requested")
    if job_id in ledger.requests(Request.RETRY):  # also one a daemon carries out, or died carrying out
        raise WrongState(f"{job_id}: a retry is already requested; cancel it first to revise with a note")
    text = note[:NOTE_MAX]  # as written (line breaks kept: section 14's TEXT), at most NOTE_MAX characters
    fsutil.write_atomic(path / NOTE_FILE, fsutil.dump_json({"note": text}), sync=True, sync_dir=True)
    faults.point("revise.noted")
    ledger.request(job_id, Request.REVISE)
    faults.point("revise.requested")
    return f"{job_id}: revision requested"


def reopen(layout: Layout, ledger: Ledger, config: Config, job_id: str) -> tuple[JobSpec, int] | None:
    """Carry out a revise request (daemon, ledger lane): back to active/ with the note; None if taken."""
    token = ledger.take_retry(job_id, Request.REVISE)
    if token is None:
        return None
    faults.point("revise.claimed")
    found = layout.find(job_id)
    if found is None or found[0] not in (State.REVIEW, State.FAILED):
        raise LookupError(f"{job_id}: not in review/ or failed/")
    folder = JobFolder(found[1])
    spec = folder.spec()
    note = folder.read_json(NOTE_FILE)
    text = note.get("note") if isinstance(note, dict) else None
    checks = _last_checks(folder)
    folder.keep_result()
    last = max(folder.attempt_numbers(), default=0)
    agent = config.agents.get(spec.agent.name, spec.agent)
    spec = spec.with_agent(agent, last + 1)
    data = fsutil.dump_json({"from": "review", "note": text or "", "checks": checks})
    if os.path.isdir(folder.work):
        folder.stash(last, feedback=True)
        fsutil.write_new(folder.work / "feedback.json", data, sync=True)
        fsutil.fsync_dir(folder.work)  # its name too: a power cut must not leave the given file missing
        spec = spec.with_given("feedback.json", _sha(data))
    faults.point("revise.feedback")
    kept = _kept_note_path(folder.attempts_dir / str(last), folder.path / NOTE_FILE)
    if kept is not None:
        fsutil.write_atomic(kept, data, sync=True)
    folder.write_spec(replace(spec, since=time.time()), sync=True)  # back in active/ from now: its age
    fsutil.rename_into(folder.path, layout.job(State.ACTIVE, job_id))
    fsutil.fsync_dir(layout.folder(State.ACTIVE))
    faults.point("revise.moved")
    ledger.clear_request(job_id, Request.REVISE, drop_reserved=True)
    count = revisions(JobFolder(layout.job(State.ACTIVE, job_id)))
    log.info("job.revised", job_id=job_id, agent=agent.name, note=text, revision=count, attempt=last + 1)
    return spec, token


def log_cut_revision(layout: Layout, job_id: str) -> None:
    """Log ``job.revised`` for a revision a crash cut between its move into active/ and its line (io pool).

    The request was carried out (the job is in active/ with its feedback); only its clearing
    and its line were lost. The attempt it runs may have begun already: the line says
    ``step: recovered`` and no attempt number.
    """
    folder = JobFolder(layout.job(State.ACTIVE, job_id))
    note = folder.read_json(NOTE_FILE)
    try:
        agent: str | None = folder.spec().agent.name
    except ValueError:
        agent = None
    text = note.get("note") if isinstance(note, dict) else None
    log.info("job.revised", job_id=job_id, agent=agent, note=text, revision=revisions(folder), step="recovered")


def _last_checks(folder: JobFolder) -> list[Any]:
    """Return the checks of the job's last result (result.json, or the one kept by an interrupted revision)."""
    result = folder.result()
    if result is not None:
        return [c.to_json() for c in result.checks]
    last = max(folder.attempt_numbers(), default=0)
    kept = sorted(p for p in _names(folder.attempts_dir / str(last)) if p.startswith("result"))
    data = folder.read_json(f"attempts/{last}/{kept[-1]}") if kept else None
    checks = data.get("checks") if isinstance(data, dict) else None
    return checks if isinstance(checks, list) else []


def _names(path: os.PathLike[str]) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
