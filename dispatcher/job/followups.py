"""Release the follow-ups of a done job into inbox/ (contract sections 6 and 11).

Follow-ups are reserved in the ledger with their lineage before the parent's
result is written; they are released only after the parent is done, and
released again without a duplicate if a daemon died in between. A follow-up
whose chain already cost more than ``max_chain_cost_usd`` goes to held/
instead (``budget.held``), for an operator to ``release``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import structlog

from dispatcher import faults, fsutil
from dispatcher.errors import OrderError
from dispatcher.fsutil import digest
from dispatcher.layout import Layout
from dispatcher.ledger.base import Entry, Ledger
from dispatcher.ledger.releasers import releaser
from dispatcher.lifecycle import State
from dispatcher.spec.loader import load_document
from dispatcher.spec.orders import order_format, validate_order

log = structlog.get_logger("dispatcher")
# one release at a time in a process: a daemon finishing a decision and its housekeeping's release of
# orphaned follow-ups may take the same parent at once, and the second must see the first's marks
_RELEASING = threading.Lock()


def release_followups(
    layout: Layout,
    ledger: Ledger,
    parent: str,
    *,
    max_chain_cost_usd: float | None = None,
    released: Callable[[str], None] = lambda name: None,
    held: Callable[[Entry, str], None] = lambda entry, name: None,
) -> int:
    """Write the reserved follow-ups of a done parent into inbox/ (or held/), each exactly once.

    Each is the outbox order with ``parent`` and ``hops`` from the ledger, as JSON,
    linked in under a name that replaces nothing; the same bytes found there
    already (a release cut short by a crash) count as released. Returns how many.
    Releases in one process take turns: the pending rows are read under the turn, so a
    follow-up another thread released (and a daemon may have claimed already) is not
    linked into inbox/ a second time. Between processes, on any host, each follow-up's
    turn is taken in the ledger first (``Ledger.take_release``): one that another live
    process holds is left to it.
    """
    with _RELEASING:
        return _release(layout, ledger, parent, max_chain_cost_usd, released, held)


def _release(
    layout: Layout,
    ledger: Ledger,
    parent: str,
    max_chain_cost_usd: float | None,
    released: Callable[[str], None],
    held: Callable[[Entry, str], None],
) -> int:
    done = layout.job(State.DONE, parent)
    if layout.job(State.REVIEW, parent).is_dir() or layout.job(State.ACTIVE, parent).is_dir():
        # approved, not yet moved into done/ (by the command, or by settle_reviews), or done and not moved yet (its
        # place in done/ taken: job.stuck): released once it lands, never from what stands at done/<id> meanwhile
        return 0
    count = 0
    for entry in ledger.pending_releases(parent):
        work = done / "work"
        try:
            data = fsutil.read_regular(work / "outbox" / (entry.source or ""), 1 << 24, base=work)
            body = dict(validate_order(load_document(data, order_format(entry.source or "") or "json")).body)
        except (OSError, OrderError, ValueError, fsutil.NotRegular) as exc:
            log.error("followup.lost", job_id=entry.job_id, agent=entry.agent, parent=parent, error=str(exc))
            continue
        body["parent"] = parent
        body["hops"] = entry.hops
        out = fsutil.dump_json(body)
        sha = digest(out)
        if not ledger.take_release(entry.job_id, sha, releaser(ledger.owner)):
            continue  # released by another process (or being released by one that lives): once is enough
        chain = entry.chain_cost_usd  # the parent's chain cost
        over = max_chain_cost_usd is not None and chain is not None and chain > max_chain_cost_usd
        folder = layout.held if over else layout.inbox
        other = layout.inbox if over else layout.held
        found = _copy_in(other, entry.job_id, sha)
        if found is not None:  # a release cut short put it there under another budget: that copy stands
            folder, over, name, made = other, not over, found, None
        else:
            name, made = _place(layout, folder, ledger.owner, entry.job_id, out, sha)
        faults.point("followup.placed")
        if not ledger.mark_released(entry.job_id, name, sha, held=over):
            # no longer reserved: the copy a dead releaser had linked in was claimed while this turn was taken
            # (or the row went with its parent's failure): the copy just made would be a second one, and goes
            if made is not None:
                _unplace(folder, name, made)
            continue
        count += 1
        if over:
            why = {"reason": "held by a release cut short under an earlier max_chain_cost_usd"} if found else {}
            log.warning(
                "budget.held",
                job_id=entry.job_id,
                parent=parent,
                agent=body.get("to"),
                chain_cost_usd=chain,
                max_chain_cost_usd=max_chain_cost_usd,
                file=name,
                **why,
            )
            held(entry, name)
            continue
        log.info(
            "followup.released", job_id=entry.job_id, parent=parent, hops=entry.hops, file=name, agent=body.get("to")
        )
        released(name)
    return count


def _place(
    layout: Layout, folder: Path, owner: str, job_id: str, data: bytes, sha: str
) -> tuple[str, tuple[int, int] | None]:
    """Link the follow-up into folder under a name that replaces nothing; reuse a copy already there.

    Returns the name, and the file's id when this call made the link (None: a copy found there).
    """
    fsutil.make_dirs(folder)  # held/ of a root made before it existed: its name durable before the link
    tmp = layout.staging / f"{owner}.release-{job_id}"
    tmp.unlink(missing_ok=True)
    fsutil.write_new(tmp, data, sync=True)
    made = fsutil.file_id(tmp)
    try:
        n = 1
        while True:
            name = f"{job_id}.json" if n == 1 else f"{job_id}-{n}.json"
            try:
                os.link(tmp, folder / name)
                fsutil.fsync_dir(folder)
                return name, made
            except FileExistsError:
                with contextlib.suppress(OSError, fsutil.NotRegular, ValueError):
                    if digest(fsutil.read_regular(folder / name)) == sha:
                        return name, None
                n += 1
    finally:
        tmp.unlink(missing_ok=True)


def _copy_in(folder: Path, job_id: str, sha: str) -> str | None:
    """Return the name of a copy of the follow-up in folder (as ``_place`` names it), or None."""
    n = 1
    while True:
        name = f"{job_id}.json" if n == 1 else f"{job_id}-{n}.json"
        try:
            if digest(fsutil.read_regular(folder / name)) == sha:
                return name
        except FileNotFoundError:
            return None
        except (OSError, fsutil.NotRegular, ValueError):
            pass
        n += 1


def _unplace(folder: Path, name: str, made: tuple[int, int]) -> None:
    """Remove the copy this release linked in, if the name still holds it (a daemon may have taken it since)."""
    path = folder / name
    if fsutil.file_id(path, follow_symlinks=False) == made:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            fsutil.fsync_dir(folder)
