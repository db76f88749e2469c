"""In-process tests of ``lanes``: the ledger lane, the io pool and ``GroupCommit`` batching."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence

import pytest
from seam_fixtures import run, until

from dispatcher.lanes import HOLD_S, GroupCommit, Lanes

REQUEST = contextvars.ContextVar("REQUEST", default="unset")


@pytest.fixture(params=[0.0, HOLD_S], ids=["free", "held"])
def lanes(request: pytest.FixtureRequest) -> Iterator[Lanes]:
    """The pools, shut down after the test; once with a held ledger lane (its caller waits in place)."""
    pools = Lanes(hold_ledger_s=request.param)
    yield pools
    pools.shutdown(wait=True)


class Recorder:
    """A commit function that records each batch and answers each item times ten."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, items: Sequence[int]) -> list[int]:
        self.batches.append(list(items))
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        if -1 in items:
            raise OSError("disk full")
        return [i * 10 for i in items]


def test_items_submitted_in_one_loop_turn_share_one_commit(lanes: Lanes) -> None:
    """Five submits in the same turn make one commit call of five items; each waiter gets its own answer."""
    rec = Recorder()
    group: GroupCommit[int, int] = GroupCommit(lanes, rec)

    async def body() -> list[int]:
        return list(await asyncio.gather(*(group.submit(i) for i in range(5))))

    assert run(body) == [0, 10, 20, 30, 40]
    assert rec.batches == [[0, 1, 2, 3, 4]]


def test_items_submitted_while_a_batch_commits_go_together_in_the_next(lanes: Lanes) -> None:
    """While batch one is in the ledger lane, three more submits wait and then commit as one second batch."""
    rec = Recorder()
    rec.gate.clear()
    group: GroupCommit[int, int] = GroupCommit(lanes, rec)

    async def body() -> list[int]:
        first = asyncio.create_task(group.submit(1))
        await until(rec.entered.is_set, "the first batch to reach the commit")
        later = [asyncio.create_task(group.submit(i)) for i in (2, 3, 4)]
        await asyncio.sleep(0)  # let the three submits queue up behind the running batch
        rec.gate.set()
        return list(await asyncio.gather(first, *later))

    assert run(body) == [10, 20, 30, 40]
    assert rec.batches == [[1], [2, 3, 4]]


def test_a_failing_commit_reaches_every_waiter_and_the_next_batch_still_runs(lanes: Lanes) -> None:
    """A commit that raises fails each submit of its batch with that error; a later submit commits normally."""
    rec = Recorder()
    group: GroupCommit[int, int] = GroupCommit(lanes, rec)

    async def body() -> tuple[list[object], int]:
        failed = await asyncio.gather(group.submit(-1), group.submit(7), return_exceptions=True)
        return list(failed), await group.submit(8)

    failed, after = run(body)
    assert [str(e) for e in failed] == ["disk full", "disk full"]
    assert all(isinstance(e, OSError) for e in failed)
    assert after == 80
    assert rec.batches == [[-1, 7], [8]]


def test_the_lanes_run_work_off_the_loop_with_the_callers_context(lanes: Lanes) -> None:
    """lanes.ledger, lanes.io and lanes.scan run in their own threads and see the caller's context variables."""

    def where() -> tuple[str, str]:
        return threading.current_thread().name, REQUEST.get()

    async def body() -> list[tuple[str, str]]:
        REQUEST.set("job J1")
        return [await lanes.ledger(where), await lanes.io(where), await lanes.scan(where)]

    seen = run(body)
    assert [name.split("_")[0] for name, _ in seen] == ["ledger", "io", "scan"]
    assert [value for _, value in seen] == ["job J1"] * 3
    assert REQUEST.get() == "unset"  # the test's own context never saw the task's value


def test_the_ledger_lane_runs_calls_one_at_a_time_in_the_order_they_came(lanes: Lanes) -> None:
    """Twenty calls queued at once on the ledger lane run in submission order, never two at a time."""
    seen: list[int] = []
    inside = threading.Lock()

    def step(i: int) -> None:
        assert inside.acquire(blocking=False), "two ledger calls ran at once"
        seen.append(i)
        inside.release()

    async def body() -> None:
        await asyncio.gather(*(lanes.ledger(step, i) for i in range(20)))

    run(body)
    assert seen == list(range(20))


def test_an_error_in_a_lane_reaches_the_caller(lanes: Lanes) -> None:
    """An exception raised in the io pool is raised again where the caller awaits it."""

    def boom() -> None:
        raise FileNotFoundError("gone")

    async def body() -> None:
        await lanes.io(boom)

    with pytest.raises(FileNotFoundError, match="gone"):
        run(body)


def test_a_slow_scan_holds_up_neither_the_ledger_lane_nor_the_io_pool(lanes: Lanes) -> None:
    """While a scan (a /proc walk, a big listing) is stuck, ledger and io calls still run at once."""
    release = threading.Event()

    async def body() -> list[str]:
        stuck = asyncio.ensure_future(lanes.scan(release.wait, 10))
        done = [await lanes.ledger(lambda: "ledger"), await lanes.io(lambda: "io")]
        finished_early = stuck.done()
        release.set()
        await stuck
        return [*done, "scan waited" if not finished_early else "scan was not stuck"]

    assert run(body) == ["ledger", "io", "scan waited"]


def test_a_handoff_from_the_io_pool_is_answered_by_the_ledger_lane_in_one_await(lanes: Lanes) -> None:
    """An io call that returns a handoff: its caller gets wrap(commit answer), committed in the ledger lane."""
    rec = Recorder()
    group: GroupCommit[int, int] = GroupCommit(lanes, rec)
    where: list[str] = []

    def in_io(i: int) -> object:
        where.append(threading.current_thread().name.split("_")[0])
        return group.handoff(i, lambda answer: f"landed {answer}")

    async def body() -> list[object]:
        return list(await asyncio.gather(*(lanes.io_then(in_io, i) for i in (1, 2, 3))))

    assert run(body) == ["landed 10", "landed 20", "landed 30"]
    assert where == ["io"] * 3
    assert sorted(i for batch in rec.batches for i in batch) == [1, 2, 3]


def test_a_handoff_after_the_lanes_shut_down_fails_its_caller(lanes: Lanes) -> None:
    """The ledger lane is gone before the handoff reaches it: the caller gets an error, it does not hang."""
    group: GroupCommit[int, int] = GroupCommit(lanes, Recorder())

    async def body() -> BaseException | object:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()
        lanes.shutdown(wait=True)
        group.handoff(1, lambda a: a).start(loop, fut)
        try:
            return await asyncio.wait_for(fut, 5)
        except RuntimeError as exc:
            return exc

    answer = run(body)
    assert isinstance(answer, RuntimeError) and "shut down" in str(answer)


LONG_HOLD_S = 5.0  # far beyond what any call here takes: a hold that should not happen shows as seconds


async def warm(pools: Lanes) -> None:
    """Start the ledger lane's thread: a hold is only taken by an idle lane."""
    await pools.ledger(lambda: None)
    await until(lambda: pools._ledger._idle, "the ledger lane to be idle")


def _marks_on_an_idle_lane(call: Callable[[Lanes, Callable[[], str]], Awaitable[str]], work_s: float) -> list[str]:
    """Make one call that takes work_s on an idle ledger lane held LONG_HOLD_S, a loop callback queued just before.

    Returns the order in which the lane's work and that callback ran.
    """
    pools = Lanes(hold_ledger_s=LONG_HOLD_S)
    marks: list[str] = []

    def work() -> str:
        time.sleep(work_s)
        marks.append("lane")
        return "answer"

    async def body() -> str:
        await warm(pools)
        asyncio.get_running_loop().call_soon(marks.append, "loop")
        return await call(pools, work)

    try:
        assert run(body) == "answer"
    finally:
        pools.shutdown(wait=True)
    return marks


def test_a_held_ledger_lane_runs_alone_while_its_caller_waits() -> None:
    """Held: the loop runs nothing else until the call is done, so the two never take turns at the interpreter lock."""
    assert _marks_on_an_idle_lane(lambda pools, work: pools.ledger(work), 0.02) == ["lane", "loop"]


def test_a_held_call_that_takes_long_lets_the_loop_go_on_after_the_hold() -> None:
    pools = Lanes(hold_ledger_s=HOLD_S)
    seen: list[float] = []

    async def body() -> str:
        await warm(pools)
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        loop.call_soon(lambda: seen.append(time.monotonic() - t0))
        return await pools.ledger(lambda: time.sleep(1.0) or "slow")

    try:
        assert run(body) == "slow"
    finally:
        pools.shutdown(wait=True)
    assert seen and seen[0] < 0.6, f"the loop waited {seen} s for a call held {HOLD_S} s at most"


def test_a_long_ledger_call_never_holds_the_loop_even_on_an_idle_held_lane() -> None:
    """``ledger_long`` (a burst's claims): the loop goes on at once, where ``ledger`` would wait up to the hold."""
    marks = _marks_on_an_idle_lane(lambda pools, work: pools.ledger_long(work), 0.2)
    assert marks == ["loop", "lane"], "the loop waited in place for a call that may be long"


def test_a_call_behind_other_work_is_not_held() -> None:
    """A busy lane (a ledger locked by another process, say): the caller does not wait out the hold."""
    hold_s = 1.0
    pools = Lanes(hold_ledger_s=hold_s)
    gate = threading.Event()
    waited: list[float] = []

    async def body() -> None:
        await warm(pools)
        blocked = asyncio.ensure_future(pools.ledger(lambda: gate.wait(30)))
        await asyncio.sleep(0)  # its call is made on an idle lane: held, then let go after hold_s
        t0 = time.monotonic()
        behind = asyncio.ensure_future(pools.ledger(lambda: "behind"))
        await asyncio.sleep(0)  # its call is made behind the busy one
        waited.append(time.monotonic() - t0)
        gate.set()
        assert await behind == "behind"
        await blocked

    try:
        run(body)
    finally:
        gate.set()
        pools.shutdown(wait=True)
    assert waited[0] < hold_s / 2, f"a call queued behind a busy lane held the loop {waited[0]:.3f} s"


def test_a_held_lane_never_holds_its_own_thread() -> None:
    """A call the ledger lane queues from inside a call (a drain that finds more pending) runs at once after it."""
    pools = Lanes(hold_ledger_s=LONG_HOLD_S)
    done = threading.Event()
    took: list[float] = []

    def inner() -> None:
        done.set()

    def outer() -> float:
        t0 = time.monotonic()
        pools.post_ledger(inner, done.set)
        took.append(time.monotonic() - t0)
        return t0

    async def body() -> float:
        await warm(pools)
        t0 = await pools.ledger(outer)
        assert done.wait(10)
        return time.monotonic() - t0

    try:
        total = run(body)
    finally:
        pools.shutdown(wait=True)
    assert took[0] < 1.0, f"queueing from the lane's own thread waited {took[0]:.3f} s"
    assert total < 2.0, f"the inner call ran {total:.3f} s after the outer one started"
