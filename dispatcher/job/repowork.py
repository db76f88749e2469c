"""One job's side of contract section 15: its worktree, its diffs, its hooks.

``JobRepo`` is what ``Job`` calls: ``open`` before each attempt (the worktree is
made at the first, a retry starts again from base unless the agent repairs),
``snapshot`` before the checks (``attempts/<n>/diff.patch`` and ``changed.txt``),
``seal`` before the finish (uncommitted changes are committed on the branch, its
head is reported in result.json), ``after_final`` once the finish is committed
(the ``after`` hook of a final job, the worktree removed, the ``land`` hook of a
done job; a job entering review/ owes its ``after`` hook: ``afterowed``).
The git work runs in the io pool; the calls that change a repository's worktree
list are serialised per repository on the loop (``repo_lock``), so waiting for
one never holds a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import subprocess
from collections.abc import Awaitable, Callable, Container, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from dispatcher import faults, procs
from dispatcher.job import afterowed, gitview, hooks, landing, worktree
from dispatcher.job.control import Left
from dispatcher.job.gitview import GitView
from dispatcher.job.owed import RUNNING, Markers, Owed
from dispatcher.job.runner import AgentProcess, build_env, dispatch_env
from dispatcher.job.treehazards import hazard
from dispatcher.job.worktree import GitError, Workspace
from dispatcher.lanes import Lanes
from dispatcher.layout import Layout
from dispatcher.lifecycle import Row, State, landed_state
from dispatcher.shortage import PAUSE_MIN_S, SHORT
from dispatcher.spec.jobspec import JobSpec
from dispatcher.spec.repo import branch_for
from dispatcher.spec.settings import Config
from dispatcher.store.jobstore import JobFolder

log = structlog.get_logger("dispatcher")
_LOCKS: dict[str, asyncio.Lock] = {}
UNLOCK_HINT = "git worktree unlock PATH"  # how a worktree locked on purpose, named in ``workspace.locked``, goes


def repo_lock(repo: str) -> asyncio.Lock:
    """Return the loop's lock for one repository (worktree add, remove, prune)."""
    key = os.path.realpath(repo)
    lock = _LOCKS.get(key)
    if lock is None:
        lock = _LOCKS[key] = asyncio.Lock()
    return lock


class WorkspaceFailed(Exception):
    """The job's worktree could not be made: the job fails with this reason (no attempt runs).

    ``short``: the error was a shortage (descriptors, processes, memory), which is never the job's
    answer (section 13): the job's start waits for the pause instead.
    """

    def __init__(self, message: str, short: BaseException | None = None) -> None:
        super().__init__(message)
        self.short = short


_SHORT_TEXTS = {
    "Too many open files": errno.EMFILE,
    "Resource temporarily unavailable": errno.EAGAIN,
    "Cannot allocate memory": errno.ENOMEM,
    "Out of memory": errno.ENOMEM,
}


def _short_cause(exc: BaseException) -> BaseException | None:
    """Return exc as the shortage it reports (git's own message included), or None when it is none."""
    if isinstance(exc, MemoryError) or (
        isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM)
    ):
        return exc
    text = str(exc)
    for words, number in _SHORT_TEXTS.items():
        if words in text:
            return OSError(number, words)
    return None


def _snapshot(ws: Workspace, out: Path, left: Mapping[str, str] | None) -> tuple[list[str] | str, str]:
    """Save the worktree's change (io pool); return its paths (or the writes_scope rule it breaks) and its tree."""
    gitview.absorb(ws)  # a sandboxed agent's commits first
    names, tree = worktree.snapshot(ws, out, left=left)
    return hazard(ws.path, names) or names, tree


def _seal(ws: Workspace, job_id: str, tree: str | None) -> tuple[str, list[str]] | None:
    """Take a sandboxed agent's commits, then seal the worktree (io pool): ``worktree.seal``.

    None when the worktree was never made: git refused its branch (``A..B`` is a valid id,
    not a valid branch name), so there is nothing to seal and no branch to name.
    """
    if not worktree.is_ready(ws) and not worktree.has_branch(ws):
        return None
    gitview.absorb(ws)
    return worktree.seal(ws, job_id, tree)


def parent_head(layout: Layout, parent: str | None, repo: str, after: Sequence[str] = ()) -> str:
    """Return the final head of the parent's branch (``base: parent``); raise GitError saying why not.

    The parent is the job's lineage parent (it released the job as a follow-up); a job without
    one that waited for others (``after``) starts from the first of them, in the order named,
    that ended with a head on this repository, and so does a follow-up with ``after`` whose
    lineage parent has none there (a planner that fanned work out and joins it again).
    """
    if parent is not None and after:  # a follow-up that waited for others: its planner may have no head here
        try:
            return parent_head(layout, parent, repo)
        except GitError:
            return parent_head(layout, None, repo, after)  # the jobs it waited for, as for an order from outside
    if parent is None and len(after) == 1:
        parent = after[0]
    elif parent is None and after:
        for job_id in after:
            with contextlib.suppress(GitError):
                return parent_head(layout, job_id, repo)
        raise GitError(f"base: parent: none of the jobs in its after ({', '.join(after)}) has a head in {repo}")
    if parent is None:
        raise GitError("base: parent: the job has no parent")
    found = layout.find(parent)
    result = JobFolder(found[1]).result() if found is not None else None
    ws = result.extra.get("workspace") if result is not None else None
    ws = ws if isinstance(ws, dict) else {}
    if not ws.get("head"):
        raise GitError(f"base: parent: job {parent} has no workspace head")
    if os.path.realpath(str(ws.get("repo"))) != os.path.realpath(repo):
        raise GitError(f"base: parent: job {parent} worked on {ws.get('repo')}, not {repo}")
    return str(ws["head"])


class JobRepo:
    """The workspace, diffs and hooks of one job (absent parts do nothing)."""

    def __init__(self, layout: Layout, lanes: Lanes, spec: JobSpec, folder: JobFolder) -> None:
        self.layout = layout
        self.lanes = lanes
        self.spec = spec
        self.folder = folder
        self.ws: Workspace | None = None
        self.git_view: GitView | None = None  # the next attempt's view of the repository under the sandbox
        self._opened = False
        self._sealed: dict[str, Any] | None = None
        self._tree: str | None = None  # the last snapshot's tree: what seal puts on the branch
        self._changed: list[str] = []  # the last snapshot's changed paths: what the checks saw
        self._seal_failed = False  # the leftovers could not be committed: the worktree is the work's only copy
        # the job's wait out of a shortage's pause (True: a stop or cancel came); None: no wait, the step fails
        self.paused: Callable[[float], Awaitable[bool]] | None = None

    async def _waited(self, exc: BaseException, step: str) -> bool:
        """A git step met exc: if it is a shortage, wait its pause and return True (the step is tried again).

        False for any other error, or with no ``paused``. A shortage is never the job's answer
        (section 13). A stop or cancel during the pause raises ``Left``: the job stays where it is.
        """
        short = _short_cause(exc)
        if self.paused is None or short is None or not SHORT.note(short, step):
            return False
        if await self.paused(max(SHORT.wait_s(), PAUSE_MIN_S)):
            raise Left
        return True

    @property
    def path(self) -> Path | None:
        """The worktree's folder (None: the job has no workspace)."""
        return Path(self.ws.path) if self.ws is not None else None

    async def open(self, n: int, *, goes_on: bool = False) -> None:
        """Make the worktree before attempt n, or put it back at base for a retry; raise WorkspaceFailed.

        ``goes_on``: the attempt goes on from the last one's work (it resumes the agent's
        session, or it is a revision of a reviewed or failed job): its tree is kept, as
        with ``repair``.
        """
        conf = self.spec.agent.repo.workspace
        if conf is None:
            return
        self._tree = None  # a new attempt: the last one's snapshot is no longer what the job leaves
        keep = self.spec.agent.repair or goes_on
        try:
            async with repo_lock(conf.git):
                self.ws, self.git_view = await self.lanes.io(self._open, n, keep)
        except (GitError, OSError, MemoryError) as exc:
            said = str(exc) or type(exc).__name__
            if isinstance(exc, OSError):  # in words, never Python's `[Errno 2] ...: '/path'`
                said = f"{exc.strerror or said}: {exc.filename}" if exc.filename else exc.strerror or said
            raise WorkspaceFailed(f"workspace: {said}", _short_cause(exc)) from None
        self._opened = True

    def _open(self, n: int, keep: bool) -> tuple[Workspace, GitView | None]:
        """Make or reset the worktree (io pool); return it and, under the sandbox, its view of the repository."""
        conf = self.spec.agent.repo.workspace
        assert conf is not None  # noqa: S101 - open() checked
        base_ref, commit = conf.base, self.spec.base_commit  # the commit base named when the job was claimed
        if self.spec.order.get("base") == "parent":
            after = self.spec.order.get("after")
            after = [str(p) for p in after] if isinstance(after, list) else []
            base_ref, commit = parent_head(self.layout, self.spec.parent, conf.git, after), None
        branch = branch_for(conf.branch, self.spec.job_id)
        path = self.layout.worktree(self.spec.job_id)
        ws = worktree.plan(self.folder.path, conf.git, base_ref, branch, path, commit)
        if not os.path.isdir(ws.repo):  # a recorded job (a retry, a recovery) whose repository went away since
            raise GitError(f"repository {ws.repo} does not exist")
        gitview.absorb(ws)  # the last attempt's commits, if a crash came before they were taken
        if not worktree.is_ready(ws):
            worktree.create(ws, from_branch=keep and n > 1)
            faults.point("workspace.added")
        elif n > 1 and not keep and (self._opened or self.folder.attempt_numbers()):
            worktree.reset_to_base(ws)
        return ws, gitview.make(ws) if self.spec.agent.repo.sandbox else None

    async def load(self) -> None:
        """Read the job's workspace record (a recovered job, a retried one) before anything uses it."""
        if self.ws is None and self.spec.agent.repo.workspace is not None:
            self.ws = await self.lanes.io(worktree.read_record, self.folder.path)

    async def snapshot(self, n: int, left: Mapping[str, str] | None = None) -> list[str] | str | None:
        """Save attempt n's change against base; return the changed paths, why they are unknown, or None.

        None: the job has no workspace. A text: the change could not be read (the
        worktree is gone, git failed) or breaks a rule of writes_scope (a link out of
        the worktree, a hard link, a FIFO: ``treehazards``), which writes_scope then fails with.
        A shortage (descriptors, processes, memory) is never that answer: the look is made
        again after its pause (``_waited``).
        """
        if self.ws is None or n < 1:
            return None
        if not os.path.isdir(self.ws.path):
            return "the workspace is gone"
        out = self.folder.attempts_dir / str(n)
        while True:
            self._tree = None
            try:
                changed, self._tree = await self.lanes.io(_snapshot, self.ws, out, left)
                self._changed = changed if isinstance(changed, list) else []
                return changed
            except (GitError, OSError, MemoryError) as exc:
                if await self._waited(exc, "workspace.diff"):
                    continue
                log.warning("workspace.diff_failed", attempt=n, error=str(exc))
                return f"the change could not be read: {exc}"

    async def checks_left(self, earlier: Mapping[str, str]) -> Mapping[str, str]:
        """Return what the user checks that just ran left in the worktree, beside ``earlier`` (``worktree``)."""
        if self.ws is None or self._tree is None:
            return earlier
        try:
            return await self.lanes.io(worktree.left_by_checks, self.ws, self._tree, earlier)
        except (GitError, OSError, subprocess.SubprocessError) as exc:
            log.warning("workspace.diff_failed", error=str(exc))
            return earlier

    async def seal(self) -> dict[str, Any] | None:
        """Commit what is left on the branch; return result.json's ``workspace`` (None: no workspace)."""
        if self._sealed is not None or self.spec.agent.repo.workspace is None:
            return self._sealed
        if self.ws is None:
            self.ws = await self.lanes.io(worktree.read_record, self.folder.path)
            if self.ws is None:
                return None
        ws = self.ws
        while True:
            try:
                async with repo_lock(ws.repo):
                    sealed = await self.lanes.io(_seal, ws, self.spec.job_id, self._tree)
                if sealed is None:
                    return None
                head, changed = sealed
                break
            except (GitError, OSError, MemoryError) as exc:
                if await self._waited(exc, "workspace.seal"):
                    continue
                log.warning("workspace.seal_failed", error=str(exc), worktree=ws.path)
                head, changed = None, list(self._changed)  # what the checks saw; the worktree holding it is kept
                self._seal_failed = True
                break
        self._sealed = {"repo": ws.repo, "branch": ws.branch, "base": ws.base, "head": head, "changed": changed}
        return self._sealed

    def restore(self, sealed: Any) -> None:
        """Take the workspace a result already records (a finish cut short by a crash, completed now)."""
        if isinstance(sealed, dict):
            self._sealed = sealed

    async def owe_landing(self, state: Row) -> None:
        """Record, durably and before its finish, the landing a done (or reviewed) job owes and its after hook.

        A job in review/ owes them until a person decides (any daemon's pass runs them then); one
        final at once owes its after hook to this daemon, which holds the marker locked until
        ``after_final`` takes it, or ``let_go`` leaves it to the next pass: no pass lands the job
        while that marker is there. Its landing is owed as any: the daemon that claims it removes
        the job's worktree first (``housekeep``), if this one has not yet.
        """
        repo = self.spec.agent.repo
        if repo.after is not None:
            step = afterowed.own if state != Row.REVIEW else afterowed.owe
            await self.lanes.io(step, self.layout, self.spec.job_id)
        if repo.land is not None and state in (Row.DONE, Row.REVIEW):
            await self.lanes.io(landing.owe, self.layout, self.spec.job_id)

    def let_go(self) -> None:
        """Give up the markers this daemon holds for the job's hooks: what they owe stays owed, for a pass."""
        afterowed.let_go(self.spec.job_id)

    async def after_final(
        self,
        state: Row,
        cfg: Config,
        notify: landing.Notify | None,
        stopping: Callable[[], bool] = lambda: False,
        *,
        unowed: bool = False,
    ) -> None:
        """After the finish: run ``after`` (owed in review/), remove the worktree (branch kept), land a done job.

        The hooks' markers were written before the finish (``owe_landing``), and this daemon
        takes them; ``unowed``: no marker was written (a job finished without a Job), so the
        after hook's is made now. A hook another daemon took meanwhile (this job's finish was
        cut by a crash and completed here) is left to it, and so is the landing, which that
        daemon's pass runs after the hook. Once a stop has begun (``stopping``) no landing
        starts: it stays owed, and the next start lands the job (a landing started now would
        be ended at the stop's deadline, and recorded failed, never to run again on its own).
        """
        job_id = self.spec.job_id
        repo = self.spec.agent.repo
        io = functools.partial(self._sure_io, stopping)
        try:
            owes = (repo.after is not None and state != Row.REVIEW) or self.ws is not None
            owes = owes or (state == Row.DONE and repo.land is not None)  # a plain job's finish makes no trip here
            if owes and await self.lanes.io(os.path.isdir, self.layout.job(State.ACTIVE, job_id)):
                return  # not landed (job.stuck): what it owes stays owed, for the pass after its landing
            if repo.after is not None and state != Row.REVIEW:  # a job in review owes it until decided (``afterowed``)
                job_path = self.layout.job(landed_state(state), job_id)
                faults.point("after.before")
                if await io(afterowed.take, self.layout, job_id, new=unowed):  # a crash now is recorded
                    held = afterowed.MARKERS.held_fd(job_id)
                    run = await self._hook("after", repo.after, job_path, cfg, job_path / "work", keep_fd=held)
                    record = {**run.to_json(), "state": str(state)}
                    await io(afterowed.finish, self.layout, job_id, job_path, record)
                    if not run.ok:
                        log.warning("hook.failed", hook="after", reason=run.why)
            while self.ws is not None and not self._seal_failed:
                try:
                    async with repo_lock(self.ws.repo):
                        kept = await self.lanes.io(worktree.clear, self.ws)
                    if kept is not None:  # locked on purpose: whoever locked it unlocks it, then a start removes it
                        log.warning("workspace.locked", repo=self.ws.repo, worktrees=[kept], hint=UNLOCK_HINT)
                    break
                except (GitError, OSError, MemoryError) as exc:
                    short = _short_cause(exc)  # waited out until a stop, which leaves it to the next start
                    if short is not None and not stopping() and SHORT.note(short, "workspace.remove"):
                        await asyncio.sleep(max(SHORT.wait_s(), PAUSE_MIN_S))
                        continue
                    log.warning("workspace.remove_failed", error=str(exc))
                    if state == Row.DONE and repo.land is not None:
                        log.info(
                            "land.deferred",
                            reason="its worktree could not be removed: a later pass removes it, then lands the job",
                        )
                        return
                    break
            if state == Row.DONE and repo.land is not None:
                if stopping():
                    log.info("land.deferred", reason="a stop began: the next start lands the job")
                    return
                if repo.after is not None and await io(afterowed.busy, self.layout, job_id):
                    return  # another daemon runs the after hook: its pass lands the job after it
                faults.point("land.before")
                if await io(landing.take, self.layout, job_id, new=False):
                    await landing.land(self.layout, job_id, cfg, io, notify)
        finally:
            self.let_go()

    async def _sure_io(self, stopping: Callable[[], bool], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a step of a final job's hooks in the io pool, waiting out a shortage (section 13) until a stop."""
        while True:
            try:
                return await self.lanes.io(fn, *args, **kwargs)
            except (OSError, MemoryError) as exc:
                if stopping() or not SHORT.note(exc, "hooks"):
                    raise
                await asyncio.sleep(max(SHORT.wait_s(), PAUSE_MIN_S))

    async def before(self, n: int, cfg: Config, attach: Callable[[AgentProcess | None], None]) -> str | None:
        """Run the ``before`` hook of attempt n in the workspace; return why it failed, or None."""
        hook = self.spec.agent.repo.before
        if hook is None:
            return None
        run = await self._hook("before", hook, self.folder.attempts_dir / str(n), cfg, self.folder.work, attach, n=n)
        if run.ok:
            return None
        log.warning("hook.failed", hook="before", attempt=n, reason=run.why)
        return run.why

    async def _hook(
        self,
        name: str,
        hook: Any,
        log_dir: Path,
        cfg: Config,
        work: Path,
        attach: Callable[[AgentProcess | None], None] | None = None,
        *,
        n: int = 0,
        keep_fd: int | None = None,
    ) -> hooks.HookRun:
        """Run a hook of this job (``before`` of attempt n, or ``after``: n 0) with its placeholders."""
        ws = self.ws
        sealed = self._sealed or {}
        values = {
            "job_id": self.spec.job_id,
            "workspace": ws.path if ws is not None else str(work),
            "branch": ws.branch if ws is not None else "",
            "head": str(sealed.get("head") or ""),
            "result": str(log_dir / "result.json") if name == "after" else "",
        }
        cwd = Path(values["workspace"])
        if not cwd.is_dir():
            cwd = log_dir
        agent = self.spec.agent
        env = build_env(agent.env, dispatch_env(self.spec.job_id, work, n, Path(values["workspace"])), agent.pass_env)
        return await hooks.run_hook(
            name, hook, values, cwd=cwd, env=env, kill_grace_s=cfg.kill_grace_s,
            log_dir=log_dir if name == "before" else log_dir / "hooks", max_log_bytes=cfg.max_log_bytes,
            attach=attach, keep_fd=keep_fd,
        )  # fmt: skip


class FinalHooks:
    """The ``after`` hooks of jobs that end without a Job: cancelled in their claim, a join that fails.

    ``Finisher.finish_now`` hands each here (on the loop); it runs as a Job's own does
    (``JobRepo.after_final``), in the job's work/ since such a job never got a workspace
    (``{branch}`` and ``{head}`` empty), and ``drain`` waits for the ones still running.
    """

    def __init__(
        self, layout: Layout, lanes: Lanes, config: Callable[[], Config], notify: landing.Notify | None
    ) -> None:
        self.layout = layout
        self.lanes = lanes
        self.config = config
        self.notify = notify
        self._tasks: set[asyncio.Task[None]] = set()

    def own(self, spec: JobSpec) -> bool:
        """Write the job's after marker, held by this daemon, before its finish is committed (blocking).

        False when its agent has no after hook. ``start`` takes the marker once the job is final;
        a crash in between leaves the hook owed to the next pass (``afterowed``).
        """
        if spec.agent.repo.after is None:
            return False
        afterowed.own(self.layout, spec.job_id)
        return True

    def let_go(self, job_id: str) -> None:
        """Give up the held marker of a job whose finish was not committed: whoever ends the job owes the hook."""
        afterowed.let_go(job_id)

    def start(self, spec: JobSpec, state: Row) -> None:
        """Run the job's after hook in the background (nothing when its agent has none)."""
        if spec.agent.repo.after is None:
            return
        task = asyncio.get_running_loop().create_task(self._run(spec, state))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, spec: JobSpec, state: Row) -> None:
        folder = JobFolder(self.layout.job(landed_state(state), spec.job_id))
        with structlog.contextvars.bound_contextvars(job_id=spec.job_id, agent=spec.agent.name):
            try:
                repo = JobRepo(self.layout, self.lanes, spec, folder)
                await repo.after_final(state, self.config(), self.notify, unowed=True)
            except Exception as exc:  # the job is final already: a hook never changes it
                log.exception("daemon.error", step="after hook", error=str(exc))

    @property
    def busy(self) -> bool:
        """True while an after hook of a job finished without a Job runs: a stop waits for it (section 9)."""
        return bool(self._tasks)

    async def drain(self) -> None:
        """Wait for the hooks still running (at shutdown, before the lanes close)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


async def housekeep(
    layout: Layout,
    lanes: Lanes,
    cfg: Config,
    notify: landing.Notify | None,
    *,
    startup: bool,
    busy: Container[str] = (),
    stopping: Callable[[], bool] = lambda: False,
) -> None:
    """Tidy after a crash (at start); in a live pass, run what is owed as well: the after hooks of decided
    reviews, then landings (approved jobs, landings a crash postponed).

    Once ``stopping`` says a stop began, no further owed hook is taken (the next start runs it);
    one that runs goes on until the stop's deadline, as an agent does.

    At start, each configured repository's worktrees are pruned (the locked ones are
    named in one line: they must be unlocked on purpose), worktrees of jobs no longer
    active are removed, except those whose after hook is owed or runs now (in another
    daemon on this root). At start and in every pass, after hooks and landings a crash cut
    short (in this daemon's last run, or in another daemon on this root that died) are ended
    and recorded as failed. The start runs no owed hook itself: the daemon's first live pass
    does, beside the loop (``Housekeeping.run_owed``), so that a long `land` never holds up
    READY=1, the first claims or a stop's deadline.
    ``busy``: the jobs this daemon runs now, whose Job runs its own after hook and landing.
    """
    if startup:
        repos = sorted({a.repo.workspace.git for a in cfg.agents.values() if a.repo.workspace is not None})
        for repo in repos:
            try:
                async with repo_lock(repo):
                    locked = await lanes.io(worktree.prune, repo)
            except (GitError, OSError) as exc:
                log.warning("workspace.prune_failed", repo=repo, error=str(exc))
                continue
            if locked:
                log.warning("workspace.locked", repo=repo, worktrees=locked, hint=UNLOCK_HINT)
    afters = await lanes.io(afterowed.look, layout)
    cut = await _end_orphaned(layout, lanes, cfg, afters.running, "after", afterowed.MARKERS)
    if cut:  # their locks go with them (or stay with what could not be found: cut short all the same)
        afters = await _looked_again(lanes, layout, afterowed.MARKERS, cut)
    agents = await _end_leftovers(layout, lanes, cfg, afters.interrupted, "after")
    if startup or afters.interrupted:  # after the hooks a crash left running are ended: a hook runs in the worktree
        # an after hook owed now runs in its job's worktree, removed once it has run
        keep = await lanes.io(_unfinished, layout) + afters.ready + afters.running  # running: a live daemon's
        only = None if startup else afters.interrupted  # a live pass: the worktrees of the hooks another daemon cut
        removed = await lanes.io(worktree.sweep, layout.state_dir / "worktrees", keep, only=only)
        if removed:
            log.info("workspace.removed", jobs=removed)
    for job_id in afters.interrupted:
        await lanes.io(afterowed.record_interrupted, layout, job_id)
        log.warning("hook.failed", hook="after", job_id=job_id, agent=agents.get(job_id), reason=afterowed.INTERRUPTED)
    await _log_ended(layout, lanes, afters.ended, "after", notify)
    for job_id in [] if startup else afters.ready:
        if job_id in busy:  # its Job runs it itself (a revised review that ended again)
            continue
        if stopping():
            return
        if await lanes.io(afterowed.claim, layout, job_id):
            try:
                await afterowed.run(layout, job_id, cfg, lanes.io)
            except Exception as exc:  # the job is final already: a hook never changes it, nor stops the landings
                log.exception("daemon.error", step="after hook", job_id=job_id, agent=None, error=str(exc))
            await _remove_worktree(layout, lanes, job_id)  # final: its worktree goes once its after hook ran
    owed = await lanes.io(landing.look, layout)
    cut = await _end_orphaned(layout, lanes, cfg, owed.running, "land", landing.MARKERS)
    if cut:
        owed = await _looked_again(lanes, layout, landing.MARKERS, cut)
    agents = await _end_leftovers(layout, lanes, cfg, owed.interrupted, "land")
    for job_id in owed.interrupted:
        await lanes.io(landing.record_interrupted, layout, job_id)
        why = landing.INTERRUPTED
        log.warning("land.failed", job_id=job_id, agent=agents.get(job_id), reason=why)
        if notify is not None:
            notify.fire(
                "land.failed",
                job_id,
                agents.get(job_id),
                why,
                layout.job(State.DONE, job_id) / "result.json",
            )
    await _log_ended(layout, lanes, owed.ended, "land", notify)
    for job_id in [] if startup else owed.ready:
        if job_id in busy:  # its Job lands it itself, after its after hook and the worktree's removal
            continue
        if await lanes.io(afterowed.busy, layout, job_id):
            continue  # its after hook is owed or runs now (another pass, another daemon): landed after it
        if stopping():
            return
        if await lanes.io(landing.claim, layout, job_id):
            await _remove_worktree(layout, lanes, job_id)  # its daemon died, or ends it now: never landed beside it
            await landing.land(layout, job_id, cfg, lanes.io, notify)


async def _remove_worktree(layout: Layout, lanes: Lanes, job_id: str) -> None:
    """Remove a final job's worktree if one is left (its own daemon died before it did so); the branch stays."""
    try:
        removed = await lanes.io(worktree.sweep, layout.state_dir / "worktrees", (), only=[job_id])
    except (GitError, OSError) as exc:
        log.warning("workspace.remove_failed", job_id=job_id, error=str(exc))
        return
    if removed:
        log.info("workspace.removed", jobs=removed)


async def _log_ended(
    layout: Layout, lanes: Lanes, ended: list[tuple[str, dict[str, Any]]], hook: str, notify: landing.Notify | None
) -> None:
    """Log the lines of hook runs that ended before a crash cut their daemon short (their records just put in place).

    The run's own daemon logs them after the record; a crash in between left them to this pass:
    ``job.landed``, or ``land.failed`` (notified), or ``hook.failed`` for an after hook that failed.
    """
    if not ended:
        return
    places = await lanes.io(_works_of, layout, [job_id for job_id, _ in ended])
    for job_id, record in ended:
        agent = places[job_id][1] if job_id in places else None
        why = record.get("detail")
        if hook == "after":
            if record.get("ok") is not True:
                log.warning("hook.failed", hook="after", job_id=job_id, agent=agent, reason=why)
            continue
        if record.get("ok") is True:
            result = await lanes.io(JobFolder(layout.job(State.DONE, job_id)).result)
            wsr = result.extra.get("workspace") if result is not None else None
            head = wsr.get("head") if isinstance(wsr, dict) else None
            log.info("job.landed", job_id=job_id, agent=agent, head=head or None)
            continue
        log.warning("land.failed", job_id=job_id, agent=agent, reason=why)
        if notify is not None:
            notify.fire("land.failed", job_id, agent, why, layout.job(State.DONE, job_id) / "result.json")


async def _end_leftovers(
    layout: Layout, lanes: Lanes, cfg: Config, job_ids: list[str], hook: str
) -> dict[str, str | None]:
    """End what the hook runs a dead daemon left still run (their groups), before each run is recorded as cut short.

    Return the agent of each job found, for the lines that record the runs.

    A hook runs like an agent (section 15), so the rule for a dead daemon's agents holds
    for it (section 6): nothing of it runs on while the job is looked at, and ``dispatcher
    land`` never runs beside a landing still in flight. Its processes are found as an
    agent's are: by the ``DISPATCH_*`` variables every hook of the job gets.
    """
    if not job_ids:
        return {}
    places = await lanes.io(_works_of, layout, job_ids)
    groups = await lanes.scan(procs.job_groups, {job_id: work for job_id, (work, _) in places.items()})
    ends = []
    for job_id, pgids in groups.items():
        for pgid in pgids:
            log.warning("hook.orphan_ended", hook=hook, job_id=job_id, agent=places[job_id][1], pid=pgid)
            ends.append(procs.end_group(pgid, cfg.kill_grace_s))
    await asyncio.gather(*ends)
    return {job_id: agent for job_id, (_, agent) in places.items()}


async def _looked_again(lanes: Lanes, layout: Layout, markers: Markers, cut: list[str]) -> Owed:
    """Look at the markers again once the cut runs' groups are ended; those still locked by their dead locker
    count as cut short too.

    What holds such a marker's lock then is a process no look can find (a child that ran
    `setsid env -i`): the run is recorded as cut short all the same, as before a hook held its
    lock. One that another daemon's look has locked since (to record it) is that daemon's.
    """
    found: Owed = await lanes.io(markers.look, layout)
    maybe = [job_id for job_id in found.running if job_id in cut]
    held: list[str] = await lanes.io(_cut_short, markers.folder(layout), maybe) if maybe else []
    if not held:
        return found
    rest = [job_id for job_id in found.running if job_id not in held]
    return replace(found, interrupted=[*found.interrupted, *held], running=rest)


async def _end_orphaned(
    layout: Layout, lanes: Lanes, cfg: Config, job_ids: list[str], hook: str, markers: Markers
) -> list[str]:
    """End the hook runs of this host whose daemon died (their marker is locked by the hook's own processes).

    A hook holds its marker's lock with its daemon (``owed.look``), so that a daemon of another
    host (or another pid namespace) never takes a run still going for one cut short. A run whose
    lock was taken by a process that no longer runs as dispatcher (its daemon, or `dispatcher
    land`, died) is ended on the host where it runs as ``_end_leftovers`` ends an unlocked one's,
    before it is recorded; a live daemon's run, and what it started in sessions of its own, is
    never touched. Return the runs taken for cut short.
    """
    if not job_ids:
        return []
    cut: list[str] = await lanes.io(_cut_short, markers.folder(layout), job_ids)
    if cut:
        await _end_leftovers(layout, lanes, cfg, cut, hook)
    return cut


def _cut_short(folder: Path, job_ids: list[str]) -> list[str]:
    """Return the jobs whose ``.running`` marker's lock was taken by a process now gone or no dispatcher (blocking).

    A marker whose lock is not seen (settled meanwhile, or /proc/locks unreadable) is left alone.
    """
    out = []
    for job_id in job_ids:
        holder = procs.flock_holder(folder / f"{job_id}{RUNNING}")
        if holder is not None and not procs.is_dispatcher(holder):
            out.append(job_id)
    return out


def _works_of(layout: Layout, job_ids: list[str]) -> dict[str, tuple[str, str | None]]:
    """Return the work/ folder and agent of each final job found (blocking)."""
    out: dict[str, tuple[str, str | None]] = {}
    for job_id in job_ids:
        found = layout.find(job_id)
        if found is None:
            continue
        folder = JobFolder(found[1])
        try:
            agent: str | None = folder.spec().agent.name
        except (OSError, ValueError):
            agent = None
        out[job_id] = (os.fspath(folder.work), agent)
    return out


def _unfinished(layout: Layout) -> list[str]:
    """Return the ids of jobs in active/ (their worktrees stay; a job that never ran an attempt has none)."""
    try:
        return os.listdir(layout.folder(State.ACTIVE))
    except FileNotFoundError:
        return []
