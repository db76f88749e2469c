"""How a job decides after each attempt: check it, finish it, retry it (probe, repair), or wait.

``Deciding`` is the half of ``Job`` (``job.py``) that runs after an attempt ends: the
evidence and the checks (one trip off the loop, then the pure checks and the agent's own
``checks:``), the retry rules of contract section 6 (attempts left, ``retry_safe`` or the
probe, ``repair``), a usage limit met (section 14), and a passed job's follow-ups. It reads
and sets the job's state through the attributes ``Job`` gives it and ends the job
through ``Job.finish``.
"""

from __future__ import annotations

import abc
import functools
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import structlog

from dispatcher import storage
from dispatcher.checks import leftovers
from dispatcher.checks.builtin import verdict
from dispatcher.checks.facts import Exit
from dispatcher.clock import iso
from dispatcher.job import attempt, retry, user_checks, verify
from dispatcher.job.context import JobContext
from dispatcher.job.control import Control
from dispatcher.job.repowork import JobRepo
from dispatcher.job.retry import Next
from dispatcher.job.runner import AgentExit
from dispatcher.job.settle import Ending, Settled, settle
from dispatcher.job.waits import Waits, waited_s
from dispatcher.lanes import Handoff
from dispatcher.ledger.base import Child
from dispatcher.lifecycle import Outcome, Row, Stop
from dispatcher.spec.jobspec import Attempt, JobSpec
from dispatcher.spec.limits import LimitHit
from dispatcher.spec.order import Order
from dispatcher.spec.result import CheckResult
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.results import not_run
from dispatcher.text import number

log = structlog.get_logger("dispatcher")
T = TypeVar("T")


class Deciding(abc.ABC):
    """The decisions after an attempt; ``Job`` supplies the state and the finish."""

    ctx: JobContext
    folder: JobFolder
    spec: JobSpec
    order: Order
    token: int
    job_id: str
    attempts: list[Attempt]
    control: Control
    retries: int
    checked: list[CheckResult]
    waits: Waits
    repo: JobRepo
    _followups: list[Child]
    _unsaved: Attempt | None

    @abc.abstractmethod
    async def finish(
        self, state: Row, reason: str | None, checks: list[CheckResult], children: list[str] | None = None
    ) -> Outcome:
        """Run the finishing sequence."""

    @abc.abstractmethod
    async def _persist(
        self, fn: Callable[..., T | Handoff[T]], *args: object, inline: bool | Callable[[], bool] = False
    ) -> T:
        """Run a bookkeeping write off the loop, waiting out a full disk."""

    def _limit_of(self, out: AgentExit) -> LimitHit | None:
        """Return the usage limit an attempt that did not pass met, or None.

        Not for an attempt its timeout (or ``idle_timeout``) ended: the limit did not end it, it
        may have worked until then (a rerun needs ``retry_safe`` or the probe), and an old
        "try again in N s" in its output would make every such attempt free, for ever.
        """
        passed = out.exit_code == 0 and self.folder.has_receipt()
        if passed or out.timed_out:
            return None
        return self.waits.limited(self.spec.agent, out.stdout_tail, out.stderr_tail, time.time())

    async def _limited(self, record: Attempt, hit: LimitHit) -> Outcome | None:
        """An attempt met a usage limit: gate the agent, give the attempt back, wait (or fail past max_limit_wait)."""
        wait_s = max(0.0, hit.until - record.ended)
        limited = {"until": iso(hit.until), "text": hit.text, "wait_s": round(wait_s, 3)}
        record = replace(record, retry_next=True, extra={**record.extra, "limited": limited})
        self.attempts.append(record)
        await self.repo.snapshot(record.n)  # diff.patch and changed.txt after each attempt (section 15)
        await self.waits.gate(self.spec.agent, hit)
        spent = retry.over_budget(self.spec.agent, self.attempts)
        if spent is not None:  # the attempts that met the limit cost too: max_cost_usd ends the job here
            await self._persist(self.folder.record_attempt, replace(record, retry_next=False))
            return await self.finish(
                Row.FAILED, f"limit: {hit.text}; not retried: {spent}", self._limited_checks(record.n)
            )
        bound = self.ctx.config().max_limit_wait_s
        total = waited_s(self.attempts)
        if total > bound:
            await self._persist(self.folder.record_attempt, replace(record, retry_next=False))
            reason = f"limit: {hit.text}; waiting until {iso(hit.until)} is beyond max_limit_wait ({number(bound)} s)"
            return await self.finish(Row.FAILED, reason, self._limited_checks(record.n))
        self.spec = replace(self.spec, budget=self.spec.budget + 1, since=time.time())  # not counted; waits from now
        await self._persist(self.folder.write_spec, self.spec)
        await self._persist(self.folder.record_attempt, record)
        # its wait recorded now (`waiting`, with until, and job.waiting): so a stop that comes before the next
        # attempt's turn leaves it shown waiting, not active
        await self.waits.hold(self.spec.agent)
        return None

    async def _decide(self, n: int, exit_: Exit, *, final: bool = False) -> Outcome | None:
        """Check attempt n; finish the job, or return None to run attempt n + 1.

        ``final``: a recovered job's receipt is judged once, without a repair.
        """
        settled = await self._settle(exit_, n, final=final)
        if settled.landed is not None:  # it ended in the trip
            return await self._landed(settled)
        checks = settled.checks
        if self.control.reason is Stop.CANCELLED:  # since the agent's exit, or while its own checks ran
            return await self.finish(Row.FAILED, Stop.CANCELLED, checks)
        judgement = settled.judgement
        if judgement is None:  # the agent's own checks ran on the loop after the trip
            receipt = self.folder.has_receipt()
            judgement = retry.judge(self.spec, self.attempts, n, exit_, checks, receipt=receipt, final=final)
        reason = judgement.reason or ""
        match judgement.next:
            case Next.PASS:
                return await self._finish_passed(checks)
            case Next.FAIL:
                return await self.finish(Row.FAILED, reason, checks)
            case Next.RETRY:
                await self._feedback_spent(n)
                return await self._retry(n, reason, checks)
            case Next.REPAIR:
                return await self._repair(n, reason, checks)

    async def _repair(self, n: int, reason: str, checks: list[CheckResult]) -> Outcome | None:
        """Run attempt n + 1 with the failed checks as feedback, if the probe or retry_safe says it is safe."""
        if self._work_gone():
            return await self.finish(Row.FAILED, f"{reason}; not repaired: {retry.WORK_GONE}", checks)
        safe, why = await self._safe_to_retry()
        if safe:
            sha = await self._persist(self.folder.give_feedback, n, checks)
            self.spec = self.spec.with_given("feedback.json", sha)
            await self._persist(self.folder.write_spec, self.spec)
            return await self._schedule_retry(n, reason, checks)
        return await self.finish(Row.FAILED, f"{reason}; not repaired: {why}", checks)

    def _limited_checks(self, n: int) -> list[CheckResult]:
        """The checks of a job that fails at attempt n's usage limit: none ran (its reason names none)."""
        return self._unchecked(f"attempt {n} met a usage limit")

    def _unchecked(self, why: str) -> list[CheckResult]:
        """Every check, the agent's own too, as not run on the last attempt, and why (``results.not_run``)."""
        return not_run(why, [c.name for c in self.spec.agent.checks])

    def _no_more_attempts(self, n: int) -> str | None:
        """Return why no further attempt may run, or None."""
        return retry.no_more_attempts(self.spec, self.attempts, n)

    async def _if_budget_spent(self) -> Outcome | None:
        """Fail the job before a further attempt once its attempts cost more than ``max_cost_usd`` (section 11).

        The decisions after an attempt never ask for another then; this holds the rule for the
        attempts they do not decide: a `dispatcher retry`'s (with the config's budget at that
        time: raise it, reload, then retry) and one a usage limit gave back. None: it may run.
        """
        spent = retry.over_budget(self.spec.agent, self.attempts) if self.attempts else None
        if spent is None:
            return None
        kept, checks = await self.ctx.lanes.io(self.folder.kept_end)
        lead = kept.split("; ", 1)[0] if kept else None  # the first failing check of its last decision
        reason = f"{lead}; not retried: {spent}" if lead else f"not retried: {spent}"
        return await self.finish(Row.FAILED, reason, self.checked or checks)  # the checks that reason names

    async def _feedback_spent(self, n: int) -> None:
        """Move aside the work/feedback.json attempt n was given (a revision's or a repair's): it ran and did not
        pass, and a plain retry gets no note (a repair's next attempt gets a new one)."""
        if "feedback.json" not in self.spec.given:
            return
        await self._persist(functools.partial(self.folder.stash, feedback=True), n)
        self.spec = self.spec.without_given("feedback.json")
        await self._persist(self.folder.write_spec, self.spec)

    async def _retry_or_fail(self, n: int, reason: str, checks: list[CheckResult]) -> Outcome | None:
        if self._checks_cancelled():
            return await self.finish(Row.FAILED, Stop.CANCELLED, checks)
        why = self._no_more_attempts(n)
        if why is not None:
            return await self.finish(Row.FAILED, f"{reason}; not retried: {why}", checks)
        return await self._retry(n, reason, checks)

    async def _retry(self, n: int, reason: str, checks: list[CheckResult]) -> Outcome | None:
        """Run attempt n + 1 if the probe or retry_safe says it is safe (attempts remain), else fail."""
        if self._work_gone():
            return await self.finish(Row.FAILED, f"{reason}; not retried: {retry.WORK_GONE}", checks)
        safe, why = await self._safe_to_retry()
        if self.control.reason is Stop.CANCELLED:
            return await self.finish(Row.FAILED, Stop.CANCELLED, checks)
        if self.control.reason is Stop.STOPPED:
            return Outcome.LEFT
        if not safe:
            return await self.finish(Row.FAILED, f"{reason}; not retried: {why}", checks)
        if self.spec.agent.repair and any(c.ok is False for c in checks) and not self._cut_short(n):
            # a retry after failed checks (a non-zero exit or a timeout fails exit_ok, no receipt receipt_present):
            # with repair, the next attempt is told which (section 3), as after a repair; not after an attempt a
            # stop or crash cut short, whose checks failed for want of time, not by its agent's doing
            sha = await self._persist(self.folder.give_feedback, n, checks)
            self.spec = self.spec.with_given("feedback.json", sha)
            await self._persist(self.folder.write_spec, self.spec)
        return await self._schedule_retry(n, reason, checks)

    def _cut_short(self, n: int) -> bool:
        """Return True if attempt n was cut short by a stop or crash of its daemon (or its host's loss)."""
        record = next((a for a in self.attempts if a.n == n), None)
        return record is not None and (record.interrupted or record.aborted == Stop.STOPPED)

    def _work_gone(self) -> bool:
        """Return True if work/ is no longer a folder (its agent removed it): no attempt can run in it."""
        work = self.folder.work_dir
        return os.path.islink(work) or not os.path.isdir(work)

    async def _safe_to_retry(self) -> tuple[bool, str]:
        """Decide with the probe, else retry_safe; return (safe, why not)."""
        agent = self.spec.agent
        if agent.probe is not None:
            code = await self._run_probe()
            return retry.probe_says(code)
        if agent.retry_safe:
            return True, ""
        return False, f"agent {agent.name} is not retry_safe and has no probe"

    async def _run_probe(self) -> int | None:
        n = max(self.folder.attempt_numbers(), default=1)
        argv = attempt.argv(self.spec, self.folder.work, self.spec.agent.probe or (), self.repo.path)
        folder = self.folder.attempts_dir / str(n)
        try:
            proc = attempt.process(
                self.spec,
                self.folder,
                n,
                argv,
                self.ctx.config(),
                folder,
                probe=True,
                workspace=self.repo.ws,
            )
            await self._persist(self.folder.begin_probe, n)
            proc.start()
        except OSError as exc:
            log.warning("probe.failed", error=str(exc))
            return None
        self.control.attach(proc)
        out = await proc.wait()
        self.control.attach(None)
        log.info("probe.exited", exit_code=out.exit_code, timed_out=out.timed_out)
        if out.timed_out or out.aborted or out.exit_code is None or out.exit_code < 0:
            return None
        return out.exit_code

    async def _schedule_retry(self, n: int, reason: str, checks: list[CheckResult] | None = None) -> Outcome | None:
        last = next((a for a in reversed(self.attempts) if a.n == n), None)
        if last is not None:
            marked = retry.mark_retry(last)
            self.attempts[self.attempts.index(last)] = marked
            await self._persist(self.folder.record_attempt, marked)
        await self._persist(self.folder.stash, n)
        self.checked = checks or []  # a cancel during the wait ends the job with these, not with "not run"
        self.retries += 1
        delay = retry.delay(self.ctx.config().retry_delay_s, self.retries)
        log.info("job.retrying", attempt=n + 1, delay_s=delay, reason=reason)
        if self.ctx.stopping():  # a stop cuts the wait, also one that begins after it: the next start retries
            return Outcome.LEFT
        if await self.control.sleep(delay):
            if self.control.reason is Stop.STOPPED:
                return Outcome.LEFT
            return await self.finish(Row.FAILED, Stop.CANCELLED, self.checked)
        return None

    async def _checks(self, exit_: Exit, n: int) -> list[CheckResult]:
        """Return attempt n's checks, the agent's own ``checks:`` included (no decision, no finish)."""
        return (await self._settle(exit_, n, final=False, decide=False)).checks

    async def _settle(self, exit_: Exit, n: int, *, final: bool, decide: bool = True) -> Settled:
        """Make the post-exit trip (``settle``): the record, the evidence, the checks; the decision and the
        finish too when the job may end there. The agent's own ``checks:`` then run on the loop."""
        record, self._unsaved = self._unsaved, None
        ctx = self.ctx
        await ctx.starts.quiet()  # an agent being started (on the slot this one gave back) goes first
        changed = None  # a job without a workspace has no change to save: its attempts/ is not listed
        if self.repo.ws is not None:
            changed = await self.repo.snapshot(max(self.folder.attempt_numbers(), default=0), self.spec.tree_left)
        collect = functools.partial(
            verify.collect_checked,
            ctx.config(),
            ctx.ledger,
            ctx.layout,
            self.spec,
            self.order,
            self.folder,
            exit_,
            record,
            changed,
        )
        ending = self._ending(final) if decide and self._may_end_in_trip() else None
        # in memory, a small work/ is read and synced on the loop: no fsync waits there, and the trip would cost more
        work = self.folder.work_dir
        inline = functools.partial(storage.small_folder, work) if ctx.lanes.files_in_memory else False
        args = (collect, self.spec, self.attempts, n, exit_, self.folder, ending)
        settled = await self._persist(settle, *args, inline=inline)
        self._followups = settled.followups
        if not self.spec.agent.checks:
            return settled
        # what the checks write in work/ is not the agent's work at the next attempt (``checks.leftovers``)
        stamped = self.repo.ws is None and user_checks.agent_passed(settled.checks)
        before = await ctx.lanes.io(leftovers.stamps, work) if stamped else None
        checks = settled.checks + await user_checks.run(
            self.spec,
            self.folder,
            n,
            ctx.config(),
            self.control,
            ctx.lanes,
            settled.checks,
            self.repo.ws,
        )
        if before is not None:
            after = await ctx.lanes.io(leftovers.stamps, work)
            left = leftovers.left_by_checks(before, after, self.spec.checks_left)
            if left != self.spec.checks_left:
                self.spec = replace(self.spec, checks_left=left)
                await self._persist(self.folder.write_spec, self.spec)
        elif self.repo.ws is not None and user_checks.agent_passed(settled.checks):  # in the worktree: by git
            in_tree = await self.repo.checks_left(self.spec.tree_left)
            if in_tree != self.spec.tree_left:
                self.spec = replace(self.spec, tree_left=in_tree)
                await self._persist(self.folder.write_spec, self.spec)
        return Settled(checks, settled.followups)

    def _checks_cancelled(self) -> bool:
        """Return True if a cancel came while the agent's own checks ran (or before them): the job ends cancelled."""
        return bool(self.spec.agent.checks) and self.control.reason is Stop.CANCELLED

    def _may_end_in_trip(self) -> bool:
        """Return True if the job may finish inside the post-exit trip: nothing of its finish needs the loop."""
        agent = self.spec.agent
        repo = agent.repo
        plain = repo.workspace is None and repo.after is None and repo.land is None
        return plain and not agent.checks and not self.waits.waiting and not self.waits.left_over

    @abc.abstractmethod
    def _ending(self, final: bool) -> Ending:
        """Return what the post-exit trip needs to build, stage and land this job's result."""

    @abc.abstractmethod
    async def _landed(self, settled: Settled) -> Outcome:
        """Finish on the loop a job that ended in the post-exit trip (notify, after its landing)."""

    # -- finishing ----------------------------------------------------------------------------
    async def _finish_passed(self, checks: list[CheckResult]) -> Outcome:
        children = self._followups
        if children:  # their bytes durable before the ledger reserves them (a power cut must not lose them)
            await self._persist(self.folder.sync_outbox, [c.source for c in children])
            taken = await self.ctx.lanes.ledger(
                self.ctx.ledger.reserve, self.job_id, self.token, self.spec.hops + 1, children
            )
            if taken is None:
                log.warning("job.fenced", step="reserve")
                return Outcome.FENCED
            if taken:
                checks = retry.followups_taken(checks, taken)
                return await self.finish(Row.FAILED, verdict(checks) or "followups_valid", checks)
        state = Row.REVIEW if self.spec.agent.review else Row.DONE
        return await self.finish(state, None, checks, children=[c.job_id for c in children])
