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


def job_entries(folder: Path) -> Iterator[os.DirEntry[str]]:
    """Yield the job (and refusal) folders of a state folder: its folders not hidden, no stray file."""
    return (de for de in visible_entries(folder) if is_job_entry(de))


#: the job folders counted, in the order they are listed (the order a job moves through most of them)
_JOB_STATES = (State.ACTIVE, State.WAITING, State.REVIEW, State.DONE, State.FAILED)


def _snapshot(layout: Layout, states: tuple[State, ...]) -> dict[str, int]:
    """Count orders and jobs by state, each once though it moved from one listed folder into a later one.

    The folders are listed one after another, so a job that moves between two listings
    (active/ to done/, an order claimed from inbox/) is seen in both. A job id is counted
    in the folder listed last that held it, where it is now; a file in inbox/ that is the
    very file of a job found in active/ or waiting/ (its ``order.<ext>`` is a link of it,
    made by the claim before the inbox name goes) is that job, just claimed, whatever its
    name. A file there that only bears such a job's name is an order of its own, counted.
    """
    inbox = [(de.name, de.inode()) for de in visible_entries(layout.inbox) if not is_ignored(de.name)]
    held = sum(1 for de in visible_entries(layout.held) if not is_ignored(de.name))
    where: dict[str, State] = {}
    refused = 0
    for state in states:
        for de in job_entries(layout.folder(state)):
            if "@" in de.name:  # a refused file's folder (failed/ only): no job
                refused += state is State.FAILED
                continue
            where.pop(de.name, None)  # the last place a listing saw it, in order
            where[de.name] = state

    taken = _claims_of(layout, where) if inbox else set()
    counts = {"inbox": sum(1 for _name, inode in inbox if inode not in taken), "held": held, "refused": refused}
    for state in states:
        counts[state.value] = 0
    for state in where.values():
        counts[state.value] += 1
    return counts


def queue_counts(layout: Layout) -> dict[str, int]:
    """Return how many orders wait in inbox/ and held/ and how many jobs are in active/, waiting/ and review/.

    Cheap (one directory listing each, no file opened), for the metrics'
    ``dispatcher_queue`` gauge; it still lists folders, so call it off the loop.
    """
    counts = _snapshot(layout, (State.ACTIVE, State.WAITING, State.REVIEW))
    return {k: counts[k] for k in ("inbox", "held", "active", "waiting", "review")}


def state_counts(layout: Layout) -> dict[str, int]:
    """Return the counts of `status`: the queue, done and failed jobs, and refused files."""
    counts = _snapshot(layout, _JOB_STATES)
    return {k: counts[k] for k in COUNTED}


#: at most this many jobs in active/ and waiting/ are looked at for the claim's link (one lstat or three each)
CLAIMS_LOOKED_AT = 1000


def _claims_of(layout: Layout, where: dict[str, State]) -> set[int]:
    """Return the inodes of the order files of the jobs in active/ and waiting/ (the first CLAIMS_LOOKED_AT)."""
    out: set[int] = set()
    jobs = [(name, state) for name, state in where.items() if state in (State.ACTIVE, State.WAITING)]
    for name, state in jobs[:CLAIMS_LOOKED_AT]:
        folder = layout.folder(state) / name
        for ext in ("json", "yaml", "yml"):
            try:
                out.add(os.lstat(folder / f"order.{ext}").st_ino)
                break
            except OSError:
                continue
    return out
