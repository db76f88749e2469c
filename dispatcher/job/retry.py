"""Pure decisions about running a job again: when it is safe, how long to wait, what to say.

No disk, no clock, no processes: each function takes what the job knows and
returns a verdict, so the policy can be tested in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from dispatcher.spec.jobspec import Attempt, total_cost
from dispatcher.spec.result import CheckResult
from dispatcher.spec.settings import MAX_RETRY_DELAY_S, Agent


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
        return f"the budget is spent ({spent:g} USD of max_cost_usd {limit:g})"
    return None


def followups_taken(checks: Sequence[CheckResult], taken: Sequence[str]) -> list[CheckResult]:
    """Return the checks with followups_valid failed for ids another job took meanwhile."""
    why = f"job_id {', '.join(taken)} is already known"
    return [c if c.name != "followups_valid" else CheckResult(c.name, False, why) for c in checks]


def mark_retry(attempt: Attempt) -> Attempt:
    """Return the attempt marked as followed by a retry (recovery then goes on with a new one)."""
    return replace(attempt, retry_next=True)
