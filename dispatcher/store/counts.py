"""How many orders and jobs each state folder holds, from folder listings alone (no file opened).

Used by `status` and by the metrics' ``dispatcher_queue`` gauge; it lists folders, so the
daemon calls it off the loop.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from dispatcher.layout import Layout, is_ignored, is_job_entry
from dispatcher.lifecycle import State

#: the states `status` counts; `failed` is failed jobs, `refused` refused files
COUNTED = ("inbox", "held", "active", "waiting", "review", "done", "failed", "refused")
#: the states `list --state` takes
LIST_STATES = COUNTED


def visible_entries(folder: Path) -> Iterator[os.DirEntry[str]]:
    """Yield the entries of folder whose names do not start with '.' (none if the folder is missing)."""
    try:
        with os.scandir(folder) as it:
            for de in it:
                if not de.name.startswith("."):
                    yield de
    except FileNotFoundError:
        return


def orders_in(folder: Path) -> int:
    """Return how many order files (not hidden, not temporary) a folder holds."""
    return sum(1 for de in visible_entries(folder) if not is_ignored(de.name))


def job_entries(folder: Path) -> Iterator[os.DirEntry[str]]:
    """Yield the job (and refusal) folders of a state folder: its folders not hidden, no stray file."""
    return (de for de in visible_entries(folder) if is_job_entry(de))


def jobs_and_refusals(folder: Path) -> tuple[int, int]:
    """Return (jobs, refused files) in a state folder: refusal folders have '@' in their names."""
    jobs = refused = 0
    for de in job_entries(folder):
        if "@" in de.name:
            refused += 1
        else:
            jobs += 1
    return jobs, refused


def queue_counts(layout: Layout) -> dict[str, int]:
    """Return how many orders wait in inbox/ and held/ and how many jobs are in active/, waiting/ and review/.

    Cheap (one directory listing each, no file opened), for the metrics'
    ``dispatcher_queue`` gauge; it still lists folders, so call it off the loop.
    """
    return {
        "inbox": orders_in(layout.inbox),
        "held": orders_in(layout.held),
        "active": jobs_and_refusals(layout.folder(State.ACTIVE))[0],
        "waiting": jobs_and_refusals(layout.folder(State.WAITING))[0],
        "review": jobs_and_refusals(layout.folder(State.REVIEW))[0],
    }


def state_counts(layout: Layout) -> dict[str, int]:
    """Return the counts of `status`: the queue, done and failed jobs, and refused files."""
    counts = queue_counts(layout)
    counts["done"] = jobs_and_refusals(layout.folder(State.DONE))[0]
    counts["failed"], counts["refused"] = jobs_and_refusals(layout.folder(State.FAILED))
    return {k: counts[k] for k in COUNTED}
