"""Where blocking work runs, so that the event loop never waits on a disk or a database.

Two small fixed pools, both daemon-owned threads:

- the *ledger lane*, one thread: every ledger write and the fsyncs that go with
  it, in order. One thread because the ledger serialises writers anyway, and one
  writer in order is what makes group commit work: while one batch commits,
  the next one gathers (``GroupCommit``).
- the *io pool*, ``IO_WORKERS`` threads: a job's own file work (reading evidence
  from work/, outputs up to 256 MiB; moving leftovers aside). Two, so that one slow
  check on a huge output does not hold up every other job's finish, and no more,
  because the work is mostly I/O-bound Python that shares one interpreter lock
  with the loop.
- the *scan lane*, one thread: work that grows with the machine or the backlog
  rather than with one job (walking /proc for open writers, listing or searching
  inbox/, counting the queue, reading a large order), so that starting and
  finishing a job never waits behind it.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar

from dispatcher import fsutil

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
S = TypeVar("S")
IO_WORKERS = 2


class _Lane(threading.local):
    """What a thread knows of itself: whether it is a lane's, and a posted call's held caller (``_call``)."""

    yes = False  # True in the lanes' own threads
    cell: list[Any] | None = None


_IN_LANE = _Lane()
HOLD_S = 0.05  # how long a caller may wait in place for a held lane's answer (``_Pool.hold_s``)
# (loop, its future, context, fn, args, the caller's hold, where a held caller takes the answer (``_Pool.call``));
# a posted call has no loop, and what to do if it is dropped
_Work = tuple[Any, Any, contextvars.Context, Callable[..., Any], tuple[Any, ...], Any, list[Any] | None]


class _Pool:
    """Threads that run calls from the loop and answer on an asyncio future of that loop.

    What ``run_in_executor`` on a ``ThreadPoolExecutor`` does, without its second
    future, the chaining between the two and their callbacks: a call is one
    queue put on the way there and one ``call_soon_threadsafe`` on the way back (or,
    for a held call whose answer is back within the hold, its caller's ``call_soon``).
    Threads start on first use (named ``<prefix>_<n>``), up to ``workers``.
    """

    def __init__(self, workers: int, prefix: str, *, hold_s: float = 0.0) -> None:
        self.hold_s = hold_s
        self._workers = workers
        self._prefix = prefix
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False
        self._lock = threading.Lock()

    def call(self, fn: Callable[..., R], args: tuple[Any, ...], *, held: bool = True) -> asyncio.Future[R]:
        """Queue fn(*args) (in the caller's log context); return the future of its answer.

        ``held=False``: never wait in place, whatever the lane's state (work known to be long).
        """
        loop = asyncio.get_running_loop()
        if self._closed:
            raise RuntimeError("cannot schedule new work after shutdown")
        fut: asyncio.Future[R] = loop.create_future()
        hold = self._hold() if held else None
        if hold is not None:  # an idle lane (its thread is there): the answer is likely back within the hold
            cell: list[Any] = []  # the worker appends its answer, the caller None when it goes on: the first one wins
            self._queue.put((loop, fut, contextvars.copy_context(), fn, args, hold, cell))
            self._wait(hold)
            cell.append(None)
            if cell[0] is not None:  # in the loop's next round, as the worker's call_soon_threadsafe would
                loop.call_soon(_settle, fut, *cell[0])
            return fut
        work = (loop, fut, contextvars.copy_context(), fn, args, None, None)
        self._queue.put(work)
        if self._idle == 0 and len(self._threads) < self._workers:
            self._start(work)
        return fut

    def post(self, fn: Callable[[], None], dropped: Callable[[], None]) -> None:
        """Queue fn() with no future (its own answers go to the loop); ``dropped`` runs instead if it never will."""
        if self._closed:
            dropped()
            return
        hold = self._hold()
        loop = None
        if hold is not None:
            try:  # (not contextlib.suppress: three calls more)
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not called on a loop
                loop = None
        if loop is not None:  # held on a loop: answers fn gives that loop come back through this caller (``_call``)
            cell: list[Any] = [loop]
            self._queue.put((None, dropped, contextvars.Context(), fn, (), hold, cell))
            self._wait(hold)
            cell.append(None)
            if cell[1] is not None:
                loop.call_soon(_settle_each, cell[1])
            return
        work = (None, dropped, contextvars.Context(), fn, (), hold, None)
        self._queue.put(work)
        if self._idle == 0 and len(self._threads) < self._workers:
            self._start(work)
        self._wait(hold)

    def _hold(self) -> Any:
        """Return a lock taken for the worker to give back when the call is done, or None (no hold).

        Only a call that an idle lane takes at once is held: behind other work (a ledger
        another process holds locked, a full disk) the caller would only wait out the
        hold. A lane's own thread is never held: a call it queues (a drain that finds
        more pending) would otherwise wait for the thread that is waiting.
        """
        if not self.hold_s or _IN_LANE.yes or not (self._idle and self._queue.empty()):
            return None  # a busy lane: waiting for it would stop the loop for nothing
        hold = threading.Lock()
        hold.acquire()
        return hold

    def _wait(self, hold: Any) -> None:
        """Wait in place (the interpreter lock given up) until the worker is done, ``hold_s`` at most.

        A held lane runs alone: the caller's thread and the worker do not take turns at
        the interpreter lock at every system call, which costs more than the work itself
        when the files are in memory. After ``hold_s`` the caller goes on as with any
        lane, and the answer comes on its future as always.
        """
        if hold is not None:
            hold.acquire(timeout=self.hold_s)

    def _start(self, work: Any) -> None:
        """Start one more thread for the lane; ``work`` was just queued by the caller.

        A thread that cannot start (RLIMIT_NPROC: "can't start new thread") is forgotten, so
        that a later call tries again. With another thread serving the lane the call goes on;
        with none, ``work`` is taken back out of the queue and the error raised: the caller
        (start-up's shortage wait) tries the same call again later, and it never runs twice.
        """
        with self._lock:
            if len(self._threads) >= self._workers:
                return
            thread = threading.Thread(target=self._serve, name=f"{self._prefix}_{len(self._threads)}", daemon=True)
            self._threads.append(thread)
        try:
            thread.start()
        except RuntimeError:
            with self._lock:
                self._threads.remove(thread)
                alone = not self._threads
            if not alone:
                return
            left = []  # no thread takes from the queue: what is in it was put there by callers, this one last
            while True:
                try:
                    queued = self._queue.get_nowait()
                except queue.Empty:
                    break
                if queued is not work:
                    left.append(queued)
            for queued in left:
                self._queue.put(queued)
            raise

    def _serve(self) -> None:
        _IN_LANE.yes = True
        while True:
            with self._lock:
                self._idle += 1
            work = self._queue.get()
            with self._lock:
                self._idle -= 1
            if work is None:
                return
            try:
                _call(*work[:5], work[6])
            finally:
                if work[5] is not None:
                    work[5].release()

    def shutdown(self, *, wait: bool) -> None:
        """Stop the threads after the queued calls (wait), or now, cancelling what is still queued."""
        self._closed = True
        if not wait:
            while True:
                try:
                    work = self._queue.get_nowait()
                except queue.Empty:
                    break
                if work is not None and work[5] is not None:
                    work[5].release()
                if work is not None and work[0] is None:
                    work[1]()  # a posted call: it answers its waiters itself
                elif work is not None:
                    work[0].call_soon_threadsafe(work[1].cancel)
        for _ in self._threads:
            self._queue.put(None)
        if wait:
            for thread in self._threads:
                thread.join()


def _call(
    loop: asyncio.AbstractEventLoop | None,
    fut: Any,
    ctx: contextvars.Context,
    fn: Callable[..., Any],
    args: Any,
    cell: list[Any] | None,
) -> None:
    """Run one queued call in its log context and hand its answer to the loop (or pass the future on).

    ``cell``: its caller waits in place (``_Pool.call``, held) and hands the answer to the loop
    itself if it still waits when the answer is there (appended before it goes on): no
    ``call_soon_threadsafe``, so no write to the loop's self-pipe and no read of it. A posted
    call's cell holds its caller's loop, and the answers fn gives that loop (``_answer_all``).
    """
    if loop is None:  # posted: it answers its own waiters
        if cell is None:
            ctx.run(fn)
            return
        _IN_LANE.cell = cell
        try:
            ctx.run(fn)
        finally:
            _IN_LANE.cell = None
        return
    try:
        answer = ctx.run(fn, *args)
    except BaseException as exc:  # noqa: BLE001 - handed to the caller, as an executor does
        reply: tuple[Any, bool] = (exc, True)
    else:
        if type(answer) is Handoff:
            answer.start(loop, fut)  # another lane answers the caller
            return
        reply = (answer, False)
    if cell is not None:
        cell.append(reply)
        if cell[0] is reply:  # its caller still waits: it hands the answer on
            return
    _answer(loop, fut, reply[0], failed=reply[1])


async def handed_over(answer: Handoff[R]) -> R:
    """Wait for the lane a call made on the loop handed its answer to (``Handoff``)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[R] = loop.create_future()
    answer.start(loop, fut)
    return await fut


def _answer(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], value: Any, *, failed: bool) -> None:
    """Hand a call's answer (or its exception) to its future on the loop; a closed loop has no one waiting."""
    try:  # (not contextlib.suppress: three calls more at every trip)
        loop.call_soon_threadsafe(_settle, fut, value, failed)
    except RuntimeError:
        return


def _settle(fut: asyncio.Future[Any], value: Any, failed: bool) -> None:
    if fut.done():  # the caller was cancelled
        return
    if failed:
        fut.set_exception(value)
    else:
        fut.set_result(value)


class Handoff(Generic[R]):
    """What a call in one lane returns to pass its caller's future on to another lane.

    The caller awaits one future and makes one trip: ``start(loop, fut)`` runs in the
    thread that returned the handoff and queues the rest (``GroupCommit.handoff``), which
    answers the future itself.
    """

    __slots__ = ("start",)

    def __init__(self, start: Callable[[asyncio.AbstractEventLoop, asyncio.Future[R]], None]) -> None:
        self.start = start


class Lanes:
    """The daemon's pools: ``ledger`` (one ordered writer), ``io`` (a job's files) and ``scan``.

    ``files_in_memory``: the root lives on a filesystem held in memory (``storage.in_memory``),
    where a job's small file work is cheaper on the loop than a trip to the io pool.
    ``hold_ledger_s``: a call to an idle ledger lane waits in place for its answer, so
    long at most (``_Pool._wait``); ``HOLD_S`` for an SQLite ledger held in memory, whose
    calls take a fraction of a millisecond.
    """

    def __init__(self, *, files_in_memory: bool = False, hold_ledger_s: float = 0.0) -> None:
        self.files_in_memory = files_in_memory
        self._ledger = _Pool(1, "ledger", hold_s=hold_ledger_s)
        self._io = _Pool(IO_WORKERS, "io")
        self._scan = _Pool(1, "scan")
        self._turn_syncs: list[tuple[str, asyncio.Future[None]]] = []

    def sync_this_turn(self, folder: str) -> asyncio.Future[None]:
        """Fsync folder on the loop at the end of this turn, with every other folder asked for in it.

        Agents started in one turn (a burst of claims) make their attempt folders
        first and have them synced together: the journal commits them in one go
        (``fsutil.fsync_many``) instead of one commit per agent. The future fails
        with the folder's OSError.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if not self._turn_syncs:
            loop.call_soon(self._sync_turn)
        self._turn_syncs.append((folder, fut))
        return fut

    def _sync_turn(self) -> None:
        batch, self._turn_syncs = self._turn_syncs, []
        for (_, fut), error in zip(batch, fsutil.fsync_many([folder for folder, _ in batch]), strict=True):
            if fut.done():
                continue
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

    async def ledger(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run fn in the ledger lane (with the caller's log context) and wait for it."""
        return await self._run(self._ledger, fn, *args, **kwargs)

    async def ledger_long(self, fn: Callable[[], R]) -> R:
        """``ledger`` for a call that may be long (a burst's claims): the loop never waits in place for it.

        A held call stops the loop until its answer is back; a burst of claims sent in one turn
        would then be claimed one chunk after another with the loop stopped, and no agent of the
        first chunk would start until the last chunk was claimed.
        """
        return await self._ledger.call(fn, (), held=False)

    async def io(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run fn in the io pool (with the caller's log context) and wait for it."""
        return await self._run(self._io, fn, *args, **kwargs)

    async def io_then(self, fn: Callable[P, R | Handoff[R]], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run fn in the io pool; if it returns a ``Handoff``, the lane it hands over to answers."""
        return await self._run(self._io, fn, *args, **kwargs)  # type: ignore[arg-type]

    def post_ledger(self, fn: Callable[[], None], dropped: Callable[[], None]) -> None:
        """Queue fn() in the ledger lane without a future; ``dropped`` runs if the lane shuts down first."""
        self._ledger.post(fn, dropped)

    async def scan(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run fn in the scan lane (work that grows with the machine or the backlog) and wait for it."""
        return await self._run(self._scan, fn, *args, **kwargs)

    async def _run(self, pool: _Pool, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        if kwargs:
            return await pool.call(lambda: fn(*args, **kwargs), ())
        return await pool.call(fn, args)

    def shutdown(self, *, wait: bool) -> None:
        """Stop the pools; without wait, work still queued is dropped (its job stays where it is)."""
        self._ledger.shutdown(wait=wait)
        self._io.shutdown(wait=wait)
        self._scan.shutdown(wait=wait)


class GroupCommit(Generic[T, R]):
    """Commit items submitted close together as one batch in the ledger lane.

    Items submitted in one loop turn go together; items submitted while a batch
    commits wait and go together in the next one, so a burst of finishing jobs shares
    one transaction and one fsync per folder instead of paying for each. An item may
    also come from another lane's thread (``handoff``): its caller's future is
    answered from the ledger lane, with no stop on the loop in between.
    """

    def __init__(self, lanes: Lanes, commit: Callable[[Sequence[T]], Sequence[R]]) -> None:
        self._lanes = lanes
        self._commit = commit
        self._lock = threading.Lock()
        self._pending: list[tuple[T, asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[[R], Any] | None]] = []
        self._busy = False  # a drain is queued or running in the ledger lane
        self._kick_due = False  # a loop callback will queue the drain at the end of this turn

    async def submit(self, item: T) -> R:
        """Queue item for the next batch and wait for its answer."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        with self._lock:
            self._pending.append((item, loop, fut, None))
            kick = not self._busy and not self._kick_due
            self._kick_due |= kick
        if kick:  # after this turn's other callbacks (they join the batch)
            loop.call_soon(self._kick, context=contextvars.Context())
        return await fut

    def handoff(self, item: T, wrap: Callable[[R], S]) -> Handoff[S]:
        """Return what a call in another lane hands back so that its caller gets ``wrap(answer)`` for item."""

        def start(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[S]) -> None:
            with self._lock:
                self._pending.append((item, loop, fut, wrap))
                drain = not self._busy and not self._kick_due
                self._busy |= drain
            if drain:
                self._lanes.post_ledger(self._drain, self._drop)

        return Handoff(start)

    def _kick(self) -> None:
        with self._lock:
            self._kick_due = False
            drain = not self._busy and bool(self._pending)
            self._busy |= drain
        if drain:
            self._lanes.post_ledger(self._drain, self._drop)

    def _drain(self) -> None:
        """Commit what is pending as one batch (ledger lane); queue another drain if more came meanwhile.

        One batch per call, so that other work queued in the lane (claims, slots) runs
        between two batches of a steady stream of finishes.
        """
        with self._lock:
            batch, self._pending = self._pending, []
        try:
            if batch:
                self._commit_batch(batch)
        finally:
            with self._lock:
                again = bool(self._pending)
                self._busy = again
            if again:
                self._lanes.post_ledger(self._drain, self._drop)

    def _commit_batch(
        self, batch: list[tuple[T, asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[[R], Any] | None]]
    ) -> None:
        try:
            answers: Sequence[Any] = self._commit([item for item, *_ in batch])
            settles = [
                (loop, fut, wrap(answer) if wrap is not None else answer, False)
                for (_, loop, fut, wrap), answer in zip(batch, answers, strict=True)
            ]
        except BaseException as exc:  # noqa: BLE001 - every waiter learns of it; the next batch still runs
            error = exc if isinstance(exc, Exception) else RuntimeError(str(exc))
            settles = [(loop, fut, error, True) for _, loop, fut, _ in batch]
        _answer_all(settles)

    def _drop(self) -> None:
        """The ledger lane shut down before the drain ran: every waiter learns of it."""
        with self._lock:
            batch, self._pending = self._pending, []
            self._busy = False
        _answer_all([(loop, fut, RuntimeError("the ledger lane shut down"), True) for _, loop, fut, _ in batch])


def _answer_all(answers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Any, bool]]) -> None:
    """Hand a batch's answers to their loops, one wake-up per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any, bool]]] = {}
    for loop, fut, value, failed in answers:
        by_loop.setdefault(loop, []).append((fut, value, failed))
    cell = _IN_LANE.cell  # a posted call whose caller waits in place on its loop (``_call``)
    if cell is not None and len(by_loop) == 1 and (settles := by_loop.get(cell[0])) is not None:
        cell.append(settles)
        if cell[1] is settles:  # the caller still waits: it hands them to its loop
            return
    for loop, settles in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle_each, settles)
        except RuntimeError:  # a closed loop has no one waiting
            continue


def _settle_each(settles: list[tuple[asyncio.Future[Any], Any, bool]]) -> None:
    for fut, value, failed in settles:
        _settle(fut, value, failed)
