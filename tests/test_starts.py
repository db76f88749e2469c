"""``job.starting.Starts``: a finished job's checks wait for agents being started, never long."""

from __future__ import annotations

import asyncio

from seam_fixtures import run

from dispatcher.job.starting import WAIT_MAX_S, Starts


def test_quiet_returns_at_once_when_nothing_starts() -> None:
    async def body() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await Starts().quiet()
        return loop.time() - t0

    assert run(body) < 0.01


def test_quiet_waits_for_the_last_start_and_tells_the_scheduler() -> None:
    async def body() -> tuple[list[str], int]:
        starts = Starts()
        seen: list[str] = []
        starts.on_quiet = lambda: seen.append("quiet")
        starts.begin()
        starts.begin()

        async def waiter() -> None:
            await starts.quiet()
            seen.append("checks")

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        starts.end()
        await asyncio.sleep(0)
        seen.append("one start left")
        starts.end()
        await task
        return seen, starts.count

    seen, count = run(body)
    assert seen == ["one start left", "quiet", "checks"] and count == 0


def test_quiet_never_waits_longer_than_its_limit() -> None:
    """A start that hangs (a slow fork, a full disk) holds a finished job's checks up by WAIT_MAX_S at most."""

    async def body() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        starts = Starts()
        starts.begin()
        t0 = loop.time()
        await starts.quiet()
        first = loop.time() - t0
        t0 = loop.time()
        await starts.quiet()  # still starting: a new wait, limited again
        return first, loop.time() - t0

    first, second = run(body)
    assert WAIT_MAX_S * 0.9 <= first < WAIT_MAX_S + 0.5
    assert WAIT_MAX_S * 0.9 <= second < WAIT_MAX_S + 0.5
