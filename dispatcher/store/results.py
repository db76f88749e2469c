"""A job's ``result.json`` as built: the one place a result (or a refusal's) is made, and what it cuts.

``build_result`` records every built-in check by name (contract section 5), cuts each
reason and check detail to ``DETAIL_MAX`` characters on one line, and stamps the finish.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

from dispatcher.clock import iso
from dispatcher.errors import cut, oneline
from dispatcher.spec.agent_rules import BUILTIN_CHECKS
from dispatcher.spec.jobspec import Attempt
from dispatcher.spec.result import CheckResult, Result

DETAIL_MAX = 2000


def cut_reason(reason: str) -> str:
    """Return a reason as result.json records it: one line, cut to ``DETAIL_MAX`` characters."""
    return cut(oneline(reason), DETAIL_MAX)


_NOT_RUN_DETAIL = "not run: the job ended before any attempt was checked"
NOT_RUN = tuple(CheckResult(name, None, _NOT_RUN_DETAIL) for name in BUILTIN_CHECKS)
_DETAIL = attrgetter("detail")


def not_run(why: str, user_checks: Sequence[str] = ()) -> list[CheckResult]:
    """Return every built-in check (then the agent's own) as ``"ok": null``, "not run: WHY".

    For a job that ends without checking its last attempt (its before hook failed, it met a
    usage limit): its reason then names no check, so no earlier attempt's failed check stands
    beside it as the first failing one (section 5).
    """
    detail = f"not run: {why}"
    return [CheckResult(name, None, detail) for name in (*BUILTIN_CHECKS, *user_checks)]


def build_result(
    *,
    job_id: str | None,
    state: str,
    agent: str | None,
    reason: str | None,
    checks: Sequence[CheckResult] = (),
    attempts: Sequence[Attempt] = (),
    received: float,
    parent: str | None = None,
    children: Sequence[str] = (),
    cost_usd: float | None = None,
    chain_cost_usd: float | None = None,
    extra: Mapping[str, Any] | None = None,
    user_checks: Sequence[str] = (),
) -> Result:
    """Return a new job's (or refusal's) result: the only place a result is built.

    Every built-in check is recorded by name (contract section 5): a job that ended before any
    attempt was checked (cancelled while queued, an agent that could not start, a refused
    file) records each as ``"ok": null``, "not run", and so each of the agent's own ``user_checks``.
    """
    if not checks:
        checks = NOT_RUN + tuple(CheckResult(name, None, _NOT_RUN_DETAIL) for name in user_checks)
    if max(map(len, map(_DETAIL, checks)), default=0) > DETAIL_MAX:  # one C loop: the usual details all fit
        checks = [
            c if len(c.detail) <= DETAIL_MAX else CheckResult(c.name, c.ok, cut(c.detail, DETAIL_MAX)) for c in checks
        ]
    return Result(
        job_id=job_id,
        state=state,
        agent=agent,
        reason=cut_reason(reason) if reason is not None else None,
        checks=tuple(checks),
        attempts=tuple([a.to_json(internal=False) for a in attempts]),
        received=iso(received),
        finished=iso(time.time()),
        parent=parent,
        children=tuple(children),
        cost_usd=cost_usd,
        chain_cost_usd=chain_cost_usd,
        extra=dict(extra or {}),
    )


def is_disk_full(exc: OSError) -> bool:
    """Return True for the errors that mean "wait and try again": a full disk or quota."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)
