"""`dispatcher ledger rebuild`: a lost or damaged SQLite ledger made again from the job folders.

Every job folder in active/, review/, done/ and failed/ gives back its row (its
state, agent, lineage and cost), so that every job id found there is refused
again; the follow-ups of a done parent that were never released, and those of a
job waiting in review/, are reserved again (their files are still in its outbox;
`approve` releases a reviewed job's), one already waiting in inbox/ is recorded as
released, and one in held/ (over a chain's budget, or held by hand) as held. The
damaged files are kept beside the new ledger, renamed, never deleted. Nothing may run
while it happens: a live daemon makes it refuse.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from dispatcher import fsutil
from dispatcher.clock import parse_iso, utc_stamp
from dispatcher.errors import UsageError
from dispatcher.fsutil import digest
from dispatcher.layout import Layout
from dispatcher.ledger.base import Entry
from dispatcher.ledger.flocks import owner_alive
from dispatcher.ledger.sqlite import LedgerError, SqliteLedger
from dispatcher.ledger.sqlite_db import locked_elsewhere
from dispatcher.lifecycle import Row, State, state_to_row
from dispatcher.spec.loader import load_document
from dispatcher.spec.orders import order_format
from dispatcher.spec.result import Result
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.queued import find_queued


def live_daemons(layout: Layout) -> list[str]:
    """Return the owners of the daemons alive on this root (their liveness flock is held), or that may be."""
    try:
        names = os.listdir(layout.daemons)
    except (FileNotFoundError, NotADirectoryError):  # no .state/daemons/ (or .state is no folder): no daemon
        return []
    # by its lock, or its info file alone (a lock file deleted under a live daemon)
    owners = sorted({n.rsplit(".", 1)[0] for n in names if n.endswith((".lock", ".json")) and not n.startswith(".")})
    return [o for o in owners if owner_alive(layout.daemons, o) is not False]  # None: this user cannot tell


def rebuild(layout: Layout) -> dict[str, int]:
    """Rebuild the ledger from the folders; return how many rows of each state were written."""
    alive = live_daemons(layout)
    if alive:
        raise UsageError(f"{layout.root}: a daemon is running ({alive[0]}); stop every daemon, then rebuild")
    if os.path.exists(layout.ledger) and locked_elsewhere(layout.ledger):  # in use: not damaged, never set aside
        raise UsageError(
            f"{layout.ledger}: the ledger is locked by another process, not damaged; rebuild only a lost or damaged"
            " one (find the holder with `fuser` or `lsof`; the commands work again once it lets go)"
        )
    try:
        _keep_aside(layout.ledger)
        fsutil.make_dirs(layout.ledger.parent)  # .state/ lost with the ledger: made again, durably
        ledger = SqliteLedger(layout.ledger, layout.state_dir)
    except LedgerError as exc:
        raise UsageError(f"{layout.ledger}: the ledger cannot be made ({exc})") from None
    except OSError as exc:
        raise UsageError(f"{layout.ledger}: the ledger cannot be made ({exc.strerror})") from None
    counts: dict[str, int] = {}
    try:
        rows: list[Entry] = []
        pending: list[tuple[str, JobFolder]] = []
        now = time.time()
        for state in State:
            for job_id in _job_ids(layout, state):
                folder = JobFolder(layout.job(state, job_id))
                rows.append(_row(folder, state, now))
                if state in (State.DONE, State.REVIEW):  # a reviewed job's follow-ups wait for its approval
                    pending.append((job_id, folder))
        known = {r.job_id for r in rows}
        children = [c for parent, folder in pending for c in _children(parent, folder, known, now)]
        ids = [c.job_id for c in children]
        placed = [(layout.inbox, Row.RELEASED, find_queued(layout.inbox, ids))]
        placed.append((layout.held, Row.HELD, find_queued(layout.held, ids)))  # over budget, or held by hand
        for child in children:
            for where, row, found in placed:
                name = found.get(child.job_id)
                if name is not None:  # released before the ledger was lost: its file waits in inbox/ (or held/)
                    data = fsutil.read_regular(where / name, 1 << 24)
                    child = dataclasses.replace(child, state=row, source=name, digest=digest(data))
                    break
            rows.append(child)
        ledger.load_rows(rows)
        for r in rows:
            counts[r.state] = counts.get(r.state, 0) + 1
    finally:
        ledger.close()
    return counts


def _keep_aside(path: Path) -> None:
    """Rename the old ledger files (never delete them), so a new empty one can be made."""
    stamp = utc_stamp()
    for suffix in ("", "-wal", "-shm"):
        old = Path(f"{path}{suffix}")
        if os.path.lexists(old):
            os.rename(old, Path(f"{path}.damaged-{stamp}{suffix}"))


def _job_ids(layout: Layout, state: State) -> list[str]:
    try:
        names = os.listdir(layout.folder(state))
    except FileNotFoundError:
        return []
    return sorted(n for n in names if not n.startswith(".") and "@" not in n)  # "@": refused files


def _row(folder: JobFolder, state: State, now: float) -> Entry:
    result = folder.result() or Result(folder.job_id, None, None, None)
    try:
        spec = folder.spec()
        agent: str | None = spec.agent.name
        parent, hops = spec.parent, spec.hops
    except ValueError:
        agent, parent, hops = result.agent, result.parent, 0
    row = state_to_row(state, result.state)
    # a finished job's row changed last at its finish (its age in `list`, the 24 h spend): not at this rebuild
    finished = _time(result.finished)
    updated = now if finished is None else finished
    return Entry(
        folder.job_id, row, agent, None, 1, None, None, parent, hops, result.cost_usd, result.chain_cost_usd, updated,
        _spent(result, updated),
    )  # fmt: skip


def _spent(result: Result, updated: float) -> float | None:
    """Return when a rebuilt job's cost was counted, if not at ``updated`` (its ``finished``): for a job whose
    review was decided, when it entered review (``review_since``, kept by the decision); else None."""
    if result.cost_usd is None:
        return None
    at = _time(result.extra.get("review_since"))
    last = _time(result.attempts[-1].get("ended")) if result.attempts else None
    if at is None or at >= updated or (last is not None and at < last):  # not after its last attempt: stale
        return None
    return at


def _time(value: object) -> float | None:
    """Return an ISO 8601 time of result.json as seconds, or None when it is missing or odd."""
    try:
        return parse_iso(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _children(parent: str, folder: JobFolder, known: set[str], now: float) -> list[Entry]:
    """Return reservations for the follow-ups of a done (or reviewed) parent that have no folder yet."""
    result = folder.result()
    wanted = [c for c in (result.children if result else ()) if c not in known]
    if not wanted:
        return []
    try:
        hops = folder.spec().hops + 1
    except ValueError:
        hops = 1
    out = []
    outbox = folder.work / "outbox"
    try:
        names = sorted(os.listdir(outbox))
    except OSError:
        return []
    for name in names:
        fmt = order_format(name)
        if fmt is None:
            continue
        try:
            body = load_document(fsutil.read_regular(outbox / name, 1 << 24, base=folder.work), fmt)
        except (OSError, ValueError, fsutil.NotRegular, Exception):  # noqa: BLE001, S112 - an odd file is skipped
            continue
        job_id = body.get("job_id") if isinstance(body, dict) else None
        if job_id in wanted:
            agent = body.get("to") if isinstance(body.get("to"), str) else None
            out.append(Entry(job_id, Row.RESERVED, agent, None, 0, name, None, parent, hops, None, None, now))
    return out
