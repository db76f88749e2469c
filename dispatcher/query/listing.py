"""What `list` reads: one row per job or refused file, newest first.

Each state is read only when asked for, and as cheaply as it allows: orders in
inbox/ and held/ one file at a time (bounded by ``max_order_bytes``), done jobs
from the ledger (agent, cost and the time they finished) without opening their
``result.json``, failed and review jobs from their ``result.json`` (the reason
is only there), refused files from theirs.

A row's age is the time since it entered its state: an order's modification
time in inbox/ or held/, a job's claim in active/ (or its return there: a retry,
a revision, a join let go, a usage limit's wait), its finish in review/, done/ or
failed/, a file's refusal.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dispatcher.clock import iso, parse_iso
from dispatcher.errors import printable
from dispatcher.layout import JOB_ID, Layout, is_ignored
from dispatcher.ledger.base import Entry, Ledger
from dispatcher.ledger.records import Gate, held_until
from dispatcher.lifecycle import Row, State
from dispatcher.query.report import read_order_file
from dispatcher.spec.jobspec import total_cost
from dispatcher.spec.orders import parse_time
from dispatcher.spec.result import Result
from dispatcher.spec.settings import Config
from dispatcher.store.counts import LIST_STATES, job_entries, visible_entries
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.refusals import STEM_BYTES, cut_name

_NO_RESULT = Result(None, None, None, None)  # a folder whose result.json is missing or unreadable


def _row(
    job_id: str | None, state: str, agent: str | None, when: float | None, path: Path, **more: Any
) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "state": state,
        "agent": agent,
        "when": when,
        "reason": more.get("reason"),
        "cost_usd": more.get("cost_usd"),
        "path": str(path),
    }


def _stamp(text: Any) -> float | None:
    try:
        return parse_iso(text) if isinstance(text, str) else None
    except ValueError:
        return None


def _refused_at(name: str) -> float | None:
    """Return the time in a refusal folder's name (`stem@20261129T081600.123456Z[-n]`)."""
    stamp = name.rpartition("@")[2].split("-")[0]
    try:
        return datetime.strptime(stamp, "%Y%m%dT%H%M%S.%fZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


def _orders(folder: Path, state: str, max_bytes: int) -> Iterator[dict[str, Any]]:
    for de in visible_entries(folder):
        if is_ignored(de.name):
            continue
        try:
            mtime = de.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        order = read_order_file(Path(de.path), max_bytes, mtime)
        yield _row(order.job_id, state, order.agent, mtime, order.path, reason=_due(order.body))


def _due(body: dict[str, Any] | None) -> str | None:
    """Return "due <time>" for an order held back by a not_before still to come."""
    text = body.get("not_before") if body else None
    try:
        due = parse_time(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return f"due {iso(due)}" if due is not None and due > time.time() else None


def _active(
    layout: Layout,
    state: State = State.ACTIVE,
    held: dict[str, float | None] | None = None,
    *,
    gated: bool = False,
    gates: list[Gate] | None = None,
) -> Iterator[dict[str, Any]]:
    """Rows of active/ (or waiting/: the reason says which jobs it waits for) jobs.

    ``held`` are the active jobs that wait for a gate (section 14): with ``gated``
    only those, as ``waiting`` with ``until``; without, only the others.
    """
    held = held or {}
    for de in job_entries(layout.folder(state)):
        if state is State.ACTIVE and (de.name in held) != gated:
            continue
        folder = JobFolder(Path(de.path))
        try:
            spec = folder.spec()
        except ValueError:
            if os.path.isdir(folder.path):  # else it moved on while this was read: listed where it went, if asked
                yield _row(de.name, state.value, None, None, folder.path)
            continue
        if state is State.WAITING:
            after = ", ".join(spec.order.get("after") or ())
            rule = spec.order.get("after_rule") or "all_done"
            reason = f"waiting for {after} ({rule})"
            since = folder.in_state_since(spec)  # a retried join: since it came back to wait
            yield _row(de.name, state.value, spec.agent.name, since, folder.path, reason=reason)
            continue
        cost = total_cost(folder.attempts())
        since = folder.in_state_since(spec)  # a retried, revised or joined job: since it came back
        if gated:
            until = held_until(held[de.name], spec.agent.name, gates or [], time.time())  # a gate moved later
            shown = iso(until) if until is not None else None
            row = _row(de.name, "waiting", spec.agent.name, since, folder.path, cost_usd=cost)
            yield row | {"until": shown, "reason": f"until {shown or 'resumed'}"}
            continue
        yield _row(de.name, state.value, spec.agent.name, since, folder.path, cost_usd=cost)


def _finished(
    layout: Layout, state: State, ledger_rows: dict[str, Entry] | None, ledger: Ledger | None = None
) -> Iterator[dict[str, Any]]:
    """Rows of review/, done/ or failed/ jobs (refusals left out); with ledger_rows, no result.json is read.

    A folder whose result.json is missing (a revise or approve cut short, which moved it aside) is
    shown with the ledger's agent and time, when a ledger is given.
    """
    for de in job_entries(layout.folder(state)):
        if "@" in de.name:
            continue
        entry = ledger_rows.get(de.name) if ledger_rows is not None else None
        if entry is not None:
            yield _row(de.name, state.value, entry.agent, entry.updated, Path(de.path), cost_usd=entry.cost_usd)
            continue
        result = JobFolder(Path(de.path)).result()
        if result is None and ledger is not None and (entry := ledger.get(de.name)) is not None:
            yield _row(de.name, state.value, entry.agent, entry.updated, Path(de.path), cost_usd=entry.cost_usd)
            continue
        result = result or _NO_RESULT
        yield _row(
            de.name,
            state.value,
            result.agent,
            _stamp(result.finished),
            Path(de.path),
            reason=result.reason,
            cost_usd=result.cost_usd,
        )


def _refused(layout: Layout) -> Iterator[dict[str, Any]]:
    for de in job_entries(layout.folder(State.FAILED)):
        if "@" not in de.name:
            continue
        result = JobFolder(Path(de.path)).result() or _NO_RESULT
        job_id = result.job_id if result.job_id is not None and JOB_ID.fullmatch(result.job_id) else None
        yield _row(
            job_id,  # a string that is no job id (`a@b`, ``""``) is none: no id could be read from the file
            "refused",
            result.agent,
            _refused_at(de.name) or _stamp(result.finished),
            Path(de.path),
            reason=result.reason,
        )


def list_jobs(
    config: Config,
    layout: Layout,
    ledger: Ledger | None,
    *,
    state: str | None = None,
    agent: str | None = None,
    now: float | None = None,
) -> list[dict[str, Any]]:
    """Return one row per job or refused file in the chosen state (all by default), newest first.

    Each row: ``job_id``, ``state``, ``agent``, ``age_s``, ``reason`` (of a
    failure or refusal), ``cost_usd`` and ``path`` (the job folder or file).
    """
    now = time.time() if now is None else now
    wanted = LIST_STATES if state is None else (state,)
    sources: list[Iterator[dict[str, Any]]] = []
    if "inbox" in wanted:
        sources.append(_orders(layout.inbox, "inbox", config.max_order_bytes))
    if "held" in wanted:
        sources.append(_orders(layout.held, "held", config.max_order_bytes))
    gate_waits = ledger.gate_waits() if ledger is not None else {}
    if "active" in wanted:
        sources.append(_active(layout, State.ACTIVE, gate_waits))
    if "waiting" in wanted:
        sources.append(_active(layout, State.WAITING))
        if gate_waits:
            gates = ledger.gates() if ledger is not None else []
            sources.append(_active(layout, State.ACTIVE, gate_waits, gated=True, gates=gates))
    if "review" in wanted:
        sources.append(_finished(layout, State.REVIEW, None, ledger))
    if "done" in wanted:
        done = {e.job_id: e for e in ledger.in_state(Row.DONE)} if ledger is not None else None
        sources.append(_finished(layout, State.DONE, done))
    if "failed" in wanted:
        sources.append(_finished(layout, State.FAILED, None, ledger))
    if "refused" in wanted:
        sources.append(_refused(layout))
    rows = _moved_once([r for source in sources for r in source if agent is None or r["agent"] == agent])
    if "inbox" in wanted or "held" in wanted:
        rows = _claims_cut_short(rows, layout)
    rows.sort(key=lambda r: (r["when"] is not None, r["when"] or 0.0, r["job_id"] or ""), reverse=True)
    for r in rows:
        when = r.pop("when")
        r["age_s"] = round(max(0.0, now - when), 1) if when is not None else None
    keys = ("job_id", "state", "agent", "age_s", "reason", "cost_usd", "path")
    return [{k: r[k] for k in keys} | ({"until": r["until"]} if "until" in r else {}) for r in rows]


def _moved_once(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop the rows of a job listed twice because it moved on while the states were read one after another
    (claimed from inbox/ after inbox/ was read, say): the row whose file or folder is gone. Refused files are
    never dropped: a refused copy of a job's id is a row of its own."""
    seen: dict[str, int] = {}
    twice = False
    for r in rows:
        if r["job_id"] is not None and r["state"] != "refused":
            seen[r["job_id"]] = seen.get(r["job_id"], 0) + 1
            twice = twice or seen[r["job_id"]] > 1
    if not twice:
        return rows
    return [
        r
        for r in rows
        if r["job_id"] is None or r["state"] == "refused" or seen[r["job_id"]] == 1 or os.path.lexists(r["path"])
    ]


def _claims_cut_short(rows: list[dict[str, Any]], layout: Layout) -> list[dict[str, Any]]:
    """Drop the rows of queued files that are the very file of a job in active/ or waiting/ (a claim's link).

    A daemon that died between placing a claim and removing its inbox name leaves both names
    of one file; the next daemon drops the inbox one (``order.twin_dropped``). Until then the
    job is listed once, in its folder, also by ``list --state inbox``. Another file with the
    same id is a row of its own.
    """
    return [
        r
        for r in rows
        if not (
            r["state"] in ("inbox", "held")
            and r["job_id"] is not None
            and any(_claimed_file(r["path"], layout.job_str(s, r["job_id"])) for s in (State.ACTIVE, State.WAITING))
        )
    ]


def _claimed_file(path: str, folder: str) -> bool:
    """Is the queued file at path the very file of the job whose folder is given (its order.<ext> a link of it)?"""
    ext = path.rpartition(".")[2]
    try:
        return os.lstat(path).st_ino == os.lstat(f"{folder}/order.{ext}").st_ino
    except OSError:
        return False


def refusals_of(cfg: Config, layout: Layout, name: str) -> list[dict[str, Any]]:
    """Return the refused files (newest first, as `list --json` rows) a job id, a file's name or stem or a folder's
    name names."""
    stem = Path(name).stem  # a file's name: its folder is <stem>@<time>, and its result.json names the file

    def names(r: dict[str, Any]) -> bool:
        folder = Path(r["path"]).name
        if r["job_id"] == name or name in (folder.rpartition("@")[0], folder):
            return True
        if stem == name or folder.rpartition("@")[0] != cut_name(stem, STEM_BYTES):  # a long stem's folder has it cut
            return False
        return _refused_file(Path(r["path"])) in (name, printable(name))  # result.json keeps the name shown escaped

    return [r for r in list_jobs(cfg, layout, None, state="refused") if names(r)]


def _refused_file(folder: Path) -> str | None:
    """Return the name of the file a refusal folder holds, as its result.json says (None if unreadable)."""
    result = JobFolder(folder).result()
    file = result.extra.get("file") if result is not None else None
    return file if isinstance(file, str) else None
