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

import asyncio
import errno
import os
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from dispatcher.checks.builtin import verdict
from dispatcher.checks.facts import Exit
from dispatcher.clock import iso
from dispatcher.job import attempt
from dispatcher.job.agent_result import AGENT_RESULT_MAX, parse_agent_result, with_cut_start
from dispatcher.job.context import JobContext
from dispatcher.job.control import Control, Left
from dispatcher.job.deciding import Deciding
from dispatcher.job.finishing import Finishing
from dispatcher.job.repowork import JobRepo, WorkspaceFailed
from dispatcher.job.retry import WORK_GONE, retries_so_far
from dispatcher.job.revise import revisions
from dispatcher.job.runner import AGENT_TAIL_BYTES, AgentProcess
from dispatcher.job.waits import Waits, waited_s
from dispatcher.lanes import Handoff, handed_over
from dispatcher.ledger.base import Child, Finish, LedgerUnavailable
from dispatcher.ledger.records import Gate, GateKind, Request
from dispatcher.lifecycle import Outcome, Row, Stop, outcome_of
from dispatcher.shortage import SHORT
from dispatcher.spec.jobspec import Attempt, JobSpec, total_cost
from dispatcher.spec.order import Order
from dispatcher.spec.result import CheckResult, Result
from dispatcher.store.jobstore import JobFolder
from dispatcher.text import number

if TYPE_CHECKING:
    pass  # prometheus_client is imported only when metrics_file is set

log = structlog.get_logger("dispatcher")
T = TypeVar("T")


#: how a job whose agent its fenced daemon ended was interrupted (section 12)
FENCED_HOW = "its daemon could not renew its lease (the ledger was out of reach)"


class Job(Finishing, Deciding):
    """One job in active/<job_id>, driven to done/, failed/ or review/ (or left there on stop)."""

    agent: str = ""  # its agent's name, a plain attribute: asked several times a job (set in __init__)

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
        fresh: bool = False,
    ) -> None:
        self.ctx = ctx
        self.folder = folder
        if folder.claimed is None:
            folder.claimed = spec.claimed
        self.spec = spec
        self.agent = spec.agent.name  # a revision or a budget replaces spec, never its agent
        self.order = order
        self.token = token
        self.job_id = spec.job_id
        self.attempts = attempts or []
        self.recovering = recovering
        self.fresh = fresh  # claimed just now from inbox/: its attempts/ is known to be empty (not listed)
        self.host_lost = host_lost  # recovered from a daemon whose lease ran out (another host)
        self.control = Control()
        self.retries = retries_so_far(self.attempts)  # a recovered job's back-off goes on where it was
        # the cost so far the ledger knows (``_note_spend``): a recovered or retried job's row has its attempts'
        # cost already, dated when it was counted (a restart does not move it later in the daily window)
        self._spend_noted: float | None = total_cost(self.attempts)
        self.expires: float | None = None  # when the job ends expired if no attempt started by then (section 16)
        # while a usage limit holds it: when its limit waits add up to max_limit_wait (set aside until then at most)
        self.limit_until: float | None = None
        self._followups: list[Child] = []
        self._unsaved: Attempt | None = None  # the record of the attempt that just ended, not yet written
        self._loop: asyncio.AbstractEventLoop | None = None
        # called when an agent exits: True if its slot went to the next job while this one is checked
        # and finished (the scheduler's); another attempt then queues for a slot again (Outcome.AGAIN).
        # Its argument: whether a job claimed ahead may start on that slot at once (no usage limit hit)
        self.on_exit: Callable[[bool], bool] | None = None
        self.gave_back = False
        # counted in ``ctx.starts`` by the scheduler as it launched the job: the first start ends it
        self.counted_start = False
        self.checked: list[CheckResult] = []  # the last attempt's checks while its retry waits: a cancel keeps them
        self.waits = Waits(
            self.job_id,
            ctx.ledger,
            ctx.lanes,
            ctx.config,
            ctx.gates,
            self._notify_budget,
            note=ctx.note_gate,
            left_over=recovering,  # a wait row of the dead daemon's run is cleared once no gate holds the job
        )
        self.repo = JobRepo(ctx.layout, ctx.lanes, spec, folder)  # section 15: worktree, diffs, hooks
        self.repo.paused = self._paused  # a shortage met by its git work is waited out (section 13)

    async def run(self) -> Outcome:
        """Drive the job to its end and return how it ended; a bug fails the job, never the daemon."""
        self._loop = asyncio.get_running_loop()
        # the job's log context, bound and reset by hand: ``bound_contextvars`` costs a context manager and a
        # walk of every context variable at each job
        tokens = structlog.contextvars.bind_contextvars(job_id=self.job_id, agent=self.agent)
        try:
            try:
                return await self._run()
            finally:
                self._start_done()
                self.ctx.recovered(self.job_id)
        except Left:
            await self._keep_fenced()
            return Outcome.LEFT
        except LedgerUnavailable:
            if not self.ctx.stopping():
                raise
            return Outcome.LEFT  # a stop gave up a ledger wait: recovered at the next start
        except Exception as exc:
            log.exception("job.crashed", error=str(exc))
            try:
                # the checks of an attempt that was checked before the crash are kept, not shown as "not run"
                return await self.finish(Row.FAILED, f"crashed: {type(exc).__name__}: {exc}", self.checked)
            except Left:
                return Outcome.LEFT
            except Exception:
                log.exception("job.crashed", step="finish")
                return Outcome.LEFT
        finally:
            structlog.contextvars.reset_contextvars(**tokens)

    async def _run(self) -> Outcome:
        if self.recovering:
            self._start_done()  # recovery may probe, wait or finish first: counted again at its agent's start
        try:
            await self.repo.load()
        except (OSError, MemoryError) as exc:
            if SHORT.note(exc, "workspace"):
                return Outcome.SHORT  # nothing began: the job starts again once the shortage is over
            raise
        if self.recovering and self.folder.result() is not None:  # a fresh claim has no result yet
            return await self._reland()
        if self.recovering:
            self.recovering = False  # a job set aside for a gate runs again without a second recovery
            outcome = await self._recover()
            self.ctx.recovered(self.job_id)  # decided: it ended, or it goes on with a new attempt
            if outcome is not None:
                return outcome
        while True:
            if self.control.reason is Stop.STOPPED or self.ctx.stopping():
                return Outcome.LEFT  # no new attempt once a stop began: recovered at the next start
            if self.control.reason is Stop.CANCELLED:
                return await self.finish(Row.FAILED, Stop.CANCELLED, self.checked)
            if self.gave_back:
                return Outcome.AGAIN  # its slot went to other work when its agent exited: it queues for one
            numbers = [] if self.fresh else self.folder.attempt_numbers()
            self.fresh = False
            n = max([a.n for a in self.attempts] + numbers, default=0) + 1
            if n > 1:
                await self._persist(self.folder.stash, n - 1)
            # only an order never started can expire (a retried one has attempts/0/ with its kept result)
            expires = self.expires = self.order.expires if not numbers and not self.attempts else None
            if expires is not None and expires <= time.time():  # it waited for a slot or a gate too long
                return await self.finish(Row.FAILED, "expired", [])
            if (spent := await self._if_budget_spent()) is not None:
                return spent
            if self.attempts:
                await self._note_spend()
            if (gate := await self.waits.hold(self.spec.agent)) is not None:
                self.limit_until = self._limit_deadline() if gate.kind == GateKind.LIMIT else None
                if gate.until is not None and self.limit_until is not None and gate.until > self.limit_until + 0.001:
                    return await self._limit_wait_over(gate)
                return Outcome.GATED  # set aside by the scheduler, without slots, until the gate lifts (or it expires)
            self.limit_until = None
            ended = await self._attempt(n)
            if ended is None:
                continue  # a retry is due (the before hook failed), or a usage limit gave the attempt back
            if isinstance(ended, Outcome):
                return ended
            outcome = await self._decide(n, ended)
            if outcome is not None:
                return outcome

    async def _note_spend(self) -> None:
        """Before a further attempt of a capped agent, record what the attempts cost so far (section 14): a daily
        cap counts this job's own spend too, not only finished jobs'. Nothing without a cap or a new cost."""
        cfg = self.ctx.config()
        agent = cfg.agents.get(self.agent, self.spec.agent)
        if agent.max_daily_cost_usd is None and cfg.max_daily_cost_usd is None:
            return
        cost = total_cost(self.attempts)
        if cost is None or cost == self._spend_noted:
            return
        self._spend_noted = cost
        await self.ctx.lanes.ledger(self.ctx.ledger.note_spend, self.job_id, self.token, cost)

    def _limit_deadline(self) -> float | None:
        """Return when this job's usage-limit waits add up to max_limit_wait (epoch seconds); None for a fresh claim.

        Its own limits count as ``waited_s`` counts them (the last one in full); a wait at a gate
        another attempt's limit set or moved counts from when this job began to wait at it.
        """
        if not self.attempts:
            return None  # never ran: it waits as an order in inbox/ does
        last = max(self.attempts, key=lambda a: a.n)
        limited = last.extra.get("limited")
        if isinstance(limited, dict) and isinstance(limited.get("wait_s"), (int, float)):
            start = last.ended + float(limited["wait_s"])
        else:
            start = self.waits.waiting_since or time.time()
        # past the bound already (a retry or revise of a job failed for it): before the end of its own last limit
        return start + self.ctx.config().max_limit_wait_s - waited_s(self.attempts)

    async def _limit_wait_over(self, gate: Gate) -> Outcome:
        """Fail the job: the usage limit that holds its agent lasts beyond what max_limit_wait leaves it."""
        await self.waits.release()
        until, bound = iso(gate.until or time.time()), self.ctx.config().max_limit_wait_s
        text = gate.reason or "a usage limit"
        reason = f"limit: {text}; waiting until {until} is beyond max_limit_wait ({number(bound)} s)"
        last = max(self.attempts, key=lambda a: a.n)
        if isinstance(last.extra.get("limited"), dict):  # its own last attempt met the limit: none of it was checked
            return await self.finish(Row.FAILED, reason, self._limited_checks(last.n))
        checked = self.checked  # it waited for its retry at another job's limit
        if checked:
            lead: str | None = verdict(checked)
        else:  # a person's retry or revise of a job whose last attempt was checked: that end's lead and checks
            kept, checked = await self.ctx.lanes.io(self.folder.kept_end)
            lead = kept.split("; ", 1)[0] if kept and checked else None
        if lead is None:
            return await self.finish(Row.FAILED, reason, [])
        return await self.finish(Row.FAILED, f"{lead}; not retried: {reason}", checked)

    async def _reland(self) -> Outcome:
        """Finish a job cut short while landing: its result is already written."""
        result = self.folder.result() or Result(self.job_id, None, self.agent, None)
        state = Row(result.state or "failed")
        log.info("job.recovered", step="finish")
        finish = Finish(self.job_id, self.token, state, result.cost_usd, result.chain_cost_usd)  # its cost counts
        ok = await self.ctx.finisher.land(self.folder, finish, result, release=True)
        if ok and state in (Row.DONE, Row.FAILED, Row.REVIEW):
            self.repo.restore(result.extra.get("workspace"))
            await self._after_final(state)
        return outcome_of(state) if ok else Outcome.FENCED

    async def _keep_fenced(self) -> None:
        """Left while fenced (no lease renewal for lease / 2): keep the last attempt's record if it was not written.

        Its agent's exit (or the end the fence gave it) is known here; recovery, by this daemon after
        the renewal or by the one that takes the job over, records it instead of an interrupted attempt
        whose exit status was lost.
        """
        if not self.attempts or not self.ctx.fenced():
            return
        last = self.attempts[-1]
        if last.aborted == Stop.STOPPED:  # the fence ended it: said so in the record and the reason
            last = replace(last, extra={**last.extra, "lease_unrenewed": True})
        try:
            await self.ctx.lanes.io(self.folder.keep_fenced_attempt, last)
        except OSError as exc:  # recovery then records the attempt as interrupted, its exit status lost
            log.warning("job.fenced", step="keep_attempt", error=str(exc))

    # -- recovery ---------------------------------------------------------------------------
    async def _recover(self) -> Outcome | None:
        """Pick up a job whose daemon died: end its agent, then let the evidence decide."""
        numbers = self.folder.attempt_numbers()
        # one attempt a folder (a cut one has no record yet; attempts/0/ is a retry's kept result)
        log.info("job.recovered", attempts=sum(1 for k in numbers if k))
        if not numbers:
            return None
        n = numbers[-1]  # its agent's group was ended before the job was queued (``Housekeeping.recover``)
        if self.folder.has_kept_result(n):
            return None  # reopened by `dispatcher retry`: go on with a new attempt
        record = next((a for a in self.attempts if a.n == n), None)
        if record is None and (kept := await self._persist(self.folder.take_fenced_attempt, n)) is not None:
            record = kept  # its daemon was fenced when the attempt ended: the exit it saw, not a lost one
            self.attempts.append(record)
        if await self.ctx.lanes.io(self._cancel_asked):  # while no daemon ran: it ends as a live cancel does
            if record is None and not self.folder.never_started(n):  # its cut attempt is recorded all the same
                await self._record_cut(n)
            return await self.finish(Row.FAILED, Stop.CANCELLED, [])
        # its agent never started: attempt n runs as if the crash had come before it. Not for a job
        # taken over from a lost host, whose daemon may still be about to start that agent there,
        # nor with a receipt in work/ (a power cut lost the logs of an agent that ran: the checks decide)
        receipt = os.path.lexists(self.folder.work / "receipt.json")
        unstarted = record is None and self.spec.agent.retry_safe and not self.host_lost and not receipt
        if unstarted and await self._persist(self._give_back_unstarted, n):
            return None
        if record is None or record.interrupted or record.aborted == Stop.STOPPED:
            started = not self.folder.never_started(n)  # looked at before the cut's record makes its logs
            if record is None:
                record = await self._record_cut(n)
            if record.retry_next:
                return None
            if receipt:
                return await self._decide(n, Exit(lost=True), final=True)
            fenced = record.extra.get("lease_unrenewed") is True
            if fenced:  # ended by its own daemon, fenced: the exit is known
                cut = replace(attempt.exit_of(record, self.spec.timeout_s), aborted="ended by its daemon")
            else:
                cut = Exit(lost=True, started=started)
            checks = await self._checks(cut, n)
            why = verdict(checks, exit_lost=not fenced) or "receipt_present: no receipt.json"
            how = "its host was lost" if self.host_lost else FENCED_HOW if fenced else "by a stop or crash"
            return await self._retry_or_fail(n, f"{why}; attempt {n} was interrupted: {how}", checks)
        if record.retry_next:
            return None
        # its exit was recorded before the crash; with a receipt, its agent is not run again (section 6)
        return await self._decide(n, attempt.exit_of(record, self.spec.timeout_s), final=receipt)

    async def _record_cut(self, n: int) -> Attempt:
        """Record attempt n, cut short by the crash of its daemon, as interrupted; return its record."""
        started = self.folder.attempt_started(n)  # before its logs are made below, which would move it
        noted = self.folder.pid_record(n)  # the host its agent ran on: the dead daemon's, not this one's
        host = noted.get("host") if noted is not None and isinstance(noted.get("host"), str) else None
        agent_ran = not self.folder.never_started(n)  # without logs, only its before hook ran (if any)
        await self._persist(partial(self.folder.make_logs, n, keep=True))  # every attempt has two logs
        earlier = [a for a in self.attempts if a.n < n]
        ran = attempt.argv_after(self.spec, self.folder.work, earlier, self.repo.path) if agent_ran else []
        tail = await self.ctx.lanes.io(self.folder.stdout_tail, n, AGENT_TAIL_BYTES)
        result = await self.ctx.lanes.io(self._agent_result, n, tail) if tail.strip() else None
        resumed = attempt.command_for(self.spec.agent, earlier)[1]
        record = attempt.interrupted(n, started, ran, result, earlier, resumed, host)
        self.attempts.append(record)
        await self._persist(self.folder.record_attempt, record)
        return record

    def _agent_result(self, n: int, tail: bytes) -> dict[str, Any] | None:
        """Return attempt n's agent_result from its stdout tail (an object longer than it: its start from the log)."""
        result = parse_agent_result(tail)
        return with_cut_start(tail, result, self.folder.stdout_path(n), AGENT_TAIL_BYTES)

    async def _paused(self, delay: float) -> bool:
        """Wait delay (a shortage's pause); return True if a stop or cancel came meanwhile."""
        return await self.control.sleep(delay) or self.ctx.stopping()

    def _cancel_asked(self) -> bool:
        """Return True if `dispatcher cancel` asked for this job and the request is still open (io pool)."""
        return self.spec.job_id in self.ctx.ledger.requests(Request.CANCEL)

    def _give_back_unstarted(self, n: int) -> bool:
        """Remove attempts/<n>/ of an agent that never started; return True if it is gone."""
        if not self.folder.never_started(n):
            return False
        self.folder.drop_attempt(n)
        return n not in self.folder.attempt_numbers()  # a before hook's logs keep it: it counts

    def _unstarted_checks(self, n: int) -> list[CheckResult]:
        """The checks of a job whose attempt n could not start: none ran on it (its reason names none).

        With no earlier attempt, "the job ended before any attempt was checked" (``build_result``).
        After one, that would deny the attempts that ran, so each check says attempt n ran no
        agent, as when its before hook fails: no false check of an earlier attempt stands beside
        a reason that names none.
        """
        return self._unchecked(f"attempt {n} ran no agent: it could not start") if self.attempts else []

    # -- one attempt --------------------------------------------------------------------------
    async def _attempt(self, n: int) -> Exit | Outcome | None:
        """Run attempt n; return its Exit, how the job ended when it never ran or was stopped, or None to go on
        (a retry was scheduled, or a usage limit gave the attempt back)."""
        agent = self.spec.agent
        if agent.repo.workspace is not None:
            self._start_done()  # a worktree may wait for its repository's lock: counted again at the spawn
        try:
            if agent.repo.workspace is not None:
                resumes = attempt.command_for(agent, self.attempts)[1] is not None
                # a revision (or a repair) gave a note, or the job was revised before: go on from the work
                revised = "feedback.json" in self.spec.given or revisions(self.folder) > 0
                await self.repo.open(n, goes_on=resumes or revised)
        except WorkspaceFailed as exc:
            if self.control.reason is Stop.STOPPED or self.ctx.stopping():
                return Outcome.LEFT  # a stop ended its checkout (or came during it): the next start makes it again
            if exc.short is not None and SHORT.note(exc.short, "workspace"):
                return Outcome.SHORT  # its start waits for the pause, as an agent's does
            reason = f"config: agent {agent.name} cannot start: {exc}"
            log.error("agent.exited", error=reason)  # no attempt (section 6)
            return await self.finish(Row.FAILED, reason, self._unstarted_checks(n))
        if agent.repo.workspace is not None:  # the worktree may have taken seconds: a stop or cancel meanwhile
            if self.control.reason is Stop.STOPPED or self.ctx.stopping():
                return Outcome.LEFT  # no agent starts once a stop began: the attempt runs at the next start
            if self.control.reason is Stop.CANCELLED:
                return await self.finish(Row.FAILED, Stop.CANCELLED, self.checked)
        argv = attempt.argv_after(self.spec, self.folder.work_dir, self.attempts, self.repo.path)
        proc = await self._spawn(n, argv)
        if proc is None or isinstance(proc, Outcome):
            return proc
        if isinstance(proc, OSError):
            why = proc.strerror or str(proc)
            why += f": {proc.filename}" if proc.filename else ""
            if self._work_gone():  # not the config: a retry of a job whose agent removed its work/ (section 5 wording)
                why = WORK_GONE
            elif proc.errno == errno.E2BIG:  # this order's values (a long {prompt}) outgrew one argument or argv
                size = sum(len(os.fsencode(a)) + 1 for a in argv)
                why += f" (this order makes its command line {size} bytes: give it {{prompt_file}}, not {{prompt}})"
            reason = f"config: agent {agent.name} cannot start: {why}"
            log.error("agent.exited", error=reason)  # no attempt (section 6)
            return await self.finish(Row.FAILED, reason, self._unstarted_checks(n))
        self.control.attach(proc)
        log.info("agent.started", attempt=n, pid=proc.pid)  # recovery finds it by its environment, unrecorded
        out = await proc.wait()
        self.control.attach(None)
        tail = out.stdout_tail
        small = len(tail) <= AGENT_RESULT_MAX
        result = parse_agent_result(tail) if small else await self.ctx.lanes.io(self._agent_result, n, tail)
        record = attempt.record(n, out, argv, result, self.attempts, attempt.command_for(agent, self.attempts)[1])
        hit = None if out.aborted else self._limit_of(out)
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
            limited=hit is not None or None,
        )
        if self.on_exit is not None and not self.gave_back:  # the slot goes on (to a job claimed ahead: it starts)
            self.gave_back = self.on_exit(hit is None)
        if hit is not None:
            return await self._limited(record, hit)
        self.attempts.append(record)
        if out.aborted:
            await self._persist(self.folder.record_attempt, record)
        else:
            self._unsaved = record  # written in the same trip off the loop as the checks' evidence
        if out.aborted == Stop.STOPPED:
            return Outcome.LEFT
        if out.aborted == Stop.CANCELLED:  # the attempt ran: its checks are recorded (exit_ok: "cancelled after N s")
            cut = replace(attempt.exit_of(record, self.spec.timeout_s), aborted=str(Stop.CANCELLED))
            checks = await self._checks(cut, n)  # diff.patch and changed.txt too (section 15)
            return await self.finish(Row.FAILED, Stop.CANCELLED, checks)
        return attempt.exit_of(record, self.spec.timeout_s)

    def _notify_budget(self, agent: str, job_id: str, reason: str | None) -> None:
        """Notify budget.gated (called from the ledger lane: handed to the loop)."""
        notify = self.ctx.finisher.notify
        if notify is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(notify.fire, "budget.gated", job_id, agent, reason, None)

    async def _spawn(self, n: int, argv: list[str]) -> AgentProcess | OSError | Outcome | None:
        """Begin attempt n, run its before hook, and start its agent; return the error if it cannot start.

        A shortage (descriptors, processes, memory) is not an attempt: the attempt's
        folder goes and the job returns ``Outcome.SHORT``, so that the scheduler
        gives its slot back and starts it again once the shortage is over. A failed
        before hook fails the attempt (None: a retry was scheduled).
        """
        starts = self.ctx.starts
        if self.counted_start:
            self.counted_start = False  # counted since the scheduler launched the job
        else:
            starts.begin()  # until the agent runs, a finished job's checks and claims made ahead wait
        try:
            try:
                # a folder, two empty logs, on the loop; fsynced at once when no other agent is being
                # started, else at the end of the turn, with the other agents of this turn
                alone = starts.count == 1
                log_dir = self.folder.begin_attempt(n, sync=alone)
                if not alone:
                    await self.ctx.lanes.sync_this_turn(self.folder.attempts_path)
            except OSError as exc:
                if SHORT.note(exc, "begin_attempt"):
                    self.folder.drop_attempt(n)
                    return Outcome.SHORT
                with starts.paused():  # a full disk: nothing waits for this one
                    log_dir = await self._persist(self.folder.begin_attempt, n, inline=True)
            if self.spec.agent.repo.before is not None:
                with starts.paused():  # a hook may run long: nothing waits for it
                    go_on, ended = await self._before(n)
                if not go_on:
                    return ended
            return await self._start(n, argv, log_dir)
        finally:
            starts.end()

    def _start_done(self) -> None:
        """End the start the scheduler counted, if the job ended before it reached its agent's start."""
        if self.counted_start:
            self.counted_start = False
            self.ctx.starts.end()

    async def _before(self, n: int) -> tuple[bool, Outcome | None]:
        """Run the before hook of attempt n; return (True, None) to start the agent, else (False, how it goes on)."""
        why = await self.repo.before(n, self.ctx.config(), self.control.attach)
        if self.control.reason is Stop.STOPPED:
            return False, Outcome.LEFT
        if self.control.reason is Stop.CANCELLED:  # an attempt like any other: recorded, with its two logs
            await self._record_hook_attempt(replace(attempt.hook_failed(n, "cut by a cancel"), aborted=Stop.CANCELLED))
            return False, await self.finish(Row.FAILED, Stop.CANCELLED, [])
        if why is not None:
            return False, await self._before_failed(n, why)
        return True, None

    async def _start(self, n: int, argv: list[str], log_dir: str) -> AgentProcess | OSError | Outcome:
        """Start attempt n's agent; return the error if it cannot start (a shortage: ``Outcome.SHORT``)."""
        cfg = self.ctx.config()
        proc = attempt.process(
            self.spec, self.folder, n, argv, cfg, log_dir, workspace=self.repo.ws, git_view=self.repo.git_view,
            slot_fd=self.ctx.slot_fd(self.job_id, self.agent),
        )  # fmt: skip
        if self.ctx.fenced():  # its lease went unrenewed for lease/2 (section 12): no agent starts now;
            await self.ctx.lanes.io(self.folder.drop_attempt, n)  # recovery takes the job back once it is renewed
            return Outcome.LEFT  # (a claim that was on its way to the ledger during an outage lands here)
        try:
            self.folder.make_logs(n)  # the sign that this attempt's agent may have started
            proc.start()
            self.folder.note_agent(n, proc.pid, proc.keep_fd)  # how recovery finds it, whatever its environment
        except OSError as exc:
            await self.ctx.lanes.io(self.folder.drop_attempt, n)
            return Outcome.SHORT if SHORT.note(exc, "agent.start") else exc
        SHORT.ok()
        return proc

    async def _before_failed(self, n: int, why: str) -> Outcome | None:
        """The before hook of attempt n failed: the attempt fails with its reason (retried if attempts remain)."""
        await self._record_hook_attempt(attempt.hook_failed(n, why))
        why_not = self._no_more_attempts(n)
        if why_not is not None:  # its reason names no check: none stands beside it as the first failing one
            unchecked = self._unchecked(f"attempt {n} ran no agent: its before hook failed")
            return await self.finish(Row.FAILED, f"{why}; not retried: {why_not}", unchecked)
        return await self._schedule_retry(n, why)

    async def _record_hook_attempt(self, record: Attempt) -> None:
        """Record an attempt that ended in its before hook, its agent never started.

        An attempt like any other (sections 1 and 15): two logs, empty since no agent ran (made
        after the record, so a crash never makes it look started), and what the hook changed in
        the workspace.
        """
        self.attempts.append(record)
        await self._persist(self.folder.record_attempt, record)
        await self._persist(partial(self.folder.make_logs, record.n, keep=True))
        await self.repo.snapshot(record.n)

    async def _persist(
        self, fn: Callable[..., T | Handoff[T]], *args: object, inline: bool | Callable[[], bool] = False
    ) -> T:
        """Run a bookkeeping write off the loop; on a full disk, wait (a stop leaves the job where it is).

        ``inline`` runs it on the loop itself: for a few small creates, cheaper than a trip to a thread
        (a ``Handoff`` it returns is then started from the loop). A callable is asked again at each
        try, since a wait for room can be long.
        """

        async def once() -> T:
            if inline is True or (callable(inline) and inline()):
                answer = fn(*args)
                return await handed_over(answer) if isinstance(answer, Handoff) else answer
            return await self.ctx.lanes.io_then(fn, *args)

        return await self._until_written(once, getattr(fn, "__name__", "write"))
