"""The post-exit trip: an attempt's record, its evidence, its checks, the decision and the result, in one call.

After an agent exits, ``settle`` runs in the io pool as one function: it writes the
attempt's record, gathers the evidence and runs the pure checks (``verify.collect_checked``,
which fsyncs what the checks vouch for), and decides (``retry.judge``). A job that ends
there (passed without follow-ups, or failed for good) has its result staged and fsynced
in the same call, and its landing handed to the ledger lane's group commit
(``Finisher.handoff``), which answers the job: one trip off the loop from the agent's
exit to the job's folder in done/ or failed/.

Everything else goes back to the loop with the checks and the decision: a retry (the
probe, the wait), a repair, follow-ups to reserve, the agent's own ``checks:``, a
workspace to seal, hooks to run. So does a result that could not be staged (a full disk):
``Job.finish`` then waits for room.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dispatcher import fsutil
from dispatcher.checks.facts import Exit
from dispatcher.job.retry import Judgement, Next, judge
from dispatcher.lanes import Handoff
from dispatcher.ledger.base import Child, Finish
from dispatcher.lifecycle import Row
from dispatcher.spec.jobspec import Attempt, JobSpec
from dispatcher.spec.result import CheckResult, Result
from dispatcher.store.jobstore import JobFolder


@dataclass(frozen=True, slots=True)
class Settled:
    """What the trip found: the checks, the follow-ups, the decision, and the landing if the job ended in it."""

    checks: list[CheckResult]
    followups: list[Child]
    judgement: Judgement | None = None  # None: decided on the loop (the agent's own checks run first)
    finish: Finish | None = None
    result: Result | None = None
    landed: bool | OSError | None = None  # the ledger's answer; None: the job did not end in the trip


@dataclass(frozen=True, slots=True)
class Ending:
    """What a job that may end in the trip hands to it (it has no ``checks:``, workspace, hooks or gate wait)."""

    final: bool  # a recovered job's receipt: no repair
    result_of: Callable[[Row, str | None, list[CheckResult]], Result]
    finish_of: Callable[[Row, Result], Finish]
    land: Callable[[JobFolder, Finish, Result, Callable[[bool | OSError], Settled]], Handoff[Settled]]
    cancelled: Callable[[], bool] = lambda: False  # a cancel came since the agent's exit: the loop ends the job


def settle(
    collect: Callable[[], tuple[list[CheckResult], list[Child]]],
    spec: JobSpec,
    attempts: list[Attempt],
    n: int,
    exit_: Exit,
    folder: JobFolder,
    ending: Ending | None,
) -> Settled | Handoff[Settled]:
    """Record, gather, check, decide and, for a job that ends here, stage its result and hand it on (io pool)."""
    checks, followups = collect()  # ``verify.collect_checked``
    if ending is None:
        return Settled(checks, followups)
    judgement = judge(spec, attempts, n, exit_, checks, receipt=folder.has_receipt(), final=ending.final)
    state = ends_as(judgement, spec, followups)
    if state is None or ending.cancelled():
        return Settled(checks, followups, judgement)
    result = ending.result_of(state, judgement.reason, checks)
    try:  # staged only once the evidence it vouches for is durable (collect fsynced it)
        errors = fsutil.fsync_many(list(folder.write_staged(result)))
    except OSError:
        errors = [OSError("not staged")]
    if any(e is not None for e in errors):
        return Settled(checks, followups, judgement)  # the loop finishes it, waiting for room
    finish = ending.finish_of(state, result)
    return ending.land(
        folder, finish, result, lambda ok: Settled(checks, followups, judgement, finish, result, landed=ok)
    )


def ends_as(judgement: Judgement, spec: JobSpec, followups: list[Child]) -> Row | None:
    """Return the state a job ends in right after its checks, or None when more is to do first."""
    if judgement.next is Next.FAIL:
        return Row.FAILED
    if judgement.next is Next.PASS and not followups:  # follow-ups are reserved in the ledger first
        return Row.REVIEW if spec.agent.review else Row.DONE
    return None
