"""In-process tests of ``core.scheduler.Scheduler``: slots, parked work, blocked agents, retry and cancel requests.

Each test drives the scheduler the way the daemon's loop does (``start_work`` once a
turn, a turn whenever something wakes it), against a real root, a real SQLite ledger
and tiny ``sh`` agents, in-process, like rq's ``work(burst=True)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from seam_fixtures import GOOD, Seam, open_seam, order, run, sh

from dispatcher.core.claiming import BIG_ORDER_BYTES
from dispatcher.core.scheduler import Scheduler
from dispatcher.core.work import Kind
from dispatcher.ledger.base import Request
from dispatcher.lifecycle import Outcome, Row, Stop


def gated(gate: Path) -> str:
    """Return an agent script that waits for the gate file, then does its job right."""
    return f'while [ ! -e "{gate}" ]; do sleep 0.01; done; {GOOD}'


class Loop:
    """The daemon's loop in miniature: one ``start_work`` per turn, a turn on each wake (or every 20 ms)."""

    def __init__(self, s: Seam) -> None:
        self.s = s
        self.woken = asyncio.Event()
        s.inbox.wake = self.woken.set
        self.sched = Scheduler(s.ctx, s.inbox, self.woken.set)

    def drop(self, body: dict[str, Any] | bytes, name: str | None = None) -> str:
        """Drop an order into inbox/ and hint it, as the watch does for a rename."""
        name = self.s.drop(body, name)
        self.s.inbox.hint("moved", name)
        return name

    async def until(self, predicate: Callable[[], Any], what: str, timeout: float = 8.0) -> None:
        """Take turns until predicate holds; fail after timeout."""
        end = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < end, f"timed out after {timeout} s waiting for {what}"
            self.woken.clear()
            self.sched.start_work()
            with contextlib.suppress(TimeoutError):  # a turn at least every 20 ms, as the daemon's slot poll
                await asyncio.wait_for(self.woken.wait(), 0.02)

    async def settle(self) -> None:
        """Wait for every running job and background step of the scheduler."""
        await self.until(lambda: not self.sched.busy(), "the scheduler to be idle")
        await self.sched.drain()

    def landed(self, state: str, *job_ids: str) -> Callable[[], bool]:
        """Return a predicate: each job has result.json in state's folder."""
        return lambda: all((self.s.layout.root / state / j / "result.json").exists() for j in job_ids)


def note_starts(sched: Scheduler) -> list[str]:
    """Return a list that gets the job id of each job the scheduler starts, in order."""
    started: list[str] = []
    launch = sched._run

    def run_and_note(*args: Any, **kwargs: Any) -> None:
        started.append(args[0].parked.job_id)
        launch(*args, **kwargs)

    sched._run = run_and_note  # type: ignore[method-assign]
    return started


def test_a_fresh_scheduler_has_max_jobs_free_slots_and_nothing_to_do(tmp_path: Path) -> None:
    """free_slots is max_jobs with nothing running; start_work with an empty inbox starts nothing."""
    with open_seam(tmp_path, max_jobs=3) as s:

        async def body() -> tuple[int, bool]:
            loop = Loop(s)
            loop.sched.start_work()
            return loop.sched.free_slots(), loop.sched.busy()

        assert run(body) == (3, False)


def test_start_work_takes_no_more_orders_than_free_slots(tmp_path: Path) -> None:
    """With max_jobs 2 and three ready orders, two are claimed at once and the third stays ready in the inbox."""
    gate = tmp_path / "go"
    with open_seam(tmp_path, {"worker": sh(gated(gate), concurrency=3)}, max_jobs=2) as s:

        async def body() -> tuple[int, list[str], int, list[str]]:
            loop = Loop(s)
            for i in range(3):
                loop.drop(order(f"J{i}"))
            loop.sched.start_work()
            claiming = loop.sched.free_slots()
            await loop.until(lambda: len(loop.sched.running) == 2, "two jobs to run")
            running, free = sorted(loop.sched.running), loop.sched.free_slots()
            still = sorted(os.listdir(s.layout.inbox))
            gate.touch()
            await loop.until(loop.landed("done", "J0", "J1", "J2"), "every job to be done")
            await loop.settle()
            return claiming, running, free, still

        claiming, running, free, still = run(body)
        assert claiming == 0  # the two claims in flight hold the slots
        assert running == ["J0", "J1"] and free == 0
        assert still == ["J2.json"]
        assert sorted(os.listdir(s.layout.root / "done")) == ["J0", "J1", "J2"]


def test_an_agent_at_its_concurrency_waits_parked_without_blocking_other_agents(tmp_path: Path) -> None:
    """A second order for a busy agent (concurrency 1) is parked and its agent blocked; another agent still starts."""
    gate = tmp_path / "go"
    agents = {"worker": sh(gated(gate)), "helper": sh(gated(gate))}
    with open_seam(tmp_path, agents, max_jobs=3) as s:

        async def body() -> tuple[list[str], list[str], bool, list[str]]:
            loop = Loop(s)
            loop.drop(order("W1"))
            loop.drop(order("W2"))
            await loop.until(lambda: loop.sched.parked and loop.sched.running, "W2 to be parked")
            loop.drop(order("H1", to="helper"))
            seen: list[tuple[list[str], list[str], bool]] = []

            def h1_runs_while_w2_waits() -> bool:
                sched = loop.sched
                seen.append((sorted(sched.running), [p.job_id for p in sched.parked], "worker" in sched.blocked))
                return "H1" in sched.running and bool(sched.parked)

            await loop.until(h1_runs_while_w2_waits, "H1 to run while W2 waits")
            running, parked, blocked = seen[-1]
            gate.touch()
            await loop.until(loop.landed("done", "W1", "W2", "H1"), "every job to be done")
            await loop.settle()
            return running, parked, blocked, sorted(os.listdir(s.layout.root / "done"))

        running, parked, blocked, done = run(body)
        assert running == ["H1", "W1"]
        assert parked == ["W2"] and blocked
        assert done == ["H1", "W1", "W2"]


def test_a_slot_given_back_goes_to_the_agents_parked_order_before_a_newer_one(tmp_path: Path) -> None:
    """An agent blocked by a claim's late "no slot" answer still gives its slot back to its oldest order.

    W1 runs, W2 waits parked. As W1's agent exits, the answer of a claim trip sent before
    the exit blocks the agent again, and W3 arrives in inbox/. The slot W1 gave back goes
    to W2, the older order, not to W3 read after it.
    """
    gate = tmp_path / "go"
    with open_seam(tmp_path, {"worker": sh(gated(gate))}, max_jobs=2) as s:

        async def body() -> list[str]:
            loop = Loop(s)
            sched = loop.sched
            exited = sched._agent_exited

            def exit_then_late_answer(job_id: str, hand_on: bool) -> bool:
                gave_back = exited(job_id, hand_on)
                if job_id == "W1":  # a "no slot" answer of a trip sent before the exit, and a new order
                    sched.blocked["worker"] = time.monotonic() + 30
                    loop.drop(order("W3"))
                return gave_back

            sched._agent_exited = exit_then_late_answer  # type: ignore[method-assign]
            started = note_starts(sched)
            loop.drop(order("W1"))
            await loop.until(lambda: "W1" in sched.running, "W1 to run")
            loop.drop(order("W2"))
            await loop.until(lambda: [p.job_id for p in sched.parked] == ["W2"], "W2 to be parked")
            gate.touch()
            await loop.until(lambda: len(started) >= 2, "a second job to start", timeout=20)
            sched.blocked.clear()
            await loop.until(loop.landed("done", "W1", "W2", "W3"), "every job to be done", timeout=20)
            await loop.settle()
            return started

        assert run(body) == ["W1", "W2", "W3"]


def test_a_parked_order_in_a_claims_trip_keeps_its_place_when_a_slot_comes_back_meanwhile(tmp_path: Path) -> None:
    """W2 goes on a claim's trip while W1 still runs (it will answer "no slot"); W1 exits meanwhile.

    The slot W1 gives back goes to W2 once its trip is back, not to W3 sent after it.
    """
    gate = tmp_path / "go"
    with open_seam(tmp_path, {"worker": sh(gated(gate))}, max_jobs=2) as s:

        async def body() -> list[str]:
            loop = Loop(s)
            sched = loop.sched
            started = note_starts(sched)
            loop.drop(order("W1"))
            await loop.until(lambda: "W1" in sched.running, "W1 to run")
            loop.drop(order("W2"))
            loop.drop(order("W3"))
            await loop.until(lambda: [p.job_id for p in sched.parked] == ["W2", "W3"], "W2 and W3 parked")
            lane_free = threading.Event()
            hold = asyncio.ensure_future(s.lanes.ledger(lane_free.wait, 30))  # trips queue behind it
            sched.blocked.clear()  # the 0.25 s "no slot" wait ran out while W1 still runs
            sched.start_work()  # W2 is sent; it will answer "no slot"
            assert [p.job_id for p in sched.parked] == ["W3"]
            gate.touch()
            await loop.until(lambda: sched.slots.idle.get("worker"), "W1's slot to come back")
            for _ in range(5):  # turns while W2's trip waits in the lane
                sched.start_work()
                await asyncio.sleep(0.02)
            lane_free.set()
            await hold
            await loop.until(loop.landed("done", "W1", "W2", "W3"), "every job to be done", timeout=20)
            await loop.settle()
            return started

        assert run(body) == ["W1", "W2", "W3"]


def test_finished_jobs_are_counted_by_how_they_ended(tmp_path: Path) -> None:
    """stats.finished counts done, failed and refused jobs (a bad file and a second file with a known id)."""
    agents = {"worker": sh(GOOD), "failer": sh("exit 2")}
    with open_seam(tmp_path, agents, max_jobs=2) as s:

        async def body() -> dict[str, int]:
            loop = Loop(s)
            loop.drop(order("J1"))
            loop.drop(order("J2", to="failer"))
            loop.drop(b"not: [an order", "bad.yaml")
            await loop.until(loop.landed("done", "J1"), "J1 to be done")
            await loop.until(loop.landed("failed", "J2"), "J2 to fail")
            await loop.until(lambda: loop.sched.stats.finished["refused"], "bad.yaml to be refused")
            loop.drop(order("J1"), "dup.json")  # a known id: the claim's answer drops it as refused
            await loop.until(lambda: loop.sched.stats.finished["refused"] == 2, "dup.json to be refused")
            await loop.settle()
            return dict(loop.sched.stats.finished)

        assert run(body) == {"done": 1, "failed": 1, "refused": 2, "review": 0}
        refusals = sorted(p.name.split("@")[0] for p in (s.layout.root / "failed").iterdir() if "@" in p.name)
        assert refusals == ["bad", "dup"]


def test_an_order_too_large_for_the_claim_trip_is_read_aside_and_runs(tmp_path: Path) -> None:
    """An order above BIG_ORDER_BYTES is read in the io pool, then claimed and run like any other."""
    with open_seam(tmp_path) as s:

        async def body() -> None:
            loop = Loop(s)
            loop.drop(order("BIG", meta={"notes": "x" * (BIG_ORDER_BYTES + 1)}))
            await loop.until(loop.landed("done", "BIG"), "the large order to be done")
            await loop.settle()

        run(body)
        assert s.result("done", "BIG")["state"] == "done"


def test_recovered_jobs_start_before_new_orders(tmp_path: Path) -> None:
    """park_recovered puts adopted jobs first: with one slot, the recovered job runs while the new order waits."""
    gate = tmp_path / "go"
    with open_seam(tmp_path, {"worker": sh(gated(gate), concurrency=2)}, max_jobs=1) as s:
        adopted = s.started("OLD")

        async def body() -> tuple[list[str], list[str]]:
            loop = Loop(s)
            loop.drop(order("NEW"))
            loop.sched.park_recovered([("OLD", adopted.token, "worker")])
            assert loop.sched.parked[0].kind is Kind.RECOVER
            await loop.until(lambda: loop.sched.running, "a job to run")
            first = sorted(loop.sched.running)
            gate.touch()
            await loop.until(loop.landed("done", "OLD", "NEW"), "both jobs to be done")
            await loop.settle()
            return first, sorted(os.listdir(s.layout.root / "done"))

        assert run(body) == (["OLD"], ["NEW", "OLD"])


def test_a_retry_request_reopens_a_failed_job_once_and_runs_it_again(tmp_path: Path) -> None:
    """park_retry of a failed job with a retry request (asked twice) parks it once; it reruns and ends done."""
    mark = tmp_path / "failed-once"
    script = f'[ -e "{mark}" ] || {{ touch "{mark}"; exit 1; }}; {GOOD}'
    with open_seam(tmp_path, {"worker": sh(script)}) as s:

        async def body() -> int:
            loop = Loop(s)
            loop.drop(order("J1"))
            await loop.until(loop.landed("failed", "J1"), "J1 to fail")
            await loop.settle()
            s.ledger.request("J1", Request.RETRY)  # what `dispatcher retry J1` records
            loop.sched.park_retry("J1", "worker")
            loop.sched.park_retry("J1", "worker")
            parked = len(loop.sched.parked)
            await loop.until(loop.landed("done", "J1"), "J1 to be done after the retry")
            await loop.settle()
            return parked

        assert run(body) == 1
        assert [a["exit_code"] for a in s.result("done", "J1")["attempts"]] == [1, 0]
        assert os.listdir(s.layout.root / "failed") == []


def test_a_retry_without_an_open_request_leaves_the_job_failed(tmp_path: Path) -> None:
    """park_retry of a failed job whose retry request was already carried out reopens nothing: it stays failed."""
    with open_seam(tmp_path, {"worker": sh("exit 1")}) as s:

        async def body() -> None:
            loop = Loop(s)
            loop.drop(order("J1"))
            await loop.until(loop.landed("failed", "J1"), "J1 to fail")
            loop.sched.park_retry("J1", "worker")
            await loop.settle()

        run(body)
        assert os.listdir(s.layout.root / "failed") == ["J1"]
        assert len(s.result("failed", "J1")["attempts"]) == 1


def test_a_cancel_stops_a_running_job_and_it_fails_cancelled(tmp_path: Path) -> None:
    """cancel of a running job aborts it through its Control: it lands in failed/ with reason cancelled."""
    with open_seam(tmp_path, {"worker": sh(gated(tmp_path / "never"))}) as s:

        async def body() -> bool:
            loop = Loop(s)
            loop.drop(order("J1"))
            await loop.until(lambda: "J1" in loop.sched.running, "J1 to run")
            answered = loop.sched.cancel("J1", str(Row.CLAIMED))
            await loop.until(loop.landed("failed", "J1"), "J1 to fail")
            await loop.settle()
            return answered

        assert run(body) is True
        assert s.result("failed", "J1")["reason"] == "cancelled"


def test_a_cancel_of_parked_work_claims_it_at_once_and_fails_it_without_an_attempt(tmp_path: Path) -> None:
    """A parked order with a cancel request is claimed without a slot and lands in failed/ with no attempt."""
    gate = tmp_path / "go"
    with open_seam(tmp_path, {"worker": sh(gated(gate))}, max_jobs=2) as s:

        async def body() -> tuple[bool, dict[str, int]]:
            loop = Loop(s)
            loop.drop(order("J1"))
            loop.drop(order("J2"))
            await loop.until(lambda: [p.job_id for p in loop.sched.parked] == ["J2"], "J2 to be parked")
            s.ledger.request("J2", Request.CANCEL)
            answered = loop.sched.cancel("J2", None)
            await loop.until(loop.landed("failed", "J2"), "J2 to fail")
            gate.touch()
            await loop.until(loop.landed("done", "J1"), "J1 to be done")
            await loop.settle()
            return answered, dict(loop.sched.stats.finished)

        answered, stats = run(body)
        result = s.result("failed", "J2")
        assert answered is True
        assert result["reason"] == "cancelled" and result["attempts"] == []
        assert stats["failed"] == 1 and stats["done"] == 1


def test_a_cancel_of_an_unread_inbox_order_claims_it_now_and_fails_it(tmp_path: Path) -> None:
    """cancel answers False for an id not seen yet; claim_now of its inbox file fails it cancelled, slot or not."""
    with open_seam(tmp_path, max_jobs=1) as s:

        async def body() -> tuple[bool, bool]:
            loop = Loop(s)
            name = s.drop(order("J1"))  # no hint: the scheduler has not read it
            s.ledger.request("J1", Request.CANCEL)
            unknown = loop.sched.cancel("J1", None)
            loop.sched.claim_now(name)
            await loop.until(loop.landed("failed", "J1"), "J1 to fail")
            await loop.settle()
            return unknown, loop.sched.cancel("J1", str(Row.FAILED))

        assert run(body) == (False, True)
        assert s.result("failed", "J1")["reason"] == "cancelled"
        assert os.listdir(s.layout.inbox) == []


def test_a_job_left_by_a_stop_is_not_counted_as_finished(tmp_path: Path) -> None:
    """Jobs aborted by a stop end LEFT: they stay in active/ and no finish is counted."""
    with open_seam(tmp_path, {"worker": sh(gated(tmp_path / "never"))}) as s:

        async def body() -> tuple[Outcome, dict[str, int]]:
            loop = Loop(s)
            loop.drop(order("J1"))
            await loop.until(lambda: "J1" in loop.sched.running, "J1 to run")
            task = loop.sched.running["J1"].task
            s.stopping = True
            loop.sched.abort_all(Stop.STOPPED)
            outcome = await task
            await loop.sched.drain()
            return outcome, dict(loop.sched.stats.finished)

        outcome, stats = run(body)
        assert outcome is Outcome.LEFT
        assert stats == {"done": 0, "failed": 0, "refused": 0, "review": 0}
        assert os.listdir(s.layout.root / "active") == ["J1"]
