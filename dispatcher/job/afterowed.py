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

import time
from pathlib import Path
from typing import Any

import structlog

from dispatcher.clock import iso
from dispatcher.job import owed
from dispatcher.job.owed import RUNNING, Io, Owed, record_run
from dispatcher.layout import Layout
from dispatcher.lifecycle import State
from dispatcher.spec.settings import Config
from dispatcher.store.jobstore import JobFolder

__all__ = [
    "INTERRUPTED",
    "RUNNING",
    "Owed",
    "busy",
    "claim",
    "drop",
    "finish",
    "look",
    "owe",
    "record",
    "record_interrupted",
    "run",
    "running",
]

log = structlog.get_logger("dispatcher")
INTERRUPTED = "after hook interrupted by a stop or crash; it is not run again"
MARKERS = owed.Markers(
    "after", ready_in=frozenset({State.DONE, State.FAILED}), settled_in=frozenset(), records=("hooks", "after-")
)
owe = MARKERS.owe
drop = MARKERS.drop
claim = MARKERS.claim
busy = MARKERS.busy
settle = MARKERS.settle
finish = MARKERS.finish
look = MARKERS.look


def running(layout: Layout, job_id: str) -> None:
    """Mark durably that a final job's own after hook runs now (blocking): a crash meanwhile is recorded as such.

    The marker is made as a claimed one (``<job_id>.running``, locked): a rescan never runs it, and
    the next start records the run as interrupted. ``settle`` drops it once the run is recorded.
    """
    MARKERS.start(layout, job_id)


def record(folder: Path, data: dict[str, Any]) -> None:
    """Write hooks/after-<k>.json in a job folder, never over an earlier one (blocking)."""
    record_run(folder, "hooks", "after-", data)


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
    # the worktree was removed when the job entered review/: the hook runs in the repository, like land
    agent = spec.agent
    result = await io(folder.result)
    done, _values = await owed.run_hook(
        "after", hook, path, job_id, agent, result, cfg, io, log_dir=path / "hooks", worktree_first=True
    )
    await io(finish, layout, job_id, path, {**done.to_json(), "state": state.value})
    if not done.ok:
        log.warning("hook.failed", hook="after", job_id=job_id, agent=agent.name, reason=done.why)
