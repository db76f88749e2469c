"""The pages: Jinja2 templates (autoescaped) filled from the same answers as the JSON API.

Every page is a ``<main>`` inside one frame; a page that polls asks for its
``<main>`` alone (``?partial=1``) and swaps it in. Charts are inline SVG drawn
by the templates; nothing is loaded from outside the package.
"""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

import jinja2

from dispatcher.errors import printable
from dispatcher.query.jobinfo import tree_cost
from dispatcher.store.counts import LIST_STATES
from dispatcher.text import ago, escape_bidi, gate_lifts, plain, usd

#: rows on one page of the job list
PAGE_ROWS = 200
#: the states the overview counts and the list filters by, as `status` and `list` name them
STATES = LIST_STATES
#: the actions a job page offers in each state
OFFERED = {
    "review": ("approve", "revise", "reject"),
    "failed": ("retry", "revise"),
    "inbox": ("cancel", "hold"),
    "held": ("release",),
    "active": ("cancel",),
    "waiting": ("cancel",),
}
#: pages poll this often (milliseconds): one request every few seconds per open page
POLL_MS = 3000


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("dispatcher.web", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["ago"] = ago
    env.filters["usd"] = usd
    env.filters["lifts"] = lambda v: printable(gate_lifts(v))
    env.filters["plain"] = lambda v: printable(plain(v))
    env.filters["idq"] = lambda v: quote(str(v), safe="")
    env.filters["argv"] = lambda v: printable(shlex.join(str(a) for a in v)) if isinstance(v, list) and v else "-"
    env.filters["seconds"] = lambda ms: "-" if ms is None else f"{plain(round(ms / 1000, 2))} s"
    env.globals["tree_cost"] = tree_cost
    env.globals["OFFERED"] = OFFERED
    return env


_ENV = _env()


def render(template: str, *, partial: bool, title: str, **values: Any) -> str:
    """Return a whole page (or, with partial, its ``<main>`` content only).

    Bidirectional controls in what the page shows are written escaped (``\\u202e``), as the
    commands print them: a task holding U+202E cannot make a line of the page read otherwise.
    """
    main = escape_bidi(_ENV.get_template(template).render(**values))
    if partial:
        return main
    return _ENV.get_template("base.html").render(
        title=title, main=main, logged_in=values.get("session") is not None, poll_ms=POLL_MS
    )


def spend_bars(spend: Mapping[str, float]) -> list[dict[str, Any]]:
    """Return one bar per agent (widest first) for the overview's spend chart: agent, usd, width 0..100."""
    top = max(spend.values(), default=0.0)
    bars = []
    for agent, value in sorted(spend.items(), key=lambda kv: (-kv[1], kv[0])):
        width = 100.0 * value / top if top > 0 else 0.0
        bars.append({"agent": agent, "usd": value, "width": round(max(width, 0.5), 1)})
    return bars


def by_host(daemons: list[Mapping[str, Any]]) -> list[tuple[str, list[Mapping[str, Any]]]]:
    """Return the live daemons grouped by host, hosts in name order."""
    hosts: dict[str, list[Mapping[str, Any]]] = {}
    for d in daemons:
        if d.get("alive"):
            hosts.setdefault(str(d.get("host") or "-"), []).append(d)
    return sorted(hosts.items())


def overview(info: Mapping[str, Any], *, partial: bool, session: str | None) -> str:
    """Return the overview page of a `status --json` answer.

    A job a gate holds is in active/ but runs no agent: it is shown apart, with when its gate lifts, as `status`
    flags it."""
    running = info["active"]
    held = [(w, w.get("until")) for w in info.get("waiting") or []]
    return render(
        "overview.html",
        partial=partial,
        title="overview",
        info=info,
        running=running,
        held=held,
        states=STATES,
        bars=spend_bars(info.get("spend_24h") or {}),
        hosts=by_host(info.get("daemons") or []),
        started_ago=lambda started: ago(time.time() - started) if isinstance(started, (int, float)) else "-",
        session=session,
    )


def job_list(
    rows: list[dict[str, Any]],
    *,
    state: str | None,
    agent: str | None,
    page: int,
    partial: bool,
    session: str | None,
    csrf: str | None,
    review: bool = False,
) -> str:
    """Return a page of the job list (or the review queue) with its filters and page links."""
    pages = max(1, math.ceil(len(rows) / PAGE_ROWS))
    page = min(max(page, 1), pages)
    shown = rows[(page - 1) * PAGE_ROWS : page * PAGE_ROWS]
    query = {k: v for k, v in (("state", state), ("agent", agent)) if v}

    def link(n: int) -> str:
        return "?" + urlencode(query | {"page": str(n)})

    return render(
        "review.html" if review else "jobs.html",
        partial=partial,
        title="review queue" if review else "jobs",
        rows=shown,
        total=len(rows),
        state=state or "",
        agent=agent or "",
        states=STATES,
        page=page,
        pages=pages,
        prev_link=link(page - 1) if page > 1 else None,
        next_link=link(page + 1) if page < pages else None,
        session=session,
        csrf=csrf,
    )


def job_page(
    job: Mapping[str, Any],
    attempts: list[dict[str, Any]],
    *,
    message: str | None,
    partial: bool,
    session: str | None,
    csrf: str | None,
) -> str:
    """Return a job's page: state, checks, attempts with their logs and diffs, chain, actions."""
    return render(
        "job.html",
        partial=partial,
        title=str(job["job_id"] or job.get("file") or "refused file"),
        job=job,
        attempts=attempts,
        message=message,
        actions=OFFERED.get(str(job["state"]), ()),
        session=session,
        csrf=csrf,
    )


def chain_page(job: Mapping[str, Any], *, partial: bool, session: str | None) -> str:
    """Return the page that draws a job's whole chain as a tree, each hop with its state and cost."""
    return render(
        "chain.html", partial=partial, title=f"chain of {job['job_id']}", job=job, tree=job["tree"], session=session
    )


def login_page(*, failed: bool, session: str | None, csrf: str | None, partial: bool = False) -> str:
    """Return the login form (or, logged in, the logout button)."""
    return render("login.html", partial=partial, title="log in", failed=failed, session=session, csrf=csrf)


def error_page(status: int, message: str, *, session: str | None = None) -> str:
    """Return a page that says what went wrong in one line."""
    return render("error.html", partial=False, title=str(status), status=status, message=message, session=session)
