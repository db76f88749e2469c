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
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import structlog

from dispatcher.checks.builtin import Exit, verdict
from dispatcher.clock import iso
from dispatcher.job import attempt, retry, user_checks, verify
from dispatcher.job.context import JobContext
from dispatcher.job.control import Control
from dispatcher.job.repowork import JobRepo
from dispatcher.job.runner import AgentExit
from dispatcher.job.waits import Waits, waited_s
from dispatcher.ledger.base import Child
from dispatcher.lifecycle import Outcome, Row, Stop
from dispatcher.spec.jobspec import Attempt, JobSpec
from dispatcher.spec.limits import LimitHit
from dispatcher.spec.order import Order
from dispatcher.spec.result import CheckResult
from dispatcher.store.jobstore import JobFolder

log = structlog.get_logger("dispatcher")
T = TypeVar("T")
DISK_WAIT_MAX_S = 30.0


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
    async def _persist(self, fn: Callable[..., T], *args: object, inline: bool = False) -> T:
        """Run a bookkeeping write off the loop, waiting out a full disk."""

    def _limit_of(self, out: AgentExit) -> LimitHit | None:
        """Return the usage limit an attempt that did not pass met, or None."""
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
        await self.waits.gate(self.spec.agent, hit)
        bound = self.ctx.config().max_limit_wait_s
        total = waited_s(self.attempts)
        if total > bound:
            await self._persist(self.folder.record_attempt, replace(record, retry_next=False))
            reason = f"limit: {hit.text}; waiting until {iso(hit.until)} is beyond max_limit_wait ({bound:g} s)"
            return await self.finish(Row.FAILED, reason, [])
        self.spec = replace(self.spec, budget=self.spec.budget + 1)  # this attempt is not counted
        await self._persist(self.folder.write_spec, self.spec)
        await self._persist(self.folder.record_attempt, record)
        return None

    async def _decide(self, n: int, exit_: Exit) -> Outcome | None:
        """Check attempt n; finish the job, or return None to run attempt n + 1."""
        receipt_missing = not self.folder.has_receipt()
        if exit_.timed_out or exit_.code not in (0, None) or receipt_missing:
            checks = await self._checks(exit_, n)
            reason = verdict(checks) or "receipt_present: no receipt.json"
            if retry.receipt_invalid(checks):
                return await self.finish(Row.FAILED, reason, checks)
            return await self._retry_or_fail(n, reason, checks)
        return await self._evaluate(n, exit_, final=False)

    async def _evaluate(self, n: int, exit_: Exit, *, final: bool) -> Outcome | None:
        checks = await self._checks(exit_, n)
        reason = verdict(checks, exit_lost=exit_.lost)
        if reason is None:
            return await self._finish_passed(checks)
        agent = self.spec.agent
        if not final and agent.repair and not retry.receipt_invalid(checks):
            why = self._no_more_attempts(n)
            if why is None:
                safe, why = await self._safe_to_retry()
                if safe:
                    sha = await self._persist(self.folder.give_feedback, n, checks)
                    self.spec = self.spec.with_given("feedback.json", sha)
                    await self._persist(self.folder.write_spec, self.spec)
                    return await self._schedule_retry(n, reason)
            return await self.finish(Row.FAILED, f"{reason}; not repaired: {why}", checks)
        return await self.finish(Row.FAILED, reason, checks)

    def _no_more_attempts(self, n: int) -> str | None:
        """Return why no further attempt may run, or None."""
        if n >= self.spec.budget:
            return "no attempts left"
        return retry.over_budget(self.spec.agent, self.attempts)

    async def _retry_or_fail(self, n: int, reason: str, checks: list[CheckResult]) -> Outcome | None:
        why = self._no_more_attempts(n)
        if why is not None:
            return await self.finish(Row.FAILED, f"{reason}; not retried: {why}", checks)
        safe, why = await self._safe_to_retry()
        if self.control.reason is Stop.CANCELLED:
            return await self.finish(Row.FAILED, Stop.CANCELLED, checks)
        if self.control.reason is Stop.STOPPED:
            return Outcome.LEFT
        if not safe:
            return await self.finish(Row.FAILED, f"{reason}; not retried: {why}", checks)
        return await self._schedule_retry(n, reason)

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
                git_writable=self.repo.git_writable,
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

    async def _schedule_retry(self, n: int, reason: str) -> Outcome | None:
        last = next((a for a in reversed(self.attempts) if a.n == n), None)
        if last is not None:
            marked = retry.mark_retry(last)
            self.attempts[self.attempts.index(last)] = marked
            await self._persist(self.folder.record_attempt, marked)
        await self._persist(self.folder.stash, n)
        self.retries += 1
        delay = retry.delay(self.ctx.config().retry_delay_s, self.retries)
        log.info("job.retrying", attempt=n + 1, delay_s=delay, reason=reason)
        if await self.control.sleep(delay):
            if self.control.reason is Stop.STOPPED:
                return Outcome.LEFT
            return await self.finish(Row.FAILED, Stop.CANCELLED, [])
        return None

    async def _checks(self, exit_: Exit, n: int) -> list[CheckResult]:
        record, self._unsaved = self._unsaved, None
        ctx = self.ctx
        changed = await self.repo.snapshot(max(self.folder.attempt_numbers(), default=0))
        collect = functools.partial(
            verify.collect,
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
        ev, self._followups = await self._persist(collect)
        checks = verify.check(ev)
        if not self.spec.agent.checks:
            return checks
        return checks + await user_checks.run(
            self.spec,
            self.folder,
            n,
            ctx.config(),
            self.control,
            ctx.lanes,
            checks,
            self.repo.ws,
            self.repo.git_writable,
        )

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
