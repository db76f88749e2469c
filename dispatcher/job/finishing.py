"""How a job ends: its result built, staged and landed (``Job.finish``), or landed by the post-exit trip.

``Finishing`` is the part of ``Job`` (``job.py``) that ends a job: the finishing sequence
from the loop (``finish``: the gate wait released, the workspace sealed, the landing owed,
the result staged and committed by ``Finisher``, waiting out a full disk), what the
post-exit trip needs to do the same in the io pool (``_ending``: the result and the
ledger's record, both pure), and the loop's part once that trip landed it (``_landed``).
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from dispatcher.job.context import JobContext
from dispatcher.job.control import Control, Left
from dispatcher.job.repowork import JobRepo
from dispatcher.job.settle import Ending, Settled
from dispatcher.job.waits import Waits
from dispatcher.ledger.base import Finish
from dispatcher.lifecycle import Outcome, Row, Stop, outcome_of
from dispatcher.shortage import DISK_WAIT_MAX_S, PAUSE_MIN_S, SHORT
from dispatcher.spec.jobspec import Attempt, JobSpec, total_cost
from dispatcher.spec.result import CheckResult, Result
from dispatcher.store.jobstore import JobFolder, give_back_rights
from dispatcher.store.results import build_result, is_disk_full

log = structlog.get_logger("dispatcher")
T = TypeVar("T")


class Finishing(abc.ABC):
    """The end of a job; ``Job`` supplies its state."""

    ctx: JobContext
    folder: JobFolder
    spec: JobSpec
    token: int
    job_id: str
    attempts: list[Attempt]
    control: Control
    waits: Waits
    repo: JobRepo

    @property
    @abc.abstractmethod
    def agent(self) -> str:
        """The job's agent's name."""

    @abc.abstractmethod
    def _start_done(self) -> None:
        """End the start the scheduler counted, if any."""

    async def finish(
        self, state: Row, reason: str | None, checks: list[CheckResult], children: list[str] | None = None
    ) -> Outcome:
        """Run the finishing sequence (``jobstore``) and release follow-ups of a done job."""
        self._start_done()  # a job that finishes is not starting an agent (a cancel, an expiry)
        if children is None:
            children = []  # a job that does not end done has none: its reservations are dropped
        await self.waits.release()  # a job cancelled while it waited for a gate no longer waits
        workspace = await self.repo.seal()
        await self.repo.owe_landing(state)
        try:
            result = self._result(
                state, reason, checks, children, {"workspace": workspace} if workspace is not None else None
            )
            finish = self._finish(state, result)
            ok = await self._until_written(  # the result is staged in the same trip as the ledger's commit
                lambda: self.ctx.finisher.finish(self.folder, finish, result, release=bool(children)),
                "finish",
                full_step="stage_result",
            )
            if ok:
                await self._after_final(state)
        finally:
            self.repo.let_go()  # a finish not committed (a stop, a lost lease) leaves its hooks to whoever ends it
        return outcome_of(state) if ok else Outcome.FENCED

    async def _after_final(self, state: Row) -> None:
        """Run what follows a committed finish (``JobRepo.after_final``): its hooks, its worktree's removal.

        The job is final already: an error there is logged, and never fails it a second time.
        """
        try:
            await self.repo.after_final(state, self.ctx.config(), self.ctx.finisher.notify, self.ctx.stopping)
        except Left:
            raise
        except Exception as exc:
            log.exception("daemon.error", step="after the finish", error=str(exc))

    async def _until_written(self, once: Callable[[], Awaitable[T]], step: str, *, full_step: str = "") -> T:
        """Return once()'s answer, trying again while it fails for want of room or resources.

        A shortage (``SHORT``) is waited out with its pause, a full disk with a backoff up to
        ``DISK_WAIT_MAX_S``; any other error is raised. A stop, or a lease this daemon lost,
        leaves the job where it is (``Left``).
        """
        delay = 0.5
        mended = False
        while True:
            if self.ctx.fenced():
                log.warning("job.fenced", step=step)
                raise Left
            try:
                return await once()
            except (OSError, MemoryError, RuntimeError) as exc:  # memory and threads are resources too (section 13)
                if not isinstance(exc, OSError) and not SHORT.note(exc, step):
                    raise
                if isinstance(exc, PermissionError) and not mended:
                    mended = True  # once: an agent may have taken the daemon's rights on the job's folders
                    if await self.ctx.lanes.io(give_back_rights, self.folder.path_str):
                        log.warning("job.rights_restored", step=step, error=str(exc))
                        continue
                    raise
                if not isinstance(exc, OSError) or SHORT.note(exc, step):
                    delay = max(SHORT.wait_s(), PAUSE_MIN_S)  # not now: the same step again after the pause
                elif not is_disk_full(exc):
                    raise
                else:
                    log.warning("job.waiting", reason="disk full", step=full_step or step, retry_s=delay)
                if await self.control.sleep(delay) or self.ctx.stopping():
                    raise Left from None
                delay = min(delay * 2, DISK_WAIT_MAX_S)

    def _ending(self, final: bool) -> Ending:
        control = self.control
        return Ending(
            final, self._result, self._finish, self.ctx.finisher.handoff, lambda: control.reason is Stop.CANCELLED
        )

    async def _landed(self, settled: Settled) -> Outcome:
        assert settled.finish is not None and settled.result is not None and settled.landed is not None  # noqa: S101
        state = settled.finish.state
        ok = await self.ctx.finisher.after_commit(settled.finish, settled.result, settled.landed, release=False)
        if ok:
            await self._after_final(state)
        return outcome_of(state) if ok else Outcome.FENCED

    def _result(
        self,
        state: Row,
        reason: str | None,
        checks: list[CheckResult],
        children: list[str] | None = None,
        extra: dict[str, object] | None = None,
    ) -> Result:
        """Return the job's result.json for its end in state (pure: the post-exit trip calls it in the io pool)."""
        cost, chain = self._costs()
        return build_result(
            job_id=self.job_id,
            state=str(state),
            agent=self.agent,
            reason=reason,
            checks=checks,
            attempts=self.attempts,
            received=self.spec.received,
            parent=self.spec.parent,
            children=children or [],
            cost_usd=cost,
            chain_cost_usd=chain,
            extra=extra,
            user_checks=[c.name for c in self.spec.agent.checks],
        )

    def _finish(self, state: Row, result: Result) -> Finish:
        """Return the ledger's record of the job's end in state, with the costs its result (``_result``) holds."""
        return Finish(self.job_id, self.token, state, result.cost_usd, result.chain_cost_usd)

    def _costs(self) -> tuple[float | None, float | None]:
        """Return the job's cost over its attempts and its chain's (the parents' included)."""
        cost = total_cost(self.attempts)
        parent_cost = self.spec.parent_chain_cost_usd
        chain = None if cost is None and parent_cost is None else round((cost or 0) + (parent_cost or 0), 10)
        return cost, chain
