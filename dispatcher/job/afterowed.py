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

A job that is final at once (or a revised job that ends without review again)
owes its hook too, but its own daemon holds the marker locked from before the
finish (``own``) and runs the hook itself once the finish is committed (``take``);
one that comes back to review/ keeps the plain marker. So a daemon killed between
the finish (or the decision) and the hook runs it at its next start, or another
daemon on the root does; one killed while the hook runs never runs it twice: the
run is recorded as failed ("interrupted").
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
    "finish",
    "let_go",
    "look",
    "owe",
    "own",
    "record",
    "record_interrupted",
    "run",
    "take",
]

log = structlog.get_logger("dispatcher")
INTERRUPTED = "after hook interrupted by a stop or crash; it is not run again"
MARKERS = owed.Markers(
    "after", ready_in=frozenset({State.DONE, State.FAILED}), settled_in=frozenset(), records=("hooks", "after-")
)
owe = MARKERS.owe
own = MARKERS.own
take = MARKERS.take
let_go = MARKERS.let_go
claim = MARKERS.claim
busy = MARKERS.busy
settle = MARKERS.settle
finish = MARKERS.finish
look = MARKERS.look


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
        "after", hook, path, job_id, agent, result, cfg, io, log_dir=path / "hooks", worktree_first=True,
        keep_fd=MARKERS.held_fd(job_id),
    )  # fmt: skip
    await io(finish, layout, job_id, path, {**done.to_json(), "state": state.value})
    if not done.ok:
        log.warning("hook.failed", hook="after", job_id=job_id, agent=agent.name, reason=done.why)
