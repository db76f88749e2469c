"""Text for a person: `status`, `list` and `show` as lines, never Python notation (contract 7)."""

from __future__ import annotations

import collections
import shlex
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from dispatcher.errors import printable
from dispatcher.query.jobinfo import tree_cost
from dispatcher.text import ago, escape_bidi, exit_text, gate_lifts, plain, usd

#: stopped daemons `status` names besides those that own active jobs (`--json` lists all)
DEAD_SHOWN = 3


def when(epoch: float) -> str:
    """Return a UTC time such as `2026-11-30 12:20:29Z`."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


#: the widest job id (its pattern allows 128 characters): a refused file's longer id text is cut to it
ID_COLUMNS = 128


def _cut(text: str, width: int) -> str:
    """Return shown text cut to width terminal columns, ending in `...` when cut."""
    if columns(text) <= width:
        return text
    text = text[: width * 2]  # a long text is cut at once, then character by character
    while columns(text) > width - 3:
        text = text[:-1]
    return text + "..."


def _cell(value: Any, width: int) -> str:
    """Return value as shown (escaped), cut to width terminal columns and padded to them."""
    text = _cut(escape_bidi(printable(plain(value))), width)
    return text + " " * (width - columns(text))


def _id_cell(value: Any, width: int) -> str:
    """Return a job id as shown (escaped), padded to width but never cut: it is what `show` and the rest take.

    Only a refused file's id text longer than any job id (no command takes it) is cut, to ``ID_COLUMNS``.
    """
    text = _cut(escape_bidi(printable(plain(value))), ID_COLUMNS)
    return text + " " * (width - columns(text))


def columns(text: str) -> int:
    """Return how many terminal columns text takes: two for a wide (CJK) character, none for a combining one."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def render_status(root: str, info: Mapping[str, Any], now: float) -> str:
    """Return `status` text: counts, daemons, whether one runs, active jobs and the spend of 24 h."""
    lines = [f"root {printable(root)}", "  ".join(f"{k} {v}" for k, v in info["counts"].items())]
    daemons = info["daemons"]
    # a job a gate holds is in active/ but listed as waiting (section 14): its table line says so
    gated = {w["job_id"]: w for w in info.get("waiting") or []}
    table = [*info["active"], *gated.values()]
    owners_of_active = {(a["pid"], a["host"]) for a in table}
    alive = [d for d in daemons if d["alive"]]
    dead = [d for d in daemons if not d["alive"]]
    shown_dead = [d for d in dead if (d["pid"], d["host"]) in owners_of_active]
    shown_dead += [d for d in dead if d not in shown_dead][:DEAD_SHOWN]  # the owners, then the latest others
    if daemons:
        lines.append("daemons:")
        shown = sorted(alive + shown_dead, key=lambda d: str(d["host"]))  # by host; on each, the running first
        # two daemons under one host name with one pid (containers sharing the host name): told apart by owner
        twins = collections.Counter((d["pid"], d["host"]) for d in shown)
        for d in shown:
            state = "running" if d["alive"] else "stopped"
            owner = f"  ({printable(d['owner'])})" if twins[(d["pid"], d["host"])] > 1 and d.get("owner") else ""
            lines.append(
                f"  {state:<8} pid {d['pid']:<8} host {printable(d['host']):<16} "
                f"started {when(d['started'])} ({ago(now - d['started'])} ago){owner}"
            )
        hidden = len(dead) - len(shown_dead)
        if hidden > 0:
            older = "1 older stopped daemon" if hidden == 1 else f"{hidden} older stopped daemons"
            lines.append(f"  ({older} not shown; `dispatcher status --json` lists every one)")
    if not alive:
        lines.append("no daemon is running: nothing is claimed until `dispatcher run` starts (it recovers active jobs)")
    if table:
        lines.append(f"{'JOB':<28} {'AGENT':<14} {'PID':>8} {'HOST':<16} {'AGE':>7}")
        for row in table:
            flag = "" if row["daemon_alive"] else "  daemon not running"
            if row["job_id"] in gated:
                flag += f"  waiting for a gate until {gate_lifts(gated[row['job_id']]['until'])}"
            lines.append(
                f"{_id_cell(row['job_id'], 28)} {_cell(row['agent'], 14):<14} {plain(row['pid']):>8} "
                f"{_cell(row['host'], 16):<16} {ago(row['age_s']):>7}{flag}"
            )
    for g in info.get("gates") or []:
        until = f"until {g['until']}" if g["until"] else "until resumed"
        lines.append(f"gated    {_cell(g['agent'], 14)}  {g['kind']}  {until}  {printable(g['reason'] or '')}".rstrip())
    spend = info.get("spend_24h") or {}
    if spend:
        lines.append("spend, last 24 h: " + "  ".join(f"{printable(a)} {usd(v)}" for a, v in spend.items()))
    else:
        lines.append("spend, last 24 h: none reported")
    return "\n".join(lines)


def render_list(rows: Iterable[Mapping[str, Any]]) -> Iterator[str]:
    """Yield `list` text: a header, then one line per job or refused file."""
    rows = list(rows)
    width = max([min(columns(escape_bidi(printable(plain(r["job_id"])))), ID_COLUMNS) for r in rows] + [3])
    agent_w = min(20, max([columns(escape_bidi(printable(plain(r["agent"])))) for r in rows] + [5]))
    cost_w = max([len(usd(r["cost_usd"])) for r in rows] + [12])
    yield f"{'JOB':<{width}}  {'STATE':<7}  {'AGENT':<{agent_w}}  {'AGE':>7}  {'COST':>{cost_w}}  REASON"
    for r in rows:
        reason = printable(r["reason"]) if r["reason"] else ""
        if r.get("state") == "waiting" and "until" in r:  # a gate's wait; a join's reason names its parents
            reason = f"until {gate_lifts(r.get('until'))}"
        yield (
            f"{_id_cell(r['job_id'], width)}  {r['state']:<7}  {_cell(r['agent'], agent_w)}  "
            f"{ago(r['age_s']):>7}  {usd(r['cost_usd']):>{cost_w}}  {reason}"
        ).rstrip()


def _argv(argv: Any) -> str:
    if not isinstance(argv, list) or not argv:
        return "-"
    return printable(shlex.join(str(a) for a in argv))


def _attempt_lines(a: Mapping[str, Any]) -> list[str]:
    if "running" in a:  # under way: no record yet (section 7)
        state = f"running as pid {a.get('pid')}" if a["running"] else "under way, its agent gone (recovered at start)"
        where = a.get("logs") or {}
        lines = [
            f"    #{plain(a.get('n'))}  {plain(a.get('started'))}  {state}  host {printable(plain(a.get('host')))}"
        ]
        lines.append(f"        argv: {_argv(a.get('argv'))}")
        if where:
            lines.append(f"        logs: {where.get('stdout')}")
            lines.append(f"              {where.get('stderr')}")
        return lines
    if a.get("timed_out"):
        code = "timed out"
    elif a.get("interrupted"):
        code = "interrupted"
    else:
        code = exit_text(a.get("exit_code"))
    ms = a.get("duration_ms")
    head = f"    #{plain(a.get('n'))}  {plain(a.get('started'))}  {code}  {plain(ms)} ms"
    head += f"  host {printable(plain(a.get('host')))}  cost {usd(a.get('cost_usd'))}"
    ar = a.get("agent_result")
    if isinstance(ar, Mapping):
        bits = [f"{k} {plain(ar[k])}" for k in ("is_error", "num_turns", "session_id") if k in ar]
        if bits:
            head += "  " + "  ".join(printable(b) for b in bits)
    lines = [head, f"        argv: {_argv(a.get('argv'))}"]
    if a.get("aborted"):
        lines.append(f"        aborted: {printable(plain(a['aborted']))}")
    if a.get("before"):  # its before hook failed: the agent never ran (section 15)
        lines.append(f"        before: {printable(plain(a['before']))}")
    logs = a.get("logs")
    tail = a.get("stderr_tail")
    if tail is not None and isinstance(logs, Mapping):
        hook = "before_stderr" in logs
        what = "before hook's stderr" if hook else "stderr"
        lines.append(f"        logs: {logs['before_stdout' if hook else 'stdout']}")
        lines.append(f"              {logs['before_stderr' if hook else 'stderr']}")
        if tail:
            lines.append(f"        {what}, {'the last line' if len(tail) == 1 else f'last {len(tail)} lines'}:")
            lines.extend(f"          | {printable(line)}" for line in tail)
        else:
            lines.append(f"        {what}: empty")
    return lines


def render_show(info: Mapping[str, Any]) -> str:
    """Return `show` text: state, reason, cost, its chain (parent, children), checks, attempts (argv, host, logs)."""
    job = info["job"]
    agent, hops = printable(plain(job["agent"])), printable(plain(job.get("hops", 0)))  # an unread order's, as written
    lines = [f"{job['job_id']}  {job['state']}  agent {agent}  hops {hops}"]
    after = f"{', '.join(job.get('after') or ())} ({job.get('after_rule') or 'all_done'})"  # a join (section 16)
    joining = job["state"] == "waiting" and "until" not in job and bool(job.get("after"))  # its parents hold it
    if "until" in job:
        lines.append(
            f"  waiting until {gate_lifts(job['until'])} (a gate holds its agent: a usage limit, a pause or a cap)"
        )
    elif joining:
        lines.append(f"  waiting for {after}")
    if job.get("reason"):
        lines.append(f"  reason: {printable(job['reason'])}")
    if job.get("file"):
        lines.append(f"  file: {printable(job['file'])}")
        lines.append(f"  task: {printable(plain(job.get('task')))}  items {plain(job.get('items'))}")
    if job.get("received"):
        lines.append(f"  received {job['received']}  finished {plain(job.get('finished'))}")
    if job.get("after") and not joining:
        lines.append(f"  after: {after}")
    if job.get("folder"):
        lines.append(f"  folder: {printable(job['folder'])}")
    lines.append(f"  cost: {usd(job.get('cost_usd'))}  chain cost: {usd(job.get('chain_cost_usd'))}")
    ws = job.get("workspace")
    if isinstance(ws, dict):
        changed = ws.get("changed") or []
        head, base = str(ws.get("head") or "-")[:12], str(ws.get("base") or "-")[:12]
        repo = printable(plain(ws.get("repo")))
        lines.append(f"  workspace: {plain(ws.get('branch'))} at {head} (from {base}) in {repo}")
        lines.append(f"    changed: {printable(', '.join(map(str, changed))) if changed else '-'}")
    lines.append("  chain:")
    if job.get("parent") and not info["ancestors"]:
        lines.append(f"    parent    {job['parent']}  unknown")
    for i, a in enumerate(info["ancestors"]):
        role = "parent  " if i == len(info["ancestors"]) - 1 else "ancestor"
        lines.append(f"    {role}  {a['job_id']}  {a['state']}  ({printable(plain(a['agent']))})")
    lines.append(f"    this      {job['job_id']}  {job['state']}  ({printable(plain(job['agent']))})")
    for depth, c in _flatten(info["tree"]):
        lines.append(f"    {'  ' * (depth - 1)}child     {c['job_id']}  {c['state']}  ({printable(plain(c['agent']))})")
    if job["checks"]:
        lines.append("  checks:")
        for c in job["checks"]:
            mark = {True: "pass", False: "FAIL", None: "n/a "}.get(c.get("ok"), "?   ")
            lines.append(f"    {mark}  {c['name']:<16} {printable(plain(c.get('detail')))}")
    if job["attempts"]:
        lines.append("  attempts:")
        for a in job["attempts"]:
            lines.extend(_attempt_lines(a))
    return "\n".join(lines)


def _flatten(node: Mapping[str, Any], depth: int = 0) -> list[tuple[int, Mapping[str, Any]]]:
    out: list[tuple[int, Mapping[str, Any]]] = []
    for child in node["children"]:
        out.append((depth + 1, child))
        out.extend(_flatten(child, depth + 1))
    return out


def render_tree(root_tree: dict[str, Any], me: str) -> str:
    """Draw a chain from its first job, each with its cost, then the chain's total; '<-' marks the job asked about."""
    lines: list[str] = []

    def walk(node: Mapping[str, Any], prefix: str, last: bool, top: bool) -> None:
        state = f"{node['state']}, cancelled" if node.get("cancelled") else node["state"]
        label = f"{node['job_id']} [{state}] ({printable(plain(node['agent']))}, {usd(node.get('cost_usd'))})"
        label += "  <-" if node["job_id"] == me else ""
        lines.append(label if top else f"{prefix}{'└── ' if last else '├── '}{label}")
        kids = node["children"]
        for i, kid in enumerate(kids):
            walk(kid, "" if top else prefix + ("    " if last else "│   "), i == len(kids) - 1, False)

    walk(root_tree, "", True, True)
    lines.append(f"chain total: {usd(tree_cost(root_tree))}")
    return "\n".join(lines)
