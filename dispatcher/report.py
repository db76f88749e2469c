"""What `status`, `show` and `logs` read and print: the folders are the truth."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from dispatcher.evidence import is_ignored
from dispatcher.layout import Layout, State
from dispatcher.ledger import Ledger
from dispatcher.ledger.sqlite import SqliteLedger


def _count(path: Path) -> tuple[int, int]:
    """Return (jobs, refusals) in a state folder: refusal folders have '@' in their names."""
    jobs = refused = 0
    try:
        with os.scandir(path) as it:
            for de in it:
                if de.name.startswith("."):
                    continue
                if "@" in de.name:
                    refused += 1
                else:
                    jobs += 1
    except FileNotFoundError:
        pass
    return jobs, refused


def status(layout: Layout) -> dict[str, Any]:
    """Return counts per state and the active jobs (contract section 7)."""
    try:
        inbox = sum(1 for n in os.listdir(layout.inbox) if not is_ignored(n))
    except FileNotFoundError:
        inbox = 0
    active, _ = _count(layout.folder(State.ACTIVE))
    done, _ = _count(layout.folder(State.DONE))
    failed, refused = _count(layout.folder(State.FAILED))
    owners = _owners(layout)
    ledger = _ledger(layout)
    rows = []
    try:
        names = sorted(os.listdir(layout.folder(State.ACTIVE)))
    except FileNotFoundError:
        names = []
    now = time.time()
    for job_id in names:
        if job_id.startswith("."):
            continue
        spec = _read(layout.job(State.ACTIVE, job_id) / "job.json") or {}
        entry = ledger.get(job_id) if ledger else None
        owner = owners.get(entry.owner or "", {}) if entry else {}
        received = spec.get("received")
        rows.append(
            {
                "job_id": job_id,
                "agent": (spec.get("agent") or {}).get("name"),
                "pid": owner.get("pid"),
                "host": owner.get("host"),
                "age_s": round(now - float(received), 1) if received else None,
            }
        )
    if ledger:
        ledger.close()
    return {
        "counts": {
            "inbox": inbox,
            "active": active,
            "done": done,
            "failed": failed,
            "refused": refused,
        },
        "active": rows,
    }


def _ledger(layout: Layout) -> Ledger | None:
    """Open the ledger for reading, if there is one."""
    if not layout.ledger.exists():
        return None
    return SqliteLedger(layout.ledger, layout.state_dir, patience_s=30)


def _owners(layout: Layout) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    try:
        names = os.listdir(layout.daemons)
    except FileNotFoundError:
        return out
    for name in names:
        if name.endswith(".json"):
            info = _read(layout.daemons / name)
            if info:
                out[name[: -len(".json")]] = info
    return out


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def find_job(layout: Layout, job_id: str) -> dict[str, Any] | None:
    """Return what is known of one job: state, folder, result, lineage; None if unknown."""
    found = layout.find(job_id)
    ledger = _ledger(layout)
    try:
        entry = ledger.get(job_id) if ledger else None
        children = ledger.children(job_id) if ledger else []
    finally:
        if ledger:
            ledger.close()
    if found is None:
        if entry is None:
            return None
        state = {"reserved": "reserved", "released": "inbox"}.get(entry.state, entry.state)
        return {
            "job_id": job_id,
            "state": state,
            "agent": entry.agent,
            "reason": None,
            "checks": [],
            "attempts": [],
            "parent": entry.parent,
            "children": children,
            "hops": entry.hops,
            "folder": None,
        }
    state, folder = found
    result = _read(folder / "result.json") or {}
    spec = _read(folder / "job.json") or {}
    out: dict[str, Any] = {
        "job_id": job_id,
        "state": state.value,
        "agent": result.get("agent") or (spec.get("agent") or {}).get("name"),
        "reason": result.get("reason"),
        "checks": result.get("checks", []),
        "attempts": result.get("attempts", []),
        "received": result.get("received"),
        "finished": result.get("finished"),
        "parent": spec.get("parent", result.get("parent")),
        "children": sorted(set(result.get("children", [])) | set(children)),
        "hops": spec.get("hops", 0),
        "folder": str(folder),
    }
    return out


def chain(layout: Layout, job_id: str) -> dict[str, Any] | None:
    """Return the job with its ancestors (root first) and a tree of descendants."""
    job = find_job(layout, job_id)
    if job is None:
        return None
    ancestors: list[dict[str, Any]] = []
    parent = job.get("parent")
    seen = {job_id}
    while parent and parent not in seen:
        seen.add(parent)
        p = find_job(layout, parent)
        if p is None:
            break
        ancestors.insert(0, {"job_id": parent, "state": p["state"], "agent": p["agent"]})
        parent = p.get("parent")

    def tree(j: dict[str, Any], depth: int) -> dict[str, Any]:
        node = {"job_id": j["job_id"], "state": j["state"], "agent": j["agent"], "children": []}
        if depth < 64:
            for cid in j.get("children", []):
                c = find_job(layout, cid)
                if c is not None and cid not in seen:
                    seen.add(cid)
                    node["children"].append(tree(c, depth + 1))
        return node

    return {"job": job, "ancestors": ancestors, "tree": tree(job, 0)}


def render_show(info: dict[str, Any]) -> str:
    """Return `dispatcher show` text for a person."""
    job = info["job"]
    lines = [f"{job['job_id']}  {job['state']}  agent {job['agent']}  hops {job.get('hops', 0)}"]
    if job.get("reason"):
        lines.append(f"  reason: {job['reason']}")
    if job.get("received"):
        lines.append(f"  received {job['received']}  finished {job.get('finished') or '-'}")
    if job.get("folder"):
        lines.append(f"  folder: {job['folder']}")
    if job["checks"]:
        lines.append("  checks:")
        for c in job["checks"]:
            mark = {True: "pass", False: "FAIL", None: "n/a "}[c["ok"]]
            lines.append(f"    {mark}  {c['name']:<16} {c['detail']}")
    if job["attempts"]:
        lines.append("  attempts:")
        for a in job["attempts"]:
            extra = ""
            ar = a.get("agent_result")
            if isinstance(ar, dict):
                bits = [f"{k}={ar[k]}" for k in ("is_error", "total_cost_usd", "num_turns", "session_id") if k in ar]
                extra = "  " + " ".join(bits) if bits else ""
            code = "timed out" if a.get("timed_out") else f"exit {a.get('exit_code')}"
            lines.append(f"    #{a['n']}  {a.get('started')}  {code}  {a.get('duration_ms')} ms{extra}")
    lines.append("  chain:")
    for a in info["ancestors"]:
        lines.append(f"    ancestor  {a['job_id']}  {a['state']}  ({a['agent']})")
    lines.append(f"    this      {job['job_id']}  {job['state']}  ({job['agent']})")
    for c in _flatten(info["tree"]):
        lines.append(f"    {'  ' * (c[0] - 1)}child     {c[1]['job_id']}  {c[1]['state']}  ({c[1]['agent']})")
    return "\n".join(lines)


def _flatten(node: dict[str, Any], depth: int = 0) -> list[tuple[int, dict[str, Any]]]:
    out = []
    for child in node["children"]:
        out.append((depth + 1, child))
        out.extend(_flatten(child, depth + 1))
    return out


def tree_root(info: dict[str, Any]) -> str:
    """Return the id of the first job of the chain."""
    return str(info["ancestors"][0]["job_id"] if info["ancestors"] else info["job"]["job_id"])


def render_tree(root_tree: dict[str, Any], me: str) -> str:
    """Draw a chain from its root; the job asked about is marked with '<-'."""
    lines: list[str] = []

    def walk(node: dict[str, Any], prefix: str, last: bool, top: bool) -> None:
        label = f"{node['job_id']} [{node['state']}] ({node['agent']})" + ("  <-" if node["job_id"] == me else "")
        lines.append(label if top else f"{prefix}{'└── ' if last else '├── '}{label}")
        kids = node["children"]
        for i, kid in enumerate(kids):
            walk(kid, "" if top else prefix + ("    " if last else "│   "), i == len(kids) - 1, False)

    walk(root_tree, "", True, True)
    return "\n".join(lines)
