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
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
IO_WORKERS = 2


class Lanes:
    """The daemon's pools: ``ledger`` (one ordered writer), ``io`` (a job's files) and ``scan``."""

    def __init__(self) -> None:
        self._ledger = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")
        self._io = ThreadPoolExecutor(max_workers=IO_WORKERS, thread_name_prefix="io")
        self._scan = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scan")

    async def ledger(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run fn in the ledger lane (with the caller's log context) and wait for it."""
        return await self._run(self._ledger, fn, *args, **kwargs)

    async def io(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run fn in the io pool (with the caller's log context) and wait for it."""
        return await self._run(self._io, fn, *args, **kwargs)

    async def scan(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run fn in the scan lane (work that grows with the machine or the backlog) and wait for it."""
        return await self._run(self._scan, fn, *args, **kwargs)

    async def _run(self, pool: ThreadPoolExecutor, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(pool, call)

    def shutdown(self, *, wait: bool) -> None:
        """Stop both pools; without wait, work still queued is dropped (its job stays where it is)."""
        self._ledger.shutdown(wait=wait, cancel_futures=not wait)
        self._io.shutdown(wait=wait, cancel_futures=not wait)
        self._scan.shutdown(wait=wait, cancel_futures=not wait)


class GroupCommit(Generic[T, R]):
    """Commit items submitted close together as one batch in the ledger lane.

    Items submitted while a batch is committing wait and go together in the next
    one, so a burst of finishing jobs shares one transaction and one fsync per
    folder instead of paying for each.
    """

    def __init__(self, lanes: Lanes, commit: Callable[[Sequence[T]], Sequence[R]]) -> None:
        self._lanes = lanes
        self._commit = commit
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._busy = False

    async def submit(self, item: T) -> R:
        """Queue item for the next batch and wait for its answer."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        self._pending.append((item, fut))
        if not self._busy:
            self._busy = True
            # after this turn's other callbacks (they join the batch), in a clean log context
            loop.call_soon(self._flush, context=contextvars.Context())
        return await fut

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            self._busy = False
            return
        asyncio.get_running_loop().create_task(self._run(batch), context=contextvars.Context())

    async def _run(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            answers = await self._lanes.ledger(self._commit, [item for item, _ in batch])
        except BaseException as exc:  # noqa: BLE001 - every waiter learns of it; the next batch still runs
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
        else:
            for (_, fut), answer in zip(batch, answers, strict=True):
                if not fut.done():
                    fut.set_result(answer)
        self._flush()
