"""Release the follow-ups of a done job into inbox/ (contract section 6).

Follow-ups are reserved in the ledger, with their lineage, before the parent's
``result.json`` is written; they are released only after the parent is done,
and released again without a duplicate if a daemon died in between.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from dispatcher import fsutil
from dispatcher.errors import OrderError
from dispatcher.evidence import digest
from dispatcher.layout import Layout, State
from dispatcher.ledger import Ledger
from dispatcher.loader import load_document
from dispatcher.orders import order_format, validate_order

log = structlog.get_logger("dispatcher")


def release_followups(layout: Layout, ledger: Ledger, owner: str, parent: str, released: Callable[[str], None]) -> None:
    """Write the reserved follow-ups of a done parent into inbox/, each exactly once.

    Each is the outbox order with ``parent`` and ``hops`` from the ledger, as JSON,
    linked into inbox/ under a name that replaces nothing; the same bytes found
    there already (a release cut short by a crash) count as released.
    """
    for entry in ledger.pending_releases(parent):
        folder = layout.job(State.DONE, parent)
        src = folder / "work" / "outbox" / (entry.source or "")
        try:
            body = dict(validate_order(_load_any(src)).body)
        except (OSError, OrderError, ValueError) as exc:
            log.error("followup.lost", job_id=entry.job_id, parent=parent, error=str(exc))
            continue
        body["parent"] = parent
        body["hops"] = entry.hops
        data = fsutil.dump_json(body)
        sha = digest(data)
        ledger.set_digest(entry.job_id, sha)
        name = _place_in_inbox(layout, owner, entry.job_id, data, sha)
        ledger.mark_released(entry.job_id, name, sha)
        log.info(
            "followup.released",
            job_id=entry.job_id,
            parent=parent,
            hops=entry.hops,
            file=name,
            agent=body.get("to"),
        )
        released(name)


def _load_any(path: Path) -> Any:
    return load_document(fsutil.read_regular(path), order_format(path.name) or "json")


def _place_in_inbox(layout: Layout, owner: str, job_id: str, data: bytes, sha: str) -> str:
    """Link the follow-up into inbox/ under a name that replaces nothing; reuse our own copy."""
    inbox = layout.inbox
    tmp = layout.staging / f"{owner}.release-{job_id}"
    tmp.unlink(missing_ok=True)
    fsutil.write_new(tmp, data, sync=True)
    try:
        n = 1
        while True:
            name = f"{job_id}.json" if n == 1 else f"{job_id}-{n}.json"
            try:
                os.link(tmp, inbox / name)
                fsutil.fsync_dir(inbox)
                return name
            except FileExistsError:
                with contextlib.suppress(OSError, fsutil.NotRegular, ValueError):
                    if digest(fsutil.read_regular(inbox / name)) == sha:
                        return name
                n += 1
    finally:
        tmp.unlink(missing_ok=True)
