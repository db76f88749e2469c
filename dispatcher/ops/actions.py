"""What an operator does to one job at a time: retry, cancel, hold and release.

Each action takes one job id, returns the line to print for the person, and
raises ``NotFound`` or ``WrongState`` (exit 1 for that id) when it cannot act;
the command line runs it for every id it was given.

Hold and release move order files between inbox/ and held/, racing a daemon
that may be claiming the same file. A daemon claims by hard-linking the inbox
file into a staging folder, claiming the id in the ledger, renaming the
staging folder to active/<id> and unlinking the inbox name. So after a hold
has moved the file into held/, a link count above 1 means a daemon holds a
second name: the hold waits until the daemon lets go (the count drops to 1:
held) or the claimed job's folder holds that very file (then the held/ name is
only a second name of its order: it is removed and the id was not queued).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import structlog
from filelock import FileLock, Timeout

from dispatcher import fsutil
from dispatcher.errors import NotFound, WrongState, printable
from dispatcher.job.recovery import Landed, land_recorded_end, settle_claim
from dispatcher.layout import JOB_ID, Layout, check_id, hint_name
from dispatcher.ledger.base import EVERY_AGENT, Gate, GateKind, Ledger, Request
from dispatcher.lifecycle import Row, State, is_final, notified_event
from dispatcher.ops.sharing import hand_over
from dispatcher.query.report import read_order_file
from dispatcher.spec.settings import Config
from dispatcher.store.jobstore import JobFolder
from dispatcher.store.ledgers import PATIENCE_S, open_ledger
from dispatcher.store.queued import find_queued, queued_afters
from dispatcher.text import plural

log = structlog.get_logger("dispatcher")

#: how long a hold waits for a daemon that is claiming the same file to finish or let go
CLAIM_WAIT_S = 2.0
#: how long `cancel` of a running job waits to see whether the job ended before its daemon took the cancel
CANCEL_SEEN_S = 1.0
#: at most this many files carrying one job id are moved by one hold or release
_MAX_FILES = 100


MOVES_LOCK_S = 30.0  # how long hold and release wait for another one moving orders


class Operator:
    """The operator's actions on one dispatch root; opens the ledger once for every id."""

    def __init__(self, config: Config, layout: Layout) -> None:
        self.config = config
        self.layout = layout
        self._ledger: Ledger | None = None
        self.reason: str | None = None  # the text of a reject
        self.note: str | None = None  # the text of a revise
        self.notes: list[str] = []  # lines for stderr that go with an action that was done (a warning)
        self._moves: FileLock | None = None  # ``_moving``: one command at a time moves orders between inbox/ and held/

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = open_ledger(self.config, self.layout, patience_s=PATIENCE_S)
        return self._ledger

    def close(self) -> None:
        """Close the ledger if it was opened."""
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    # -- retry and cancel -----------------------------------------------------------------
    def retry(self, job_id: str) -> str:
        """Record a retry of a failed job for a running (or the next) daemon."""
        with self._acting_on(job_id):
            found = self.layout.find(job_id)
            if found is None:
                self._still_an_order(job_id, NotFound(f"{job_id}: no such job"), "only a failed job can be retried")
            if found[0] is not State.FAILED:
                said = self.ledger.spoken_state(found[0], job_id)
                raise WrongState(f"{job_id}: is {said}, only a failed job can be retried")
            try:
                JobFolder(found[1]).spec()
            except ValueError:
                raise WrongState(f"{job_id}: its job.json is damaged; it cannot be retried") from None
            self._row_says(job_id, (Row.FAILED,), Request.RETRY)
            if job_id in self.ledger.requests(Request.REVISE):
                # one more attempt is asked for already, with a note: also while a daemon carries it out, or after a
                # daemon died doing so (its row claimed, the folder still here: the next start finishes it)
                raise WrongState(f"{job_id}: a revision is already requested; it runs the job again")
            self.ledger.request(job_id, Request.RETRY)
            self._note_blocked_join(job_id, found[1])
            self._poke("retry", job_id)
            return f"{job_id}: retry requested"

    def parents_first(self, ids: list[str]) -> list[str]:
        """Return ids with each failed join moved after those of its ``after`` parents that are among them.

        For a retry or revise of several ids: the parent's request is then recorded before
        its join's, so the join's note leaves the parent out and a daemon, which takes
        requests oldest first, runs the parent again before the join waits for it. The
        order of the ids on the command line does not matter; ids unrelated keep theirs.
        """
        at: dict[str, list[int]] = {}
        for i, job_id in enumerate(ids):
            at.setdefault(job_id, []).append(i)
        parents = [[k for p in self._after(job_id) for k in at.get(p, ())] for job_id in ids]
        placed: set[int] = set()
        out: list[str] = []
        for first in range(len(ids)):
            stack = [first]
            while stack:
                i = stack[-1]
                todo = [k for k in parents[i] if k not in placed and k not in stack]
                if todo:
                    stack.append(todo[0])
                    continue
                stack.pop()
                if i not in placed:
                    placed.add(i)
                    out.append(ids[i])
        return out

    def _after(self, job_id: str) -> list[str]:
        """Return the ``after`` of a failed job's order (empty for anything else)."""
        if not JOB_ID.fullmatch(job_id):
            return []
        found = self.layout.find(job_id)
        if found is None or found[0] is not State.FAILED:
            return []
        from dispatcher.store.jobstore import JobFolder

        try:
            after = JobFolder(found[1]).spec().order.get("after")
        except (OSError, ValueError):
            return []
        return [str(p) for p in after] if isinstance(after, (list, tuple)) else []

    def _note_blocked_join(self, job_id: str, folder: Path) -> None:
        """Note (``notes``) that a failed join run again waits for a job that failed and is not run again.

        Its wait then fails it at once (``after: X failed``), without an attempt; the
        operator is told what to run first. The request is made all the same (section 6).
        """
        from dispatcher.job.joins import ALL_FINAL
        from dispatcher.store.jobstore import JobFolder

        try:
            order = JobFolder(folder).spec().order
        except (OSError, ValueError):
            return
        after = order.get("after")
        if not after or order.get("after_rule") == ALL_FINAL:
            return
        failed = {j for j, e in self.ledger.known(list(after)).items() if e.state == Row.FAILED}
        failed -= {*self.ledger.requests(Request.RETRY), *self.ledger.requests(Request.REVISE)}  # run again soon
        if failed:
            names = sorted(failed)
            self.notes.append(
                f"{job_id}: note: it waits for {', '.join(names)}, which failed: it fails again at once"
                f" unless {' and '.join(names)} {'is' if len(names) == 1 else 'are'} retried too"
            )

    def cancel(self, job_id: str) -> str:
        """Record a cancel of a queued or running job for a running (or the next) daemon."""
        check_id(job_id)
        self._settle_cut(job_id)
        entry = self.ledger.get(job_id)
        for kind, what in ((Request.RETRY, "retry"), (Request.REVISE, "revision")):
            if entry is not None and entry.state == Row.FAILED and job_id in self.ledger.requests(kind):
                self.ledger.clear_request(job_id, kind)  # queued to run again: it runs no more
                entry = self.ledger.get(job_id)
                if entry is not None and entry.state == Row.FAILED:
                    return f"{job_id}: {what} withdrawn; it stays failed"
                # a daemon reopened it first: it is queued or running now, and cancelled as such
        held = False
        if entry is None:  # an order without a row yet: in inbox/, in held/, or claimed since the row was read
            with self._moving(job_id):  # a release or hold moving it between the two looks would hide it from both
                queued = bool(find_queued(self.layout.inbox, [job_id]))
                held = not queued and bool(find_queued(self.layout.held, [job_id]))  # put on hold by hand
            if not queued and not held:
                entry = self.ledger.get(job_id)  # a claim writes its row before the order leaves inbox/
                if entry is None:
                    raise NotFound(f"{job_id}: no such job")
        if entry is not None and is_final(entry.state):
            raise WrongState(f"{job_id}: is {entry.state}, only a queued or running job can be cancelled")
        if entry is not None and entry.state == Row.REVIEW:  # its agent is done: a person decides
            raise WrongState(
                f"{job_id}: is in review, only a queued or running job can be cancelled: approve or reject it"
            )
        held = held or (entry is not None and entry.state == Row.HELD)
        self.ledger.request(job_id, Request.CANCEL)
        # a hold that raced this cancel may have moved the order into held/ since it was looked for above
        if held or find_queued(self.layout.held, [job_id]):
            self._unhold(job_id)
        self._poke("cancel", job_id)
        # read again: a daemon may have claimed it (a release racing the look) and even finished it since
        entry = self.ledger.get(job_id) or entry
        running = entry is not None and entry.state == Row.CLAIMED and entry.owner is not None
        ended = Row(entry.state) if entry is not None and entry.state in (Row.DONE, Row.REVIEW) else None
        if running and entry is not None and entry.owner is not None and self.ledger.alive(entry.owner):
            ended = self._until_cancel_taken(job_id)
        if ended == Row.DONE:
            raise WrongState(f"{job_id}: it ended done before the cancel reached it")
        if ended == Row.REVIEW:
            raise WrongState(f"{job_id}: it passed into review before the cancel reached it: approve or reject it")
        return f"{job_id}: cancel requested"

    def _until_cancel_taken(self, job_id: str) -> Row | None:
        """Wait (at most ``CANCEL_SEEN_S``) for a running job's daemon to end it; return the state it ended in.

        A job whose agent had just exited may be finishing as the request lands: its daemon
        may record it done first (the request is then spent unheard). Said so, that is not
        "cancel requested". None: still running (its agent is being ended), or the request withdrawn.
        """
        deadline = time.monotonic() + CANCEL_SEEN_S
        while True:
            entry = self.ledger.get(job_id)
            if entry is None or entry.state != Row.CLAIMED:
                return Row(entry.state) if entry is not None else None
            if time.monotonic() >= deadline or job_id not in self.ledger.requests(Request.CANCEL):
                return None
            time.sleep(0.01)

    def _settle_cut(self, job_id: str) -> None:
        """Land a job whose dead daemon recorded its end (and notify it, as the daemon would have), then put back
        the row of a job a dead daemon had claimed to run again (``_settle_claim_cut``)."""
        landed = land_recorded_end(self.layout, self.ledger, job_id)  # its daemon died between the record and move
        if landed is not None:
            tell_landed(self.config, self.layout, landed)
        self._settle_claim_cut(job_id)

    @contextlib.contextmanager
    def _acting_on(self, job_id: str) -> Iterator[None]:
        """``_settle_cut`` for a command that moves the job on (a retry, a decision, a revision): a job its dead
        daemon recorded is landed, and notified only if the command then does not act on it (a notification
        run once it moved on would name a ``result.json`` that is gone, for an end a person already acts on)."""
        check_id(job_id)
        landed = land_recorded_end(self.layout, self.ledger, job_id)
        try:
            self._settle_claim_cut(job_id)
            yield
        except BaseException:
            if landed is not None and os.path.lexists(landed.folder.path / "result.json"):
                tell_landed(self.config, self.layout, landed)
            raise

    def _settle_claim_cut(self, job_id: str) -> None:
        """Put back the row of a job a dead daemon had claimed to run again, its folder still in failed/ or review/.

        The daemon died between claiming a retry or revision and moving the folder; the next
        daemon would put the row back (``recovery.settle_ledger``), the request still open. Done
        here first, this command sees the job as it is: a retry of it is refused for the open
        revision, a cancel withdraws the request, an approve withdraws the revision.
        """
        entry = self.ledger.get(job_id)
        if entry is None or entry.state != Row.CLAIMED or entry.owner is None or self.ledger.alive(entry.owner):
            return
        review = self.layout.job(State.REVIEW, job_id)
        if os.path.isdir(review) and not os.path.lexists(review / "result.json"):
            # cut after it set the result (and maybe the outbox) aside: a daemon carries the revision out again
            raise WrongState(f"{job_id}: a revision its daemon died carrying out is half done; a daemon finishes it")
        settle_claim(self.layout, self.ledger, entry)

    def _unhold(self, job_id: str) -> None:
        """Put a held order (a follow-up held by budget, or one held by hand), asked to be cancelled, back in
        inbox/: its claim answers "cancelled".

        The request is in the ledger first, so whichever daemon claims the file fails it
        (reason ``cancelled``) and no agent runs.
        """
        with contextlib.suppress(WrongState, NotFound):  # released or gone meanwhile: the request stands
            self.release(job_id)

    def cancel_tree(self, job_id: str) -> str:
        """Cancel a job and every descendant (its follow-ups, theirs..., and the joins that wait for any of them
        in ``after``, and theirs) still queued, waiting or running.

        Lineage and joins come from the ledger; each id is asked once. Joins not claimed yet
        (orders in inbox/ or held/ without a row, waiting for ``not_before`` or a daemon) are
        found by their ``after``. One line per cancelled id; finished ones are left as they are.
        NotFound if the job is unknown, WrongState if nothing in the tree can be cancelled any more.
        """
        check_id(job_id)
        self._settle_cut(job_id)
        lines = []
        if self.ledger.get(job_id) is None:  # a queued order without a row yet: no follow-up, but joins may wait for it
            lines.append(self.cancel(job_id))  # NotFound for no job at all
        queued = queued_afters([self.layout.inbox, self.layout.held])  # joins without a row: {id: after}
        order, seen = [job_id], {job_id}
        for current in order:
            waiting = [j for j, after in queued.items() if current in after]
            for child in [*self.ledger.children(current), *self.ledger.waiting_on([current], any_state=True), *waiting]:
                if child not in seen:
                    seen.add(child)
                    order.append(child)
        rows = self.ledger.known(order)
        reviewed: list[str] = []
        for entry in rows.values():
            if entry.state == Row.REVIEW:  # waits for a person, never cancelled: said, as `cancel` of it says
                reviewed.append(entry.job_id)
                continue
            if entry.state not in (Row.DONE, Row.FAILED) and not (lines and entry.job_id == job_id):
                self.ledger.request(entry.job_id, Request.CANCEL)
                if entry.state == Row.HELD:
                    self._unhold(entry.job_id)
                lines.append(f"{entry.job_id}: cancel requested")
        for join in order[1:]:
            if join not in rows:  # a join still in inbox/ or held/: cancelled as `cancel` of it alone is
                with contextlib.suppress(NotFound, WrongState):  # claimed and ended, or taken away, meanwhile
                    lines.append(self.cancel(join))
        if reviewed:
            reviewed.sort(key=order.index)
            them = "it" if len(reviewed) == 1 else "them"
            said = f"{', '.join(reviewed)}: in review, not cancelled: approve or reject {them}"
            if not lines:
                raise WrongState(said)
            self.notes.append(said)  # beside what was cancelled: a line on stderr
        if not lines:
            others = len(order) - 1
            what = "it is" if not others else f"it and its {plural(others, 'descendant')} are"
            raise WrongState(f"{job_id}: {what} finished; nothing to cancel")
        self._poke("cancel", job_id)
        return "\n".join(sorted(lines, key=lambda line: order.index(line.split(":")[0])))

    def _poke(self, kind: str, job_id: str) -> None:
        """Drop a hint file so that a running daemon acts at once (the ledger is the truth)."""
        self.layout.control.mkdir(parents=True, exist_ok=True)
        (self.layout.control / hint_name(kind, job_id)).write_bytes(b"")

    # -- hold and release -----------------------------------------------------------------
    @contextlib.contextmanager
    def _moving(self, job_id: str) -> Iterator[None]:
        """Hold the root's lock for moves between inbox/ and held/ (reentrant: a hold's undo releases under it).

        A hold moves by link then unlink, a release by rename: run at once on one order, each
        could take the other's new name for a move of its own cut short, and between them
        unlink both names. So `hold`, `release` and a cancel's release take turns.
        """
        lock = self.layout.state_dir / "moves.lock"
        if self._moves is None:
            fsutil.make_dirs(self.layout.state_dir)
            self._moves = FileLock(lock, timeout=MOVES_LOCK_S, thread_local=False, preserve_lock_file=True)
        try:
            self._moves.acquire()
        except Timeout:
            raise WrongState(f"{job_id}: another command held the lock of held/ for {MOVES_LOCK_S:g} s") from None
        except PermissionError:  # a lock file another user made before it was shared: the move goes on, unguarded
            yield
            return
        try:
            hand_over(self.layout, [lock])  # the daemon's user and the root's group take it after this command
            yield
        finally:
            self._moves.release()

    def hold(self, job_id: str) -> str:
        """Move the queued order(s) of job_id from inbox/ into held/, where no daemon claims them."""
        check_id(job_id)
        with self._moving(job_id):
            return self._hold(job_id)

    def _hold(self, job_id: str) -> str:
        entry = self.ledger.get(job_id)
        if entry is not None and entry.state not in (Row.RELEASED,):
            raise WrongState(
                f"{job_id}: is {self.ledger.spoken_row(entry.state, job_id)}, only a queued order can be held"
            )
        if job_id in self.ledger.requests(Request.CANCEL):  # it ends cancelled as promised, not held
            raise WrongState(f"{job_id}: a cancel was asked for it; it fails with reason cancelled")
        held: list[str] = []
        for _ in range(_MAX_FILES):
            name = find_queued(self.layout.inbox, [job_id]).get(job_id)
            if name is None:
                break
            path = _move(self.layout.inbox / name, self.layout.held, link=True)
            if path is None:
                continue  # gone meanwhile: claimed or removed; looked up again
            if not self._keep_held(job_id, path):
                raise WrongState(f"{job_id}: is being claimed by a daemon, not queued")
            held.append(path.name)
        if not held:
            self._not_in(job_id, "inbox", "queued", "held")
        if entry is not None:  # a released follow-up: the ledger's word that it waits in held/
            self.ledger.set_state(job_id, Row.HELD, expect=Row.RELEASED)
        if job_id in self.ledger.requests(Request.CANCEL):  # a cancel raced this hold: it wins, as asked first
            self._unhold(job_id)
            raise WrongState(f"{job_id}: a cancel was asked for it; it fails with reason cancelled")
        agent = read_order_file(self.layout.held / held[0], self.config.max_order_bytes).agent
        log.info("job.held", job_id=job_id, agent=agent, file=", ".join(held))
        return f"{job_id}: held (held/{printable(', held/'.join(held))})"

    def _keep_held(self, job_id: str, path: Path) -> bool:
        """Settle the race with a daemon claiming the file now at path; True if it stays held."""
        deadline = time.monotonic() + CLAIM_WAIT_S
        while True:
            try:
                if os.lstat(path).st_nlink <= 1:
                    return True
            except FileNotFoundError:
                return False
            entry = self.ledger.get(job_id)
            claimed = entry is not None and entry.state not in (Row.RELEASED, Row.HELD, Row.RESERVED)
            found = self.layout.find(job_id) if claimed else None
            if found is not None and fsutil.same_file(path, found[1] / f"order{path.suffix}"):
                os.unlink(path)  # only a second name of the claimed job's order file
                return False
            if time.monotonic() >= deadline:
                # claimed but not in place yet, or a link left by a daemon that died while
                # staging: the held copy is kept, so that nothing is lost if the claim is undone
                return not claimed
            time.sleep(0.05)

    def release(self, job_id: str) -> str:
        """Move the held order(s) of job_id back into inbox/; a follow-up held by budget is released in the ledger too.

        The ledger row goes first: a daemon refuses a file whose row still says held.
        """
        check_id(job_id)
        with self._moving(job_id):
            return self._release(job_id)

    def _release(self, job_id: str) -> str:
        entry = self.ledger.get(job_id)
        if entry is not None and entry.state not in (Row.HELD, Row.RELEASED):
            if find_queued(self.layout.held, [job_id]).get(job_id) is None:
                raise WrongState(f"{job_id}: is {self.ledger.spoken_row(entry.state, job_id)}, not held")
            said = self.ledger.spoken_row(entry.state, job_id)
            raise WrongState(f"{job_id}: is {said}; released, its held order would be refused (it stays in held/)")
        names = []
        for _ in range(_MAX_FILES):
            name = find_queued(self.layout.held, [job_id]).get(job_id)
            if name is None:
                break
            names.append(name)
            if entry is not None and entry.state == Row.HELD:
                # the ledger first: a daemon refuses a file whose row is still held
                self.ledger.set_state(job_id, Row.RELEASED, expect=Row.HELD)
            agent = read_order_file(self.layout.held / name, self.config.max_order_bytes).agent
            try:
                path = _move(self.layout.held / name, self.layout.inbox, link=False)
            except OSError:
                if entry is not None and entry.state == Row.HELD:
                    self.ledger.set_state(job_id, Row.HELD, expect=Row.RELEASED)
                raise
            if path is not None:
                log.info("job.released", job_id=job_id, agent=agent, file=path.name)
        if not names:
            self._not_in(job_id, "held", "held", "queued")
        return f"{job_id}: released into inbox/"

    # -- review ---------------------------------------------------------------------------
    def approve(self, job_id: str) -> str:
        """Move a job waiting in review/ to done/ and release its follow-ups (once)."""
        from dispatcher.job.notice import Apart
        from dispatcher.job.review import decide

        with self._acting_on(job_id):
            cfg = self.config
            try:
                line = decide(
                    self.layout,
                    self.ledger,
                    job_id,
                    approve=True,
                    max_chain_cost_usd=cfg.max_chain_cost_usd,
                    notify=Apart(cfg.notify or (), cfg.kill_grace_s, cfg.log_file),
                )
            except NotFound as exc:
                self._still_an_order(job_id, exc, "not waiting for review")
            self._poke("approve", job_id)  # a running daemon lands it and runs its after hook at once
            return line

    def reject(self, job_id: str) -> str:
        """Move a job waiting in review/ to failed/ with reason `rejected: TEXT`; its follow-ups are dropped."""
        from dispatcher.job.review import decide

        with self._acting_on(job_id):
            try:
                line = decide(self.layout, self.ledger, job_id, approve=False, reason=self.reason)
            except NotFound as exc:
                self._still_an_order(job_id, exc, "not waiting for review")
            self._poke("reject", job_id)  # a running daemon runs its after hook at once
            return line

    def revise(self, job_id: str) -> str:
        """Send a job in review/ or failed/ back for one more attempt with the note (section 14)."""
        from dispatcher.job.revise import request

        with self._acting_on(job_id):
            found = self.layout.find(job_id)
            if found is not None and found[0] in (State.FAILED, State.REVIEW):
                self._row_says(job_id, (Row.FAILED,) if found[0] is State.FAILED else (Row.REVIEW,), Request.REVISE)
            try:
                line = request(self.config, self.layout, self.ledger, job_id, self.note or "")
            except NotFound as exc:
                self._still_an_order(job_id, exc, "only a job in review or failed can be revised")
            if found is not None and found[0] is State.FAILED:
                self._note_blocked_join(job_id, found[1])
            self._poke("revise", job_id)
            return line

    # -- gates (section 14) -----------------------------------------------------------------
    def pause(self, agent: str) -> str:
        """Gate an agent by hand: no new attempt of it starts on any host until `resume`."""
        self._agent(agent)
        if self.ledger.set_gate(Gate(agent, GateKind.PAUSE, None, "paused by hand"), at=time.time()):
            log.info("agent.gated", agent=agent, kind=str(GateKind.PAUSE), until=None)
            self._poke("pause", agent)
            return f"{agent}: paused; running attempts go on, no new one starts"
        return f"{agent}: already paused"

    def resume(self, agent: str) -> str:
        """Lift every gate of an agent: a pause, a usage limit or a daily cap (which is set again if still reached).

        ``*`` lifts the gates of every agent at once: the root's daily cap.
        """
        lifted = self.ledger.lift_gates(agent)  # a gate kept by a name the config no longer has is lifted too
        if not lifted:
            if agent != EVERY_AGENT:
                self._agent(agent)
            raise WrongState(f"{agent}: is not gated")
        for g in lifted:
            log.info("agent.resumed", agent=agent, kind=g.kind, by="hand")
        self._poke("resume", agent)
        return f"{agent}: resumed ({', '.join(sorted(g.kind for g in lifted))} gate lifted)"

    def _agent(self, agent: str) -> None:
        if agent not in self.config.agents:
            raise NotFound(f"{printable(agent)}: no such agent in {self.config.path or 'the config'}")

    def _row_says(self, job_id: str, states: tuple[Row, ...], kind: Request) -> None:
        """Raise WrongState unless the ledger row agrees with the folder: a folder renamed, or moved between
        state folders by hand, is not a job a daemon would carry the request out for.

        A row a daemon has claimed to carry out a retry or a revision (its reopen under way, or cut
        short and finished by the next start) is let through, as the folder is still where it was.
        """
        entry = self.ledger.get(job_id)
        if entry is not None and entry.state in states:
            return
        if (
            entry is not None
            and entry.state == Row.CLAIMED
            and any(job_id in self.ledger.requests(k) for k in (kind, Request.RETRY, Request.REVISE))
        ):
            return  # a reopen (a retry's or a revision's) under way, or cut short: the next start finishes it
        wanted = " or ".join(str(s) for s in states)
        raise WrongState(f"{job_id}: its ledger row is {entry.state if entry else 'missing'}, not {wanted}")

    def _still_an_order(self, job_id: str, unknown: NotFound, only: str) -> NoReturn:
        """Raise WrongState for an id that is still an order (queued in inbox/, or held), else ``unknown``.

        Such a job is known (`show` shows it) but in no state these actions take: exit 1 as
        either way, and 409 rather than 404 in the web view.
        """
        if find_queued(self.layout.inbox, [job_id]):
            raise WrongState(f"{job_id}: is queued, {only}")
        if find_queued(self.layout.held, [job_id]):
            raise WrongState(f"{job_id}: is held, {only}")
        raise unknown

    def _not_in(self, job_id: str, folder: str, wanted: str, other: str) -> None:
        """Raise the error for an id whose order is not in folder."""
        found = self.layout.find(job_id)
        if found is not None:
            raise WrongState(f"{job_id}: is {self.ledger.spoken_state(found[0], job_id)}, not {wanted}")
        elsewhere = self.layout.held if folder == "inbox" else self.layout.inbox
        if find_queued(elsewhere, [job_id]):
            raise WrongState(f"{job_id}: is {other}, not {wanted}")
        raise NotFound(f"{job_id}: no {wanted} order with this job id in {folder}/")


def _sync_move(src: Path, folder: Path) -> None:
    """Make a rename out of src's folder into folder durable: the new name first."""
    fsutil.fsync_dir(folder)
    fsutil.fsync_dir(src.parent)


def _move(src: Path, folder: Path, *, link: bool) -> Path | None:
    """Move src into folder under its name, or NAME-2.ext ... if taken; None if src is gone.

    With ``link``, by link + unlink: leaving a watched inbox/ by rename would hold
    up the watcher's later events (an unpaired move); otherwise by rename, which
    a watcher of the target sees as a whole file arriving. The new name is fsynced
    before the old one goes, and the old one's going too: after a power cut the
    order is where the command put it (cut between the two steps: in both); never lost.
    """
    fsutil.make_dirs(folder)
    stem, suffix = os.path.splitext(src.name)
    for n in range(1, 10_000):
        dst = folder / (src.name if n == 1 else f"{stem}-{n}{suffix}")
        try:
            if link:
                try:
                    os.link(src, dst, follow_symlinks=False)
                except OSError as exc:
                    if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.EACCES):
                        raise
                    fsutil.rename_noreplace(src, dst)  # hard links refused (fs.protected_hardlinks)
                    _sync_move(src, folder)
                    return dst
                fsutil.fsync_dir(folder)
                with contextlib.suppress(FileNotFoundError):  # a daemon took it: the caller's race check decides
                    os.unlink(src)
                fsutil.fsync_dir(src.parent)
                return dst
            fsutil.rename_noreplace(src, dst)
            _sync_move(src, folder)
            return dst
        except FileExistsError:
            if _same_file(src, dst):  # a move cut short between its two steps: finish it
                fsutil.fsync_dir(folder)
                try:
                    os.unlink(src)
                except FileNotFoundError:  # another command moving it this moment took the old name: its move
                    return None
                fsutil.fsync_dir(src.parent)
                return dst
            continue
        except FileNotFoundError:
            return None
    raise OSError(errno.EEXIST, "no free name", str(folder))


def _same_file(a: Path, b: Path) -> bool:
    """Return True if a and b are two names of one file (neither followed if a link)."""
    try:
        return os.path.samestat(os.lstat(a), os.lstat(b))
    except OSError:
        return False


def tell_landed(cfg: Config, layout: Layout, landed: Landed) -> None:
    """Notify a failed or review job a command landed for its dead daemon, as the daemon would have (apart)."""
    from dispatcher.job.notice import Apart, start_detached

    result = landed.result
    event = notified_event(landed.state)
    if result is None or not cfg.notify or event is None:
        return
    apart = Apart(cfg.notify, cfg.kill_grace_s, cfg.log_file)
    start_detached(
        apart, layout.root, event, landed.job_id, result.agent, result.reason, landed.folder.path / "result.json"
    )
