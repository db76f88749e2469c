"""One claimed job, driven from active/ to its end: attempts, checks, retries, the finish.

``Job.run`` is a coroutine on the daemon's event loop; the agent is an
``AgentProcess`` on the same loop, and everything that touches the disk runs in
the io pool or the ledger lane (``lanes.py``), so a job never blocks pickup.
A job is stopped through one channel, its ``Control``: a cancel or a stop ends
whatever it is doing (its agent, its probe, its wait before a retry).

What a job writes, in order, is what makes a crash anywhere recoverable (README,
"Guarantees"): ``attempts/<n>/`` with empty logs before the agent starts, its
running record right after, its end record, then ``jobstore``'s finishing sequence.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import structlog

from dispatcher import attempt, retry, verify
from dispatcher.agent_result import AGENT_RESULT_MAX, parse_agent_result
from dispatcher.checks import CheckResult, Exit, verdict
from dispatcher.config import Config
from dispatcher.control import Control, Left
from dispatcher.jobspec import Attempt, JobSpec, Outcome, Stop, total_cost
from dispatcher.jobstore import JobFolder, build_result, is_disk_full
from dispatcher.lanes import GroupCommit, Lanes
from dispatcher.layout import Layout, State
from dispatcher.ledger import Child, Finish, Ledger, Row
from dispatcher.orders import Order
from dispatcher.recovery import leftover_groups
from dispatcher.runner import end_group

if TYPE_CHECKING:
    from dispatcher.metrics import Metrics  # prometheus_client is imported only when metrics_file is set

log = structlog.get_logger("dispatcher")
T = TypeVar("T")
_DISK_WAIT_MAX_S = 30.0


@dataclass
class JobContext:
    """What every job needs from its daemon."""

    layout: Layout
    ledger: Ledger
    lanes: Lanes
    finisher: GroupCommit[tuple[JobFolder, Finish, dict[str, object]], bool]
    config: Callable[[], Config]
    stopping: Callable[[], bool]
    queued: Callable[[Sequence[str]], set[str]]  # job ids of orders waiting in inbox/ (blocking)
    release: Callable[[str, int], None]  # release a done parent's follow-ups (blocking)
    notify: Callable[[str, str | None, str | None, str | None, Path | None], None] = lambda *a: None
    fenced: Callable[[], bool] = lambda: False  # no lease renewal for lease/2: write nothing into job folders
    metrics: Metrics | None = None


class Job:
    """One job in active/<job_id>, driven to done/, failed/ or review/ (or left there on stop)."""

    def __init__(
        self,
        ctx: JobContext,
        folder: JobFolder,
        spec: JobSpec,
        order: Order,
        token: int,
        *,
        attempts: list[Attempt] | None = None,
        recovering: bool = False,
        host_lost: bool = False,
    ) -> None:
        self.ctx = ctx
        self.folder = folder
        self.spec = spec
        self.order = order
        self.token = token
        self.job_id = spec.job_id
        self.attempts = attempts or []
        self.recovering = recovering
        self.host_lost = host_lost  # recovered from a daemon whose lease ran out (another host)
        self.control = Control()
        self.retries = 0
        self._followups: list[Child] = []
        self._unsaved: Attempt | None = None  # the record of the attempt that just ended, not yet written
        self._children: list[str] | None = None

    @property
    def agent(self) -> str:
        return self.spec.agent.name

    async def run(self) -> Outcome:
        """Drive the job to its end and return how it ended; a bug fails the job, never the daemon."""
        with structlog.contextvars.bound_contextvars(job_id=self.job_id, agent=self.agent):
            try:
                return await self._run()
            except Left:
                return Outcome.LEFT
            except Exception as exc:
                log.exception("job.crashed", error=str(exc))
                try:
                    return await self.finish(Row.FAILED, f"crashed: {type(exc).__name__}: {exc}", [])
                except Left:
                    return Outcome.LEFT
                except Exception:
                    log.exception("job.crashed", step="finish")
                    return Outcome.LEFT

    async def _run(self) -> Outcome:
        if self.recovering and self.folder.result() is not None:  # a fresh claim has no result yet
            return await self._reland()
        if self.recovering:
            outcome = await self._recover()
            if outcome is not None:
                return outcome
        while True:
            if self.control.reason is Stop.STOPPED or self.ctx.stopping():
                return Outcome.LEFT  # no new attempt once a stop began: recovered at the next start
            if self.control.reason is Stop.CANCELLED:
                return await self.finish(Row.FAILED, Stop.CANCELLED, [])
            n = max([a.n for a in self.attempts] + self.folder.attempt_numbers(), default=0) + 1
            if n > 1:
                await self._persist(self.folder.stash, n - 1)
            ended = await self._attempt(n)
            if isinstance(ended, Outcome):
                return ended
            outcome = await self._decide(n, ended)
            if outcome is not None:
                return outcome

    async def _reland(self) -> Outcome:
        """Finish a job cut short while landing: its result is already written."""
        result = self.folder.result() or {}
        state = Row(result.get("state", "failed"))
        log.info("job.recovered", step="finish")
        ok = await self.ctx.finisher.submit((self.folder, Finish(self.job_id, self.token, state), result))
        return await self._after_finish(state, ok, result.get("reason"))

    # -- recovery ---------------------------------------------------------------------------
    async def _recover(self) -> Outcome | None:
        """Pick up a job whose daemon died: end its agent, then let the evidence decide."""
        log.info("job.recovered", attempts=len(self.attempts))
        numbers = self.folder.attempt_numbers()
        if not numbers:
            return None
        n = numbers[-1]
        await self._end_leftover(n)
        if self.folder.has_kept_result(n):
            return None  # reopened by `dispatcher retry`: go on with a new attempt
        record = next((a for a in self.attempts if a.n == n), None)
        if record is None or record.interrupted or record.aborted == Stop.STOPPED:
            if record is None:
                record = attempt.interrupted(n, self.folder.pid_record(n))
                self.attempts.append(record)
                await self._persist(self.folder.record_attempt, record)
            if record.retry_next:
                return None
            if os.path.lexists(self.folder.work / "receipt.json"):
                return await self._evaluate(n, Exit(lost=True), final=True)
            checks = await self._checks(Exit(lost=True))
            why = verdict(checks, exit_lost=True) or "receipt_present: no receipt.json"
            how = "its host was lost" if self.host_lost else "by a stop or crash"
            return await self._retry_or_fail(n, f"{why}; attempt {n} was interrupted: {how}", checks)
        if record.retry_next:
            return None
        return await self._decide(n, attempt.exit_of(record, self.spec.timeout_s))

    async def _end_leftover(self, n: int) -> None:
        """End an agent of attempt n still running from a dead daemon (``recovery.leftover_groups``)."""
        for pgid in await self.ctx.lanes.io(leftover_groups, self.folder, n):
            log.warning("agent.orphan_ended", pid=pgid)
            await end_group(pgid, self.ctx.config().kill_grace_s)

    # -- one attempt --------------------------------------------------------------------------
    async def _attempt(self, n: int) -> Exit | Outcome:
        """Run attempt n; return its Exit, or how the job ended when it never ran or was stopped."""
        agent = self.spec.agent
        argv = attempt.argv(self.spec, self.folder.work, agent.command)
        log_dir = await self._persist(self.folder.begin_attempt, n)
        proc = attempt.process(self.spec, self.folder, n, argv, self.ctx.config(), log_dir)
        try:
            proc.start()
        except OSError as exc:
            await self.ctx.lanes.io(self.folder.drop_attempt, n)
            why = exc.strerror or str(exc)
            reason = f"config: agent {agent.name} cannot start: {why}" + (f": {exc.filename}" if exc.filename else "")
            log.error("agent.exited", attempt=n, error=reason)
            return await self.finish(Row.FAILED, reason, [])
        self.control.attach(proc)
        log.info("agent.started", attempt=n, pid=proc.pid)
        try:
            self.folder.record_pid(n, proc.pid, proc.boot_started, proc.started)
        except OSError as exc:  # the agent runs and stays supervised; recovery finds it by its folder
            log.warning("job.bookkeeping_failed", step="pid", error=exc.strerror)
        out = await proc.wait()
        self.control.attach(None)
        tail = out.stdout_tail
        small = len(tail) <= AGENT_RESULT_MAX
        result = parse_agent_result(tail) if small else await self.ctx.lanes.io(parse_agent_result, tail)
        record = attempt.record(n, out, argv, result)
        self.attempts.append(record)
        log.info(
            "agent.exited",
            attempt=n,
            exit_code=out.exit_code,
            timed_out=out.timed_out,
            duration_ms=out.duration_ms,
            cost_usd=record.cost_usd,
            usage=result.get("usage") if result else None,
            stdout_cut=out.stdout_cut or None,
            logs_lost=out.logs_lost or None,
        )
        if out.aborted:
            await self._persist(self.folder.record_attempt, record)
        else:
            self._unsaved = record  # written in the same trip off the loop as the checks' evidence
        if out.aborted == Stop.STOPPED:
            return Outcome.LEFT
        if out.aborted == Stop.CANCELLED:
            return await self.finish(Row.FAILED, Stop.CANCELLED, [])
        return attempt.exit_of(record, self.spec.timeout_s)

    async def _persist(self, fn: Callable[..., T], *args: object) -> T:
        """Run a bookkeeping write off the loop; on a full disk, wait (a stop leaves the job where it is)."""
        delay = 0.5
        while True:
            if self.ctx.fenced():
                log.warning("job.fenced", step=getattr(fn, "__name__", "write"))
                raise Left
            try:
                return await self.ctx.lanes.io(fn, *args)
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                log.warning("job.waiting", reason="disk full", step=getattr(fn, "__name__", "write"), retry_s=delay)
                if await self.control.sleep(delay) or self.ctx.stopping():
                    raise Left from None
                delay = min(delay * 2, _DISK_WAIT_MAX_S)

    # -- deciding -----------------------------------------------------------------------------
    async def _decide(self, n: int, exit_: Exit) -> Outcome | None:
        """Check attempt n; finish the job, or return None to run attempt n + 1."""
        receipt_missing = not os.path.lexists(self.folder.work / "receipt.json")
        if exit_.timed_out or exit_.code not in (0, None) or receipt_missing:
            checks = await self._checks(exit_)
            reason = verdict(checks) or "receipt_present: no receipt.json"
            if retry.receipt_invalid(checks):
                return await self.finish(Row.FAILED, reason, checks)
            return await self._retry_or_fail(n, reason, checks)
        return await self._evaluate(n, exit_, final=False)

    async def _evaluate(self, n: int, exit_: Exit, *, final: bool) -> Outcome | None:
        checks = await self._checks(exit_)
        reason = verdict(checks, exit_lost=exit_.lost)
        if reason is None:
            return await self._finish_passed(checks)
        agent = self.spec.agent
        if not final and agent.repair and not retry.receipt_invalid(checks):
            why = self._no_more_attempts(n)
            if why is None:
                safe, why = await self._safe_to_retry()
                if safe:
                    data = retry.feedback(self.job_id, n, checks)
                    await self._persist(functools.partial(self.folder.stash, n, feedback=True))
                    await self._persist(self.folder.write_feedback, data)
                    self.spec = self.spec.with_given("feedback.json", retry.digest(data))
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
        argv = attempt.argv(self.spec, self.folder.work, self.spec.agent.probe or ())
        folder = self.folder.attempts_dir / str(n)
        proc = attempt.process(self.spec, self.folder, n, argv, self.ctx.config(), folder, probe=True)
        try:
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

    async def _checks(self, exit_: Exit) -> list[CheckResult]:
        record, self._unsaved = self._unsaved, None
        collect = functools.partial(verify.collect, self.ctx, self.spec, self.order, self.folder, exit_, record)
        ev, self._followups = await self._persist(collect)
        return verify.check(ev)

    # -- finishing ----------------------------------------------------------------------------
    async def _finish_passed(self, checks: list[CheckResult]) -> Outcome:
        children = self._followups
        if children:
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

    async def finish(
        self, state: Row, reason: str | None, checks: list[CheckResult], children: list[str] | None = None
    ) -> Outcome:
        """Run the finishing sequence (``jobstore``) and release follow-ups of a done job."""
        if children is None:
            children = []  # a job that does not end done has none: its reservations are dropped
        self._children = children
        cost = total_cost(self.attempts)
        parent_cost = self.spec.parent_chain_cost_usd
        chain = None if cost is None and parent_cost is None else round((cost or 0) + (parent_cost or 0), 10)
        result = build_result(
            job_id=self.job_id,
            state=str(state),
            agent=self.agent,
            reason=reason,
            checks=checks,
            attempts=self.attempts,
            received=self.spec.received,
            parent=self.spec.parent,
            children=children,
            cost_usd=cost,
            chain_cost_usd=chain,
        )
        await self._persist(self.folder.stage_result, result)
        ok = await self.ctx.finisher.submit((self.folder, Finish(self.job_id, self.token, state, cost, chain), result))
        return await self._after_finish(state, ok, reason)

    async def _after_finish(self, state: Row, ok: bool, reason: str | None = None) -> Outcome:
        if not ok:
            log.warning("job.fenced", step="finish")
            return Outcome.FENCED
        if state in (Row.FAILED, Row.REVIEW):
            event = "job.failed" if state == Row.FAILED else "job.review"
            folder = self.ctx.layout.job(State.FAILED if state == Row.FAILED else State.REVIEW, self.job_id)
            self.ctx.notify(event, self.job_id, self.agent, reason, folder / "result.json")
        if state == Row.DONE and self._children != []:  # [] only when it surely has no follow-ups
            await self.ctx.lanes.io(self.ctx.release, self.job_id, self.token)
        return Outcome(str(state))
