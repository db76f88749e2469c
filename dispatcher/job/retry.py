"""Pure decisions about running a job again: when it is safe, how long to wait, what to say.

No disk, no clock, no processes: each function takes what the job knows and
returns a verdict, so the policy can be tested in milliseconds.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dispatcher.checks.builtin import verdict
from dispatcher.checks.facts import Exit
from dispatcher.spec.jobspec import Attempt, JobSpec, total_cost
from dispatcher.spec.result import CheckResult
from dispatcher.spec.settings import MAX_RETRY_DELAY_S, Agent
from dispatcher.text import number

WORK_GONE = "work/ is gone (its agent removed it), so no attempt can run in it"
RECEIPT_INVALID = "its receipt.json is present but invalid (receipt_present), and such a job is never retried"


def receipt_invalid(checks: Sequence[CheckResult]) -> bool:
    """Return True when a receipt is present but unusable: such a job is never retried."""
    present = next((c for c in checks if c.name == "receipt_present"), None)
    return present is not None and present.ok is False and present.detail != "no receipt.json"


def probe_says(code: int | None) -> tuple[bool, str]:
    """Read the probe's exit: non-zero means the work did not happen (safe to retry)."""
    if code is None:
        return False, "the probe could not run, so the work may have happened"
    if code == 0:
        return False, "the probe says the work may have happened"
    return True, ""


def delay(retry_delay_s: float, retries: int) -> float:
    """Return the wait before retry number ``retries`` (1-based): doubling, at most 300 s."""
    return float(min(retry_delay_s * (2 ** min(retries - 1, 32)), MAX_RETRY_DELAY_S))


def over_budget(agent: Agent, attempts: Sequence[Attempt]) -> str | None:
    """Return why the agent's cost budget forbids another attempt, or None."""
    limit = agent.max_cost_usd
    spent = total_cost(list(attempts))
    if limit is not None and spent is not None and spent > limit:
        return f"the budget is spent ({number(spent)} USD of max_cost_usd {number(limit)})"
    return None


def followups_taken(checks: Sequence[CheckResult], taken: Sequence[str]) -> list[CheckResult]:
    """Return the checks with followups_valid failed for ids another job took meanwhile."""
    why = f"job_id {', '.join(taken)} is already known"
    return [c if c.name != "followups_valid" else CheckResult(c.name, False, why) for c in checks]


def retries_so_far(attempts: Sequence[Attempt]) -> int:
    """Return how many retries the job's latest run of attempts made: each was followed by one.

    Counted back from the last attempt, over attempts cut short by a stop or crash (they
    decided nothing) and attempts a usage limit gave back (they are not retries), up to one
    that ended the job (before a `dispatcher retry`), so that a daemon started again waits as
    long as the one that stopped would have.
    """
    n = 0
    for a in reversed(attempts):
        if a.retry_next and "limited" in a.extra:
            continue  # given back at a usage limit: followed by an attempt, but no retry (no delay doubled)
        if a.retry_next:
            n += 1
        elif not (a.interrupted or a.aborted):
            break
    return n


def mark_retry(attempt: Attempt) -> Attempt:
    """Return the attempt marked as followed by a retry (recovery then goes on with a new one)."""
    return replace(attempt, retry_next=True)


class Next(enum.Enum):
    """What follows an attempt's checks."""

    PASS = "passed"  # noqa: S105 - every check passed: done (or review), once its follow-ups are reserved
    FAIL = "fail"  # the job fails with the reason
    RETRY = "retry"  # another attempt, if the probe or retry_safe says it is safe
    REPAIR = "repair"  # another attempt with the failed checks as feedback, if it is safe


@dataclass(frozen=True, slots=True)
class Judgement:
    """The decision after attempt n's checks, and the reason a job that did not pass gets."""

    next: Next
    reason: str | None = None


def judge(
    spec: JobSpec,
    attempts: Sequence[Attempt],
    n: int,
    exit_: Exit,
    checks: Sequence[CheckResult],
    *,
    receipt: bool,
    final: bool = False,
) -> Judgement:
    """Decide what follows attempt n (contract, section 6) from its exit and every check's result.

    ``receipt``: work/receipt.json exists. ``final``: no repair (a recovered job's receipt).
    An agent that failed, timed out or left no receipt is retried if attempts remain; one
    whose receipt is unusable is not. An agent that exited 0 with a receipt and failed a
    check is repaired if its agent has ``repair``; otherwise it fails.
    """
    if exit_.timed_out or exit_.code not in (0, None) or not receipt:
        reason = verdict(checks) or "receipt_present: no receipt.json"
        if final and receipt:  # section 6: with a receipt, a recovered job's agent is not run again
            over = over_budget(spec.agent, attempts)
            return Judgement(Next.FAIL, f"{reason}; not retried: {RECOVERED}" + (f", and {over}" if over else ""))
        if receipt_invalid(checks):  # a reason led by another check (exit_ok) says why there is no retry
            said = reason.startswith("receipt_present:")
            over = over_budget(spec.agent, attempts)
            if said:
                return Judgement(Next.FAIL, f"{reason}; {over}" if over else reason)
            unusable = f"{RECEIPT_INVALID}, and {over}" if over else RECEIPT_INVALID
            return Judgement(Next.FAIL, f"{reason}; not retried: {unusable}")
        why = no_more_attempts(spec, attempts, n)
        return Judgement(Next.FAIL, f"{reason}; not retried: {why}") if why else Judgement(Next.RETRY, reason)
    failed = verdict(checks, exit_lost=exit_.lost)
    if failed is None:
        return Judgement(Next.PASS)
    if final or not spec.agent.repair or receipt_invalid(checks):
        # no further attempt either way; its reason still says when the budget was spent (section 11)
        over = over_budget(spec.agent, attempts)
        if final and spec.agent.repair and not receipt_invalid(checks):  # a job not repaired says why (section 6)
            return Judgement(Next.FAIL, f"{failed}; not repaired: {RECOVERED}" + (f", and {over}" if over else ""))
        return Judgement(Next.FAIL, f"{failed}; {over}" if over else failed)
    why = no_more_attempts(spec, attempts, n)
    return Judgement(Next.FAIL, f"{failed}; not repaired: {why}") if why else Judgement(Next.REPAIR, failed)


RECOVERED = "recovered with its receipt after its daemon died"


def no_more_attempts(spec: JobSpec, attempts: Sequence[Attempt], n: int) -> str | None:
    """Return why no attempt may follow attempt n (none left, or the cost budget spent), or None.

    Both may hold: a job whose last attempt also spent its budget says both (section 11: the
    reason of a job that failed over its budget says the budget was spent).
    """
    spent = over_budget(spec.agent, attempts)
    if n >= spec.budget:
        return f"no attempts left, and {spent}" if spent else "no attempts left"
    return spent
