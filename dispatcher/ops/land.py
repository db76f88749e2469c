"""`dispatcher land ID...`: run a done job's ``land`` hook again (contract section 15).

The hook runs in the foreground, like the daemon runs it (own process group,
timeout, environment rules), and its run is recorded in the job folder as the
daemon records it; a landing a daemon is running now is not started twice.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import structlog

from dispatcher import procs
from dispatcher.errors import NotFound, WrongState
from dispatcher.job import afterowed, landing
from dispatcher.layout import Layout, check_id
from dispatcher.ledger.base import Ledger
from dispatcher.lifecycle import State
from dispatcher.spec.settings import Config
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.queued import find_queued
from dispatcher.text import is_count

log = structlog.get_logger("dispatcher")


async def _direct(fn: Any, *args: Any) -> Any:
    return fn(*args)


class _Notified:
    """``landing.Notify`` for a command: each event's notify command is started apart (``job.notice``)."""

    def __init__(self, cfg: Config, layout: Layout) -> None:
        self.cfg, self.layout = cfg, layout

    def fire(self, event: str, job_id: str | None, agent: str | None, reason: str | None, result: Path | None) -> None:
        """Start the config's notify command for the event and return at once."""
        from dispatcher.job.notice import Apart, start_detached

        cfg = self.cfg
        start_detached(Apart(cfg.notify or (), cfg.kill_grace_s, cfg.log_file), self.layout.root, event, job_id,
                       agent, reason, result)  # fmt: skip


def land_again(cfg: Config, layout: Layout, job_id: str, ledger: Ledger | None = None) -> str:
    """Run job_id's land hook now; return the line to print; raise NotFound or WrongState.

    ``ledger``: to name a job's state as the listings do (a gated job in active/ is waiting).
    """
    check_id(job_id)  # before it names a folder or a file
    found = layout.find(job_id)
    if found is None:
        only = "not done (only a done job lands)"
        if find_queued(layout.inbox, [job_id]):  # known, as `show` shows it: the state, as retry and approve say it
            raise WrongState(f"{job_id}: is queued, {only}")
        if find_queued(layout.held, [job_id]):
            raise WrongState(f"{job_id}: is held, {only}")
        raise NotFound(f"{job_id}: no such job")
    state, path = found
    if state is not State.DONE:
        said = ledger.spoken_state(state, job_id) if ledger is not None else state.value
        raise WrongState(f"{job_id}: is {said}, not done (only a done job lands)")
    try:
        spec = JobFolder(path).spec()
    except ValueError:
        raise WrongState(f"{job_id}: its job.json is damaged; it cannot be landed") from None
    if landing.current_agent(cfg, spec.agent).repo.land is None:  # the hook as the config has it now, as `retry`
        raise WrongState(f"{job_id}: its agent has no land hook")
    if os.path.lexists(layout.state_dir / "landing" / f"{job_id}{landing.RUNNING}"):
        _record_cut_run(layout, job_id, spec.agent.name, path, _Notified(cfg, layout))
    if spec.agent.repo.after is not None:  # the landing comes after it, and after its record
        after_dir = afterowed.MARKERS.folder(layout)
        if os.path.lexists(after_dir / job_id):
            raise WrongState(f"{job_id}: its after hook has not run yet; a daemon lands the job once it has")
        if os.path.lexists(after_dir / f"{job_id}{afterowed.RUNNING}"):
            raise WrongState(
                f"{job_id}: its after hook runs, or a crash cut it and it is not recorded yet;"
                " a daemon lands the job after it"
            )
    if os.path.lexists(layout.worktree(job_id)):
        raise WrongState(f"{job_id}: its worktree is still there; a daemon removes it, then lands the job")
    last = JobFolder(path).read_json(_last_record(path))
    if isinstance(last, dict) and last.get("ok") is True:  # the hook runs once; again only after it failed
        raise WrongState(f"{job_id}: landed already; `land` runs the hook again only after it failed")
    landing.owe(layout, job_id)
    if not landing.claim(layout, job_id):
        raise WrongState(f"{job_id}: is landing now")
    ok = asyncio.run(landing.land(layout, job_id, cfg, _direct, _Notified(cfg, layout), as_configured=True))
    if not ok:
        last = JobFolder(path).read_json(_last_record(path)) or {}
        raise WrongState(f"{job_id}: land failed: {last.get('detail') or 'see land/ in the job folder'}")
    return f"{job_id}: landed"


def _record_cut_run(layout: Layout, job_id: str, agent: str, path: Path, notify: landing.Notify) -> None:
    """Record the job's last landing if it ended or was cut short with no daemon since; raise while it runs.

    A hook's processes hold its ``.running`` marker's lock: a marker no process holds is a run
    whose daemon (or `dispatcher land`) died with it. It is recorded here as a daemon's pass
    records it (``land.failed``, interrupted and notified; or the record of a run that ended), so that a
    `land` killed while no daemon runs does not leave the job "landing" until one starts.
    What of the run still runs without the lock (found by its ``DISPATCH_*`` variables) is left
    to a daemon, which ends it first: the landing is not run beside it.
    """
    record = landing.MARKERS.ended(layout, job_id)
    if record == {}:
        if os.path.lexists(layout.state_dir / "landing" / f"{job_id}{landing.RUNNING}"):
            raise WrongState(f"{job_id}: is landing now")
        return  # recorded meanwhile by a daemon's pass
    if record is None:
        if any(procs.job_groups({job_id: str(path / "work")}).values()):
            landing.MARKERS.let_go(job_id)
            raise WrongState(f"{job_id}: is landing now")
        landing.record_interrupted(layout, job_id)
        log.warning("land.failed", job_id=job_id, agent=agent, reason=landing.INTERRUPTED)
        notify.fire("land.failed", job_id, agent, landing.INTERRUPTED, path / "result.json")
    elif record.get("ok") is True:
        result = JobFolder(path).result()
        wsr = result.extra.get("workspace") if result is not None else None
        head = wsr.get("head") if isinstance(wsr, dict) else None
        log.info("job.landed", job_id=job_id, agent=agent, head=head or None)
    else:
        detail = record.get("detail")
        log.warning("land.failed", job_id=job_id, agent=agent, reason=detail)
        notify.fire("land.failed", job_id, agent, detail if isinstance(detail, str) else None, path / "result.json")


def _last_record(path: Any) -> str:
    names = sorted((p.name for p in (path / "land").glob("*.json") if is_count(p.name.split(".")[0])),
                   key=lambda n: int(n.split(".")[0]))  # fmt: skip
    return f"land/{names[-1]}" if names else "land/1.json"
