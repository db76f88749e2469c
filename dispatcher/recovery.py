"""Find work a dead daemon left behind: staging folders, stale claims, active jobs."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from dispatcher import claim, fsutil, procs
from dispatcher.errors import oneline
from dispatcher.layout import Layout, State, iso
from dispatcher.ledger import CLAIMED, DONE, FAILED, Ledger

log = structlog.get_logger("dispatcher")


def finish_staging(layout: Layout, alive: Callable[[str], bool]) -> None:
    """Complete or undo the staging folders of dead daemons.

    A claim folder that holds its order file is renamed into active/ (the
    ledger claim is already made); one without it is removed (the file is
    still in inbox/). A refusal folder holding the file goes to failed/.
    """
    for stage in sorted(layout.staging.iterdir()) if layout.staging.is_dir() else ():
        owner, _, rest = stage.name.partition(".")
        if alive(owner):
            continue
        if not stage.is_dir() or stage.is_symlink():
            stage.unlink()  # a follow-up copy a dead daemon was releasing: released again from the ledger
            continue
        has_file = any(p.name.startswith("order") or p.name == "entry" for p in stage.iterdir())
        if rest.startswith("claim-"):
            job_id = rest[len("claim-") :].rsplit("-", 1)[0]
            if has_file and layout.find(job_id) is None:
                spec = json.loads((stage / claim.JOB_FILE).read_text())
                order = next(p for p in stage.iterdir() if p.name.startswith("order"))
                claim.drop_inbox_twin(layout, spec.get("source", ""), order)
                os.rename(stage, layout.job(State.ACTIVE, job_id))
                log.info("job.recovered", job_id=job_id, step="claim")
                continue
        elif rest.startswith("refuse-") and has_file:
            target, source = stage / ".target", stage / ".source"
            base = os.fsdecode(target.read_bytes()) if target.exists() else stage.name
            if source.exists():
                kept = next(p for p in stage.iterdir() if p.name.startswith("order") or p.name == "entry")
                claim.drop_inbox_twin(layout, os.fsdecode(source.read_bytes()), kept)
            claim.place_refusal(layout, stage, base)
            continue
        shutil.rmtree(stage)


def settle_ledger(layout: Layout, ledger: Ledger, alive: Callable[[str], bool]) -> None:
    """Bring claims of dead daemons in line with the folders (a crash after the final move)."""
    for entry in ledger.in_state(CLAIMED):
        if entry.owner is None or alive(entry.owner):
            continue
        found = layout.find(entry.job_id)
        if found is None:
            continue
        state, folder = found
        if state in (State.DONE, State.FAILED) and (folder / "result.json").exists():
            result = json.loads((folder / "result.json").read_text())
            ledger.finish(entry.job_id, DONE if result.get("state") == "done" else FAILED)
        elif state is State.FAILED:
            ledger.finish(entry.job_id, FAILED)  # a retry cut short before the move: the request stays


def orphaned_jobs(layout: Layout, ledger: Ledger, me: str, alive: Callable[[str], bool]) -> list[str]:
    """Return active jobs whose owner is dead, adopted by me (atomically, one daemon wins)."""
    out: list[str] = []
    try:
        names = sorted(os.listdir(layout.folder(State.ACTIVE)))
    except FileNotFoundError:
        return out
    for job_id in names:
        if job_id.startswith("."):
            continue
        entry = ledger.get(job_id)
        if entry is None or entry.owner == me or (entry.owner is not None and alive(entry.owner)):
            continue
        if not (layout.job(State.ACTIVE, job_id) / claim.JOB_FILE).exists():
            continue
        if ledger.adopt(job_id, me, expected_owner=entry.owner):
            out.append(job_id)
    return out


def job_agent(folder: Path) -> str:
    """Return the agent name frozen into a job's job.json ('' if it cannot be read)."""
    try:
        spec = json.loads((folder / claim.JOB_FILE).read_text())
        return str(spec["agent"]["name"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def fail_damaged(layout: Layout, ledger: Ledger, job_id: str, agent: str, exc: Exception) -> None:
    """Fail a job whose folder cannot be read back (say, torn by a power loss); keep every file."""
    folder = layout.job(State.ACTIVE, job_id)
    now = time.time()
    result: dict[str, object] = {
        "job_id": job_id,
        "state": "failed",
        "agent": agent or None,
        "reason": oneline(f"recovery: the job folder cannot be read back: {type(exc).__name__}: {exc}"),
        "checks": [],
        "attempts": [],
        "received": iso(now),
        "finished": iso(now),
        "parent": None,
        "children": [],
    }
    try:
        fsutil.write_atomic(folder / "result.json", fsutil.dump_json(result))
        fsutil.rename_noreplace(folder, layout.job(State.FAILED, job_id))
        fsutil.fsync_dir(layout.folder(State.FAILED))
        ledger.finish(job_id, FAILED)
        log.warning("job.failed", job_id=job_id, agent=agent or None, reason=result["reason"])
    except OSError:
        log.exception("job.crashed", job_id=job_id, step="fail_damaged")


def end_leftover_agent(job_folder: Path, grace_s: float) -> None:
    """End whatever still runs of the last attempt of a job whose daemon died."""
    attempts = job_folder / "attempts"
    dirs = [p for p in attempts.iterdir() if p.name.isdigit()] if attempts.is_dir() else []
    if dirs:
        end_leftover(max(dirs, key=lambda p: int(p.name)), job_folder / "work", grace_s)


def end_leftover(folder: Path, work: Path, grace_s: float) -> None:
    """End an agent still running from a dead daemon, before its job is looked at.

    With a pid file: its group is ended if the leader runs with the recorded start
    time, or if the leader is gone but members remain (a pid is not reused while
    its group lives). A live leader with another start time is someone else: its
    group is left alone. Without a pid file (a crash between the spawn and the
    record), processes whose working folder is this job's work/ are ended.
    """
    info = _read_json(folder / "pid")
    if info:
        pid, started = int(info["pid"]), info.get("started")
        if procs.is_alive(pid, started) or (not procs.is_alive(pid) and procs.group_members(pid)):
            log.warning("agent.orphan_ended", pid=pid)
            procs.end_group(pid, grace_s)
        return
    for pid in procs.with_cwd(str(work)):
        log.warning("agent.orphan_ended", pid=pid, found_by="cwd")
        try:
            procs.end_group(os.getpgid(pid), grace_s)
        except ProcessLookupError:
            continue


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def reopen(layout: Layout, ledger: Ledger, owner: str, job_id: str) -> dict[str, Any] | None:
    """Move a failed job back to active/ for `dispatcher retry`; return its new spec.

    Order, for crashes: the ledger claim; the earlier result.json into
    attempts/<n>/ (never over an older one); the new attempt budget in
    job.json; the rename into active/; then the request is cleared. A reopen cut
    short at any step is finished later: ``settle_ledger`` puts a claim whose
    folder is still in failed/ back to failed (the request stays), and a job
    found in active/ with a kept result goes on with a new attempt.
    Returns None if another daemon took it first.
    """
    if not ledger.take_retry(job_id, owner):
        return None
    src = layout.job(State.FAILED, job_id)
    result = src / "result.json"
    spec: dict[str, Any] = json.loads((src / claim.JOB_FILE).read_text())
    attempts = src / "attempts"
    numbers = [int(p.name) for p in attempts.iterdir() if p.name.isdigit()] if attempts.is_dir() else []
    last = max(numbers, default=0)
    if result.exists():
        keep_dir = attempts / str(last)
        keep_dir.mkdir(parents=True, exist_ok=True)
        keep, k = keep_dir / "result.json", 2
        while keep.exists():
            keep, k = keep_dir / f"result-{k}.json", k + 1
        os.rename(result, keep)
    spec["budget"] = last + int(spec["max_attempts"])
    fsutil.write_atomic(src / claim.JOB_FILE, fsutil.dump_json(spec))
    fsutil.rename_noreplace(src, layout.job(State.ACTIVE, job_id))
    fsutil.fsync_dir(layout.folder(State.ACTIVE))
    ledger.clear_request(job_id, "retry")
    return spec
