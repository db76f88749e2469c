"""The ``land`` hook, exactly once after a job is done (contract section 15).

A job whose agent has a ``land`` hook owes a landing from the moment it passes its
checks: ``.state/landing/<job_id>`` is written durably before its finish is
committed.
Once the job is in done/ (at once, or after `approve`), the marker is
renamed to ``<job_id>.running`` (the claim: one rename wins), the hook runs, its
record is written as ``land/<k>.json`` in the job folder, and the marker goes.

So a daemon killed between "done" and the hook's start lands the job at its next
start; one killed while the hook runs never runs it twice on its own: the landing is
recorded as failed ("interrupted") and `dispatcher land ID` runs it again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

import structlog

from dispatcher.clock import iso
from dispatcher.job import owed
from dispatcher.job.owed import RUNNING, Io, Owed, record_run
from dispatcher.layout import Layout
from dispatcher.lifecycle import State
from dispatcher.spec.settings import Agent, Config
from dispatcher.store.jobstore import JobFolder

__all__ = [
    "INTERRUPTED",
    "RUNNING",
    "Io",
    "Notify",
    "Owed",
    "claim",
    "land",
    "look",
    "owe",
    "record_interrupted",
    "record_run",
    "settle",
    "take",
]

log = structlog.get_logger("dispatcher")
INTERRUPTED = "land hook interrupted by a stop or crash; `dispatcher land ID` runs it again"
MARKERS = owed.Markers(
    "landing", ready_in=frozenset({State.DONE}), settled_in=frozenset({State.FAILED}), records=("land", "")
)
owe = MARKERS.owe
take = MARKERS.take
claim = MARKERS.claim
settle = MARKERS.settle
look = MARKERS.look


class Notify(Protocol):
    """Where ``land.failed`` is notified (``core.notify.Notifications``)."""

    def fire(self, event: str, job_id: str | None, agent: str | None, reason: str | None, result: Path | None) -> None:
        """Queue the notify command for one event."""


def record_interrupted(layout: Layout, job_id: str) -> None:
    """Record a landing a crash cut short as failed, and drop its marker (blocking)."""
    found = layout.find(job_id)
    if found is not None:
        now = time.time()
        record_run(found[1], "land", "", {"hook": "land", "ok": False, "detail": INTERRUPTED, "ended": iso(now)})
    settle(layout, job_id)


async def land(
    layout: Layout, job_id: str, cfg: Config, io: Io, notify: Notify | None = None, *, as_configured: bool = False
) -> bool:
    """Run job_id's land hook once (its landing claimed already), record and log it; True when it landed.

    The hook and the agent's settings are those the job was claimed with (``job.json``); with
    ``as_configured`` (`dispatcher land ID`, run again by hand after it failed) those the config has
    now for the job's agent, as a `retry` takes them: a fixed hook takes effect.
    """
    path = layout.job(State.DONE, job_id)
    folder = JobFolder(path)
    spec = await io(folder.spec)
    agent = spec.agent
    if as_configured:
        agent = current_agent(cfg, agent)
    hook = agent.repo.land
    if hook is None:
        await io(settle, layout, job_id)
        return True
    result = await io(folder.result)
    run, values = await owed.run_hook(
        "land", hook, path, job_id, agent, result, cfg, io, log_dir=path / "land", worktree_first=False,
        keep_fd=MARKERS.held_fd(job_id),
    )  # fmt: skip
    await io(MARKERS.finish, layout, job_id, path, run.to_json())
    if run.ok:
        log.info("job.landed", job_id=job_id, agent=agent.name, head=values["head"] or None)
        return True
    log.warning("land.failed", job_id=job_id, agent=agent.name, reason=run.why)
    if notify is not None:
        notify.fire("land.failed", job_id, agent.name, run.why, path / "result.json")
    return False


def current_agent(cfg: Config, agent: Agent) -> Agent:
    """Return the config's agent of that name if it has one, else the job's own (``job.json``)."""
    now = cfg.agents.get(agent.name)
    return now if now is not None else agent
