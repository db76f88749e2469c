"""What `show` reads about one job and its chain: folder, result, attempts, logs, lineage.

A job is found in its folder (active/, review/, done/, failed/), else as an
order waiting in inbox/ or held/, else as a ledger row only (a follow-up
reserved until its parent is done). Every file is read bounded and without
following links (``JobFolder``, ``fsutil``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

from dispatcher import fsutil, procs
from dispatcher.clock import iso
from dispatcher.errors import OrderError
from dispatcher.job.attempt import argv_after
from dispatcher.layout import JOB_ID, Layout, is_ignored
from dispatcher.ledger.base import Ledger
from dispatcher.ledger.records import held_until
from dispatcher.lifecycle import Row, State
from dispatcher.query.report import read_order_file
from dispatcher.spec.jobspec import Attempt, JobSpec, total_cost
from dispatcher.spec.loader import load_document
from dispatcher.spec.orders import order_format, parse_order
from dispatcher.store.counts import visible_entries
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.queued import find_queued
from dispatcher.text import redact

#: lines of a failed attempt's stderr that `show` prints
TAIL_LINES = 10
_TAIL_BYTES = 64 * 1024
_LINE_MAX = 400
_MAX_DEPTH = 64


def log_tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    """Return the last lines of a log as they are (passwords ``***``, long lines cut), or [].

    ``--json`` keeps text as it is; what prints them for a person escapes control characters.
    """
    text = fsutil.read_tail(path, _TAIL_BYTES).decode("utf-8", "replace")
    kept = [line for line in text.splitlines() if line.strip()][-lines:]
    return [redact(line if len(line) <= _LINE_MAX else line[:_LINE_MAX] + "...") for line in kept]


def _failed_attempt(attempt: dict[str, Any], last: bool, job_failed: bool) -> bool:
    """Return True for an attempt that did not exit 0 in time (or whose before hook failed), or a failed job's last."""
    code = attempt.get("exit_code")
    broke = bool(
        attempt.get("timed_out") or attempt.get("interrupted") or attempt.get("aborted") or attempt.get("before")
    )
    return broke or (code is not None and code != 0) or (last and job_failed)


def _with_logs(folder: JobFolder, attempts: list[dict[str, Any]], job_failed: bool) -> list[dict[str, Any]]:
    """Return the attempts with the paths of their logs, and the stderr tail of each failed one.

    An attempt whose before hook failed (section 15) never ran its agent: its logs
    add the hook's, and its stderr tail is the hook's.
    """
    out = []
    for i, a in enumerate(attempts):
        a = dict(a)
        n = a.get("n")
        if isinstance(n, int):
            where = folder.attempts_dir / str(n)
            a["logs"] = {"stdout": str(where / "stdout.log"), "stderr": str(where / "stderr.log")}
            err = where / "stderr.log"
            if a.get("before"):
                err = where / "before-stderr.log"
                a["logs"] |= {"before_stdout": str(where / "before-stdout.log"), "before_stderr": str(err)}
            if _failed_attempt(a, i == len(attempts) - 1, job_failed):
                a["stderr_tail"] = log_tail(err)
        out.append(a)
    return out


def _queued(layout: Layout, ledger: Ledger | None, job_id: str, max_bytes: int) -> dict[str, Any] | None:
    """Return an order waiting in inbox/ or held/ as a job in state inbox or held."""
    entry = ledger.get(job_id) if ledger else None
    if entry is not None and entry.state not in (Row.RELEASED, Row.HELD):
        return None  # a file carrying a known id is a duplicate to be refused, not this job
    for state, folder in (("inbox", layout.inbox), ("held", layout.held)):
        name = find_queued(folder, [job_id]).get(job_id)
        if name is None:
            continue
        order = read_order_file(folder / name, max_bytes)
        body = order.body or {}
        return _bare(job_id, state, order.agent, entry.parent if entry else None, entry.hops if entry else 0) | {
            "file": str(order.path),
            "task": body.get("task"),
            "items": len(body.get("items") or ()),
            # a follow-up not yet run: the chain's cost so far is its parent's (what held it, budget.held)
            "chain_cost_usd": _parent_chain_cost(ledger, entry.parent if entry else None),
        }
    return _invalid_queued(layout, job_id, max_bytes)


def _parent_chain_cost(ledger: Ledger | None, parent: str | None) -> float | None:
    """Return the chain cost of a follow-up's parent (what a released or held follow-up's chain has cost so far)."""
    found = ledger.get(parent) if ledger is not None and parent else None
    return found.chain_cost_usd if found is not None else None


def _invalid_queued(layout: Layout, job_id: str, max_bytes: int) -> dict[str, Any] | None:
    """Return an invalid order carrying job_id that waits unread in inbox/ or held/, as `list` shows it.

    No daemon has read it yet (none runs, or a gate holds its agent): it is refused when one
    does, and the reason says why now. Only files whose bytes hold the id are parsed.
    """
    needle = job_id.encode()
    for state, folder in (("inbox", layout.inbox), ("held", layout.held)):
        for de in visible_entries(folder):
            fmt = None if is_ignored(de.name) else order_format(de.name)
            if fmt is None:
                continue
            try:
                data = fsutil.read_regular(Path(de.path), max_bytes)
                if needle not in data and b"\\" not in data:
                    continue
                body = load_document(data, fmt)  # as `list` reads it: no rule applied
            except (OSError, fsutil.NotRegular, OrderError, ValueError, RecursionError):
                continue
            if not isinstance(body, dict) or body.get("job_id") != job_id:
                continue
            try:
                parse_order(data, de.name)
                continue  # valid after all (written since it was looked for): not this case
            except OrderError as exc:
                why = exc.reason
            agent, items = body.get("to"), body.get("items")
            return _bare(job_id, state, agent if isinstance(agent, str) else None, None, 0) | {
                "reason": f"not a valid order, refused when a daemon reads it: {why}",
                "file": de.path,
                "task": body.get("task"),
                "items": len(items) if isinstance(items, list) else 0,
            }
    return None


def _bare(job_id: str, state: str, agent: str | None, parent: str | None, hops: int) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "state": state,
        "agent": agent,
        "reason": None,
        "checks": [],
        "attempts": [],
        "parent": parent,
        "children": [],
        "hops": hops,
        "folder": None,
        "cost_usd": None,
        "chain_cost_usd": None,
    }


def _refusal_of(layout: Layout, job_id: str, source: str | None) -> dict[str, Any] | None:
    """Return state, reason and folder of the refusal of a released follow-up's file, or None if there is none.

    The daemon released it under ``source``; a refusal of that file is ``failed/<stem>@<time>/``,
    and its result.json names the job id.
    """
    if not source:
        return None
    stem, failed = Path(source).stem, layout.folder(State.FAILED)
    try:
        names = sorted((n for n in os.listdir(failed) if n.rpartition("@")[0] == stem), reverse=True)
    except OSError:
        return None
    for name in names:  # the newest first
        result = JobFolder(failed / name).result()
        if result is not None and result.job_id == job_id:
            return {"state": "refused", "reason": result.reason, "folder": str(failed / name)}
    return None


def find_job(layout: Layout, ledger: Ledger | None, job_id: str, max_bytes: int = 1 << 20) -> dict[str, Any] | None:
    """Return what is known of one job: state, folder, checks, attempts, cost, lineage; None if unknown.

    What is not a job id is unknown: never a path (``.``, ``../done/X``, a refused file's
    ``stem@time`` folder) nor a ledger key.
    """
    if not JOB_ID.fullmatch(job_id):
        return None
    found = layout.find(job_id)
    children = ledger.children(job_id) if ledger else []
    if found is None:
        queued = _queued(layout, ledger, job_id, max_bytes)
        if queued is not None:
            queued["children"] = children
            return queued
        entry = ledger.get(job_id) if ledger else None
        if entry is None:
            return None
        state = {"released": "inbox", "claimed": "active"}.get(entry.state, entry.state)
        job = _bare(job_id, state, entry.agent, entry.parent, entry.hops)
        if entry.state == Row.RELEASED and (refused := _refusal_of(layout, job_id, entry.source)) is not None:
            job |= refused  # released, then refused as it left inbox/ (expired, say): it never ran
        return job | {"children": children, "cost_usd": entry.cost_usd, "chain_cost_usd": entry.chain_cost_usd}
    state, path = found
    folder = JobFolder(path)
    result = folder.result()
    spec: JobSpec | None = None
    try:
        spec = folder.spec()
        agent: str | None = spec.agent.name
        parent, hops, received = spec.parent, spec.hops, spec.received
        after = {k: spec.order[k] for k in ("after", "after_rule") if k in spec.order}  # a join (section 16)
    except ValueError:
        agent, parent, hops, received = None, result.parent if result else None, 0, None
        after = {}
    if result is not None and state is not State.ACTIVE:
        attempts = [dict(a) for a in result.attempts]
        cost, chain = result.cost_usd, result.chain_cost_usd
    else:  # running: what the attempts so far recorded, and the one under way
        records = folder.attempts()
        argv = _argv_next(layout, spec, folder, records) if spec is not None else None
        begun = _under_way(folder, {a.n for a in records}, argv, lambda: _owner_alive(ledger, job_id))
        attempts = [a.to_json(internal=False) for a in records] + begun
        cost = total_cost(records)
        before = _parent_chain_cost(ledger, parent)  # the chain so far: its parent's, then this job's attempts
        chain = None if before is None and cost is None else (before or 0.0) + (cost or 0.0)
    until = _waiting(ledger, job_id, agent) if state is State.ACTIVE else None
    return {
        "job_id": job_id,
        "state": "waiting" if until is not None else state.value,
        **({"until": until[0]} if until is not None else {}),
        "agent": (result.agent if result else None) or agent,
        "reason": result.reason if result else None,
        "checks": [c.to_json() for c in result.checks] if result else [],
        "attempts": _with_logs(folder, attempts, state is State.FAILED),
        "received": (result.received if result else None) or (iso(received) if received is not None else None),
        "finished": result.finished if result else None,
        "parent": parent,
        "children": sorted(set(result.children if result else ()) | set(children)),
        "hops": hops,
        "folder": str(path),
        "cost_usd": cost,
        "chain_cost_usd": chain,
        "workspace": result.extra.get("workspace") if result else None,  # section 15: repo, branch, head...
    } | after


def _argv_next(layout: Layout, spec: JobSpec, folder: JobFolder, records: list[Attempt]) -> list[str]:
    """Return the argv of the attempt after ``records``, rendered as the daemon rendered it.

    The same function the daemon runs before a start (``attempt.argv_after``), on the job's
    own settings (``job.json``) and the attempts recorded so far (the session a ``resume``
    goes on with). A password in it is shown as ``***``.
    """
    workspace = layout.worktree(spec.job_id) if spec.agent.repo.workspace is not None else None
    return [redact(a) for a in argv_after(spec, folder.work_dir, records, workspace)]


def _owner_alive(ledger: Ledger | None, job_id: str) -> bool:
    """Return True if the daemon that owns job_id's claim lives (the ledger says so)."""
    entry = ledger.get(job_id) if ledger is not None else None
    return entry is not None and entry.owner is not None and ledger is not None and ledger.alive(entry.owner)


def _under_way(
    folder: JobFolder, recorded: set[int], argv: list[str] | None, owner_alive: Callable[[], bool]
) -> list[dict[str, Any]]:
    """Return the attempts begun but not yet recorded: n, started, pid, host, argv, and whether its agent runs.

    Its record (attempt.json) is written once, when it ends; until then the agent's note on its
    stdout.log says when it started, as which process and on which host. Its argv is the one
    rendered for the attempt after the recorded ones (``argv``). An agent on another host, or in
    another pid namespace, is not in this /proc: it runs while its daemon lives (``owner_alive``).
    """
    out = []
    for n in folder.attempt_numbers():
        if n in recorded:
            continue
        note = folder.pid_record(n)
        if note is None:  # its agent has not started (or a before hook runs)
            continue
        started = note.get("started")
        boot = note.get("boot_started")
        if not procs.seen_here(note.get("host"), note.get("pidns")):
            alive = owner_alive()
        else:  # on its start time, so that a pid reused since never reads as its agent
            alive = procs.is_alive(
                int(note["pid"]),
                float(started) if isinstance(started, (int, float)) else None,
                boot_started=float(boot) if boot is not None else None,
            )
        out.append(
            {
                "n": n,
                "started": iso(started) if isinstance(started, float) else None,
                "pid": note["pid"],
                "host": note.get("host"),
                "argv": argv if n > max(recorded, default=0) else None,
                "running": alive,
            }
        )
    return out


def _waiting(ledger: Ledger | None, job_id: str, agent: str | None) -> tuple[str | None] | None:
    """Return (until,) when an active job waits for a gate (section 14), else None."""
    if ledger is None:
        return None
    waits = ledger.gate_waits()
    if job_id not in waits:
        return None
    until = waits[job_id]
    if agent is not None:  # a gate moved later (another attempt's limit, a pause) holds it longer
        until = held_until(until, agent, ledger.gates(), time.time())
    return (iso(until) if until is not None else None,)


def chain(layout: Layout, ledger: Ledger | None, job_id: str, max_bytes: int = 1 << 20) -> dict[str, Any] | None:
    """Return the job with its ancestors (first job of the chain first) and a tree of its descendants."""
    job = find_job(layout, ledger, job_id, max_bytes)
    if job is None:
        return None
    ancestors: list[dict[str, Any]] = []
    parent = job.get("parent")
    seen = {job_id}
    while parent and parent not in seen and len(ancestors) < _MAX_DEPTH:
        seen.add(parent)
        p = find_job(layout, ledger, parent, max_bytes)
        if p is None:
            break
        ancestors.insert(0, _node(p))
        parent = p.get("parent")

    def tree(j: dict[str, Any], depth: int) -> dict[str, Any]:
        node = _node(j) | {"children": []}
        if depth < _MAX_DEPTH:
            for cid in j.get("children", []):
                c = find_job(layout, ledger, cid, max_bytes)
                # a follow-up dropped with its parent (a reject) leaves its id free: a job reusing it is no child
                if c is not None and cid not in seen and c.get("parent") == j["job_id"]:
                    seen.add(cid)
                    node["children"].append(tree(c, depth + 1))
        return node

    return {"job": job, "ancestors": ancestors, "tree": tree(job, 0)}


def show_json(
    layout: Layout,
    ledger: Ledger | None,
    job_id: str,
    max_bytes: int = 1 << 20,
    *,
    whole_tree: bool = False,
    agents: Container[str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Return (what `show --json` prints, the chain) for one job; None if unknown.

    The JSON is the job with its ``ancestors`` and the ``tree`` of its
    descendants (with ``whole_tree``, the tree of the first job of its chain,
    as `show --tree --json` prints).
    """
    info = chain(layout, ledger, job_id, max_bytes)
    if info is None:
        return None
    job = info["job"]
    agent = job.get("agent")
    if agents is not None and job["state"] in ("inbox", "held") and job.get("reason") is None and agent not in agents:
        # as the daemon reads it with this config: refused (an order's `to` must name a configured agent)
        why = f"to: no agent '{agent}' is defined in the config"
        waits = "a daemon that had the agent before a reload removed it leaves the order waiting instead"
        job["reason"] = f"not a valid order, refused when a daemon reads it: {why} ({waits})"
    root = (chain(layout, ledger, tree_root(info), max_bytes) or info) if whole_tree else info
    out = dict(info["job"])
    out["ancestors"] = info["ancestors"]
    out["tree"] = root["tree"]
    return out, info


def refusal_json(row: dict[str, Any]) -> dict[str, Any]:
    """Return `show --json` of a refused file (its `list --json` row): the shape of a job's, state ``refused``.

    It never ran: no attempts, no lineage, no chain (``tree`` null); its checks are those its result.json
    recorded (all not run). ``age_s`` and ``path`` stay as the row has them.
    """
    result = JobFolder(Path(row["path"])).result()
    job: dict[str, Any] = {
        "job_id": row["job_id"],
        "state": "refused",
        "agent": row["agent"],
        "reason": row["reason"],
        "checks": [c.to_json() for c in result.checks] if result is not None else [],
        "attempts": [],
        "received": result.received if result is not None else None,
        "finished": result.finished if result is not None else None,
        "parent": None,
        "children": [],
        "hops": None,
        "folder": row["path"],
        "cost_usd": None,
        "chain_cost_usd": None,
        "workspace": None,
    }
    return job | {"ancestors": [], "tree": None, "age_s": row["age_s"], "path": row["path"]}  # no chain: never a job


def _node(job: dict[str, Any]) -> dict[str, Any]:
    return {
        "job_id": job["job_id"],
        "state": job["state"],
        "agent": job["agent"],
        "cost_usd": job.get("cost_usd"),
        "cancelled": job.get("reason") == "cancelled",
    }


def tree_root(info: dict[str, Any]) -> str:
    """Return the id of the first job of the chain."""
    return str(info["ancestors"][0]["job_id"] if info["ancestors"] else info["job"]["job_id"])


def tree_cost(node: dict[str, Any]) -> float | None:
    """Return the sum of the reported costs over a tree of jobs, or None when none reported one."""
    costs = [c for c in _costs(node) if c is not None]
    return round(sum(costs), 10) if costs else None


def _costs(node: dict[str, Any]) -> list[float | None]:
    out: list[float | None] = [node.get("cost_usd")]
    for kid in node["children"]:
        out.extend(_costs(kid))
    return out
