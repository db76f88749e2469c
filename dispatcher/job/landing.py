"""The ``land`` hook, exactly once after a job is done (contract section 15).

A job whose agent has a ``land`` hook owes a landing from the moment it passes its
checks: ``.state/landing/<job_id>`` is written durably before its finish is
committed. Once the job is in done/ (at once, or after `approve`), the marker is
renamed to ``<job_id>.running`` (the claim: one rename wins), the hook runs, its
record is written as ``land/<k>.json`` in the job folder, and the marker goes.

So a daemon killed between "done" and the hook's start lands the job at its next
start; one killed while the hook runs never runs it twice on its own: the landing is
recorded as failed ("interrupted") and `dispatcher land ID` runs it again.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import structlog

from dispatcher import faults, fsutil
from dispatcher.clock import iso
from dispatcher.job import hooks
from dispatcher.job.runner import build_env, dispatch_env
from dispatcher.job.worktree import read_record
from dispatcher.layout import Layout
from dispatcher.lifecycle import State
from dispatcher.spec.settings import Config
from dispatcher.store.jobstore import JobFolder

log = structlog.get_logger("dispatcher")
T = TypeVar("T")
RUNNING = ".running"
Io = Callable[..., Awaitable[Any]]


class Notify(Protocol):
    """Where ``land.failed`` is notified (``core.notify.Notifications``)."""

    def fire(self, event: str, job_id: str | None, agent: str | None, reason: str | None, result: Path | None) -> None:
        """Queue the notify command for one event."""


def _dir(layout: Layout) -> Path:
    return layout.state_dir / "landing"


def owe(layout: Layout, job_id: str) -> None:
    """Record durably that job_id owes a landing (before its finish is committed; blocking)."""
    folder = _dir(layout)
    fsutil.make_dirs(folder)  # the first landing of a root: the folder's name is part of the record
    if not (folder / job_id).exists():
        fsutil.write_atomic(folder / job_id, b"")


def claim(layout: Layout, job_id: str) -> bool:
    """Take the landing of job_id (one rename wins); False when it is not owed or another run holds it."""
    folder = _dir(layout)
    try:
        os.rename(folder / job_id, folder / f"{job_id}{RUNNING}")
    except FileNotFoundError:
        return False
    fsutil.fsync_dir(folder)
    return True


def settle(layout: Layout, job_id: str) -> None:
    """Drop the landing's marker (its record is written)."""
    folder = _dir(layout)
    for name in (job_id, f"{job_id}{RUNNING}"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder / name)
    fsutil.fsync_dir(folder)


@dataclass(frozen=True, slots=True)
class Owed:
    """What a pass over the markers found: jobs to land now, and landings a crash cut short."""

    ready: list[str]
    interrupted: list[str]


def look(layout: Layout, *, startup: bool) -> Owed:
    """Sort the markers (blocking): done jobs land now, failed ones owe nothing, others wait.

    At start, a ``.running`` marker is a landing a crash cut short: it is not run again.
    """
    try:
        names = sorted(os.listdir(_dir(layout)))
    except FileNotFoundError:
        return Owed([], [])
    ready, interrupted = [], []
    for name in names:
        if name.endswith(RUNNING):
            if startup:
                interrupted.append(name[: -len(RUNNING)])
            continue
        found = layout.find(name)
        if found is not None and found[0] is State.DONE:
            ready.append(name)
        elif found is None or found[0] is State.FAILED:
            settle(layout, name)
    return Owed(ready, interrupted)


def record_run(folder: Path, sub: str, prefix: str, data: dict[str, Any]) -> Path:
    """Write <sub>/<prefix><k>.json in a job folder, never over an earlier one (blocking)."""
    out = folder / sub
    out.mkdir(exist_ok=True)
    k = 1
    while (out / f"{prefix}{k}.json").exists():
        k += 1
    fsutil.write_atomic(out / f"{prefix}{k}.json", fsutil.dump_json(data))
    return out / f"{prefix}{k}.json"


def record_interrupted(layout: Layout, job_id: str) -> None:
    """Record a landing a crash cut short as failed, and drop its marker (blocking)."""
    found = layout.find(job_id)
    if found is not None:
        now = time.time()
        why = "land hook interrupted by a stop or crash; `dispatcher land ID` runs it again"
        record_run(found[1], "land", "", {"hook": "land", "ok": False, "detail": why, "ended": iso(now)})
    settle(layout, job_id)


async def land(layout: Layout, job_id: str, cfg: Config, io: Io, notify: Notify | None = None) -> bool:
    """Run job_id's land hook once (its landing claimed already), record and log it; True when it landed."""
    path = layout.job(State.DONE, job_id)
    folder = JobFolder(path)
    spec = await io(folder.spec)
    hook = spec.agent.repo.land
    if hook is None:
        await io(settle, layout, job_id)
        return True
    ws = await io(read_record, path)
    result = await io(folder.result)
    wsr = result.extra.get("workspace") if result is not None else None
    wsr = wsr if isinstance(wsr, dict) else {}
    values = {
        "job_id": job_id,
        "workspace": ws.path if ws is not None else str(folder.work),
        "branch": ws.branch if ws is not None else "",
        "head": str(wsr.get("head") or ""),
        "result": str(path / "result.json"),
    }
    cwd = Path(ws.repo) if ws is not None and os.path.isdir(ws.repo) else folder.work
    agent = spec.agent
    env = build_env(agent.env, dispatch_env(job_id, folder.work, 0, Path(values["workspace"])), agent.pass_env)
    faults.point("land.started")
    run = await hooks.run_hook(
        "land", hook, values, cwd=cwd, env=env, kill_grace_s=cfg.kill_grace_s,
        log_dir=path / "land", max_log_bytes=cfg.max_log_bytes,
    )  # fmt: skip
    await io(record_run, path, "land", "", run.to_json())
    await io(settle, layout, job_id)
    if run.ok:
        log.info("job.landed", job_id=job_id, agent=agent.name, head=values["head"] or None)
        return True
    log.warning("land.failed", job_id=job_id, agent=agent.name, reason=run.why)
    if notify is not None:
        notify.fire("land.failed", job_id, agent.name, run.why, path / "result.json")
    return False
