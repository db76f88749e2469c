"""What `status` reads, and the reads `list` and `show` share: the folders are the truth.

Counts come from listing folders (``os.scandir``, no file opened); owners,
liveness, lineage and costs come from the ledger. Nothing here writes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dispatcher import fsutil
from dispatcher.clock import iso
from dispatcher.errors import OrderError
from dispatcher.layout import Layout
from dispatcher.ledger.base import DaemonInfo, Ledger
from dispatcher.ledger.records import held_until
from dispatcher.lifecycle import State
from dispatcher.spec.loader import load_document
from dispatcher.spec.orders import order_format
from dispatcher.store.counts import job_entries, state_counts
from dispatcher.store.jobstore import JobFolder

#: the window of `status`'s spend per agent
SPEND_WINDOW_S = 24 * 3600.0


def status_with(layout: Layout, ledger: Ledger | None, now: float | None = None) -> dict[str, Any]:
    """Return what `status --json` prints, read through a ledger the caller keeps open (None: no ledger yet)."""
    now = time.time() if now is None else now
    counts = state_counts(layout)
    daemons = ledger.daemons() if ledger else []
    active = active_jobs(layout, ledger, daemons, now)
    spend = spend_since(ledger, now - SPEND_WINDOW_S) if ledger else {}
    gate_waits = ledger.gate_waits() if ledger else {}
    gates = ledger.gates() if ledger else []
    active_ids = {a["job_id"]: a for a in active}
    waiting = []
    for j, own in sorted(gate_waits.items()):
        if j in active_ids:
            u = held_until(own, active_ids[j]["agent"], gates, now)  # a gate moved later holds it longer
            waiting.append({**active_ids[j], "until": iso(u) if u is not None else None})
    counts["waiting"] += len(waiting)  # waiting/ (section 16) and active jobs held by a gate (section 14)
    counts["active"] -= len(waiting)
    if waiting:  # listed as waiting (with their owner), not as active: `active` holds counts["active"] jobs
        gated = {w["job_id"] for w in waiting}
        active = [a for a in active if a["job_id"] not in gated]
    return {
        "counts": counts,
        "waiting": waiting,
        "gates": [
            {
                "agent": g.agent,
                "kind": g.kind,
                "until": iso(g.until) if g.until is not None else None,
                "reason": g.reason,
            }
            for g in gates
            if g.until is None or g.until > now
        ],
        "daemons": [
            {"owner": d.owner, "pid": d.pid, "host": d.host, "alive": d.alive, "started": d.started} for d in daemons
        ],
        "active": active,
        "spend_24h": spend,
    }


def active_jobs(layout: Layout, ledger: Ledger | None, daemons: list[DaemonInfo], now: float) -> list[dict[str, Any]]:
    """Return each job in active/ with its agent, owner daemon's pid and host, age, and whether that daemon lives.

    The owner is the ledger row's ``owner``; a job whose row has none, or whose
    owner is not alive, is flagged ``daemon_alive: false`` (the next daemon to
    start, or a live one, recovers it).
    """
    by_owner = {d.owner: d for d in daemons}
    names = sorted(de.name for de in job_entries(layout.folder(State.ACTIVE)))
    rows = ledger.known(names) if ledger and names else {}
    out = []
    for job_id in names:
        folder = JobFolder(layout.job(State.ACTIVE, job_id))
        try:
            spec = folder.spec()
            agent: str | None = spec.agent.name
            received: float | None = folder.in_state_since(spec)
        except ValueError:
            if not os.path.isdir(folder.path):
                continue  # it finished (or moved on) while this was read: no longer active
            agent, received = None, None
        entry = rows.get(job_id)
        owner = entry.owner if entry is not None else None
        daemon = by_owner.get(owner) if owner else None
        if owner and daemon is None and ledger is not None:
            alive = ledger.alive(owner)
        else:
            alive = daemon is not None and daemon.alive
        out.append(
            {
                "job_id": job_id,
                "agent": agent or (entry.agent if entry else None),
                "pid": daemon.pid if daemon else None,
                "host": daemon.host if daemon else None,
                "age_s": round(now - received, 1) if received is not None else None,
                "daemon_alive": alive,
            }
        )
    return out


def spend_since(ledger: Ledger, since: float) -> dict[str, float]:
    """Return the cost in USD per agent of the jobs that finished since ``since`` (epoch seconds).

    Read from the ledger: each finished row (done, failed, review) carries its
    job's ``cost_usd`` (the sum over its attempts) and ``updated``, the time it
    finished. A job counts whole in the window it finished in; a job run again
    (retry, revise) keeps its earlier attempts' cost counted while it runs, from
    the time it was taken back, and counts whole again when it finishes.
    """
    spend: dict[str, float] = {}
    for _finished, agent, cost_usd in ledger.costs_since(since):  # an index on the finish time: no full scan
        spend[agent] = spend.get(agent, 0.0) + cost_usd
    # 12 significant digits: a sum's float noise goes (0.1 + 0.2 is 0.3), a tiny reported cost stays (1e-10)
    return {agent: float(f"{usd:.12g}") for agent, usd in sorted(spend.items())}


@dataclass(frozen=True, slots=True)
class OrderFile:
    """A work order waiting in inbox/ or held/, as far as it could be read."""

    path: Path
    job_id: str | None
    agent: str | None
    mtime: float
    body: dict[str, Any] | None


def read_order_file(path: Path, max_bytes: int, mtime: float | None = None) -> OrderFile:
    """Read one order file (bounded by max_bytes, no link followed) for `list` and `show`.

    An unreadable or invalid file still gives an OrderFile, with what could be read.
    """
    body: Any = None
    try:
        if mtime is None:
            mtime = os.lstat(path).st_mtime
        fmt = order_format(path.name)
        if fmt is not None:
            body = load_document(fsutil.read_regular(path, max_bytes), fmt)
    except (OSError, OrderError, ValueError, RecursionError, fsutil.NotRegular):
        body = None
    body = body if isinstance(body, dict) else None
    job_id = body.get("job_id") if body else None
    agent = body.get("to") if body else None
    return OrderFile(
        path,
        job_id if isinstance(job_id, str) else None,
        agent if isinstance(agent, str) else None,
        mtime or 0.0,
        body,
    )
