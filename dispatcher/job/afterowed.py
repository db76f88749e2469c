"""The ``after`` hook of a job that waits in review/: owed until a person decides (contract section 15).

``after`` runs once the job is final, and a job in review/ is not: `approve`
(to done/) or `reject` (to failed/) makes it final, `revise` sends it back for
another attempt. So a job entering review/ owes its ``after`` hook:
``.state/after/<job_id>`` is written durably before its finish is committed, and
no hook runs then. Once the job is in done/ or failed/, a daemon (at start, at
each rescan, and at once when `approve` or `reject` drops its hint) renames the
marker to ``<job_id>.running`` (the claim: one rename wins), runs the hook,
records it as ``hooks/after-<k>.json`` in the job folder and drops the marker.
A decision made with no daemon running is carried out by the next one to start.

A revised job that ends without review again (it failed, it was cancelled)
drops the marker before its own finish is committed and runs its hook itself, as
any job does; one that comes back to review/ keeps it. So a daemon killed between
the decision and the hook runs it at its next start; one killed while the hook
runs never runs it twice: the run is recorded as failed ("interrupted").
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
RUNNING = ".running"
Io = Callable[..., Awaitable[Any]]
INTERRUPTED = "after hook interrupted by a stop or crash; it is not run again"


def _dir(layout: Layout) -> Path:
    return layout.state_dir / "after"


def owe(layout: Layout, job_id: str) -> None:
    """Record durably that job_id owes its after hook once decided (before its finish is committed; blocking)."""
    folder = _dir(layout)
    fsutil.make_dirs(folder)
    if not (folder / job_id).exists():
        fsutil.write_atomic(folder / job_id, b"")


def drop(layout: Layout, job_id: str) -> None:
    """Forget an owed hook whose review was revised away (the job runs its own hook; blocking)."""
    folder = _dir(layout)
    try:
        os.unlink(folder / job_id)
    except FileNotFoundError:
        return
    fsutil.fsync_dir(folder)


def claim(layout: Layout, job_id: str) -> bool:
    """Take the owed hook of job_id (one rename wins); False when it is not owed or another run holds it."""
    folder = _dir(layout)
    try:
        os.rename(folder / job_id, folder / f"{job_id}{RUNNING}")
    except FileNotFoundError:
        return False
    fsutil.fsync_dir(folder)
    return True


def settle(layout: Layout, job_id: str) -> None:
    """Drop the marker of job_id (its record is written)."""
    folder = _dir(layout)
    for name in (job_id, f"{job_id}{RUNNING}"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder / name)
    fsutil.fsync_dir(folder)


@dataclass(frozen=True, slots=True)
class Owed:
    """What a pass over the markers found: decided jobs to run now, and runs a crash cut short."""

    ready: list[str]
    interrupted: list[str]


def look(layout: Layout, *, startup: bool) -> Owed:
    """Sort the markers (blocking): jobs in done/ or failed/ run now, others still wait; unknown ones are dropped.

    At start, a ``.running`` marker is a run a crash cut short: it is not run again.
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
        if found is None:
            settle(layout, name)
        elif found[0] in (State.DONE, State.FAILED):
            ready.append(name)
    return Owed(ready, interrupted)


def record(folder: Path, data: dict[str, Any]) -> None:
    """Write hooks/after-<k>.json in a job folder, never over an earlier one (blocking)."""
    out = folder / "hooks"
    out.mkdir(exist_ok=True)
    k = 1
    while (out / f"after-{k}.json").exists():
        k += 1
    fsutil.write_atomic(out / f"after-{k}.json", fsutil.dump_json(data))


def record_interrupted(layout: Layout, job_id: str) -> None:
    """Record a run a crash cut short as failed, and drop its marker (blocking)."""
    found = layout.find(job_id)
    if found is not None:
        data = {"hook": "after", "ok": False, "detail": INTERRUPTED, "ended": iso(time.time()), "state": found[0].value}
        record(found[1], data)
    settle(layout, job_id)


async def run(layout: Layout, job_id: str, cfg: Config, io: Io) -> None:
    """Run the after hook of a decided job (claimed already), record it, drop the marker."""
    found = await io(layout.find, job_id)
    if found is None or found[0] not in (State.DONE, State.FAILED):
        await io(settle, layout, job_id)
        return
    state, path = found
    folder = JobFolder(path)
    spec = await io(folder.spec)
    hook = spec.agent.repo.after
    if hook is None:
        await io(settle, layout, job_id)
        return
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
    # the worktree was removed when the job entered review/: the hook runs in the repository, like land
    cwd = next((Path(p) for p in (values["workspace"], ws.repo if ws else "") if p and os.path.isdir(p)), folder.work)
    agent = spec.agent
    env = build_env(agent.env, dispatch_env(job_id, folder.work, 0, Path(values["workspace"])), agent.pass_env)
    faults.point("after.started")
    done = await hooks.run_hook(
        "after", hook, values, cwd=cwd, env=env, kill_grace_s=cfg.kill_grace_s,
        log_dir=path / "hooks", max_log_bytes=cfg.max_log_bytes,
    )  # fmt: skip
    await io(record, path, {**done.to_json(), "state": state.value})
    await io(settle, layout, job_id)
    if not done.ok:
        log.warning("hook.failed", hook="after", job_id=job_id, agent=agent.name, reason=done.why)
