"""Claims made ahead of a free slot for quick agents (``core.ahead``): in-process, with a real root and ledger.

The scheduler is driven the way the daemon's loop drives it (``test_seam_scheduler.Loop``);
agents are tiny ``sh`` programs that note their start in a file and run about 50 ms.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
from seam_fixtures import GOOD, Seam, open_seam, order, run, sh
from structlog.testing import capture_logs
from test_seam_scheduler import Loop

from dispatcher.clock import iso
from dispatcher.core.ahead import QUICK_S, RUNS_KEPT, Ahead, ClaimsAhead
from dispatcher.core.scheduler import Scheduler
from dispatcher.ledger.records import Gate, GateKind


def quick_agent(tmp: Path, seconds: float = 0.05) -> dict[str, Any]:
    """An agent that notes its job id in tmp/starts, runs `seconds`, and does its job right."""
    return sh(f'echo "$DISPATCH_JOB_ID" >> "{tmp / "starts"}"; sleep {seconds}; {GOOD}', concurrency=1)


def started(tmp: Path) -> list[str]:
    path = tmp / "starts"
    return path.read_text().split() if path.exists() else []


class Watch:
    """What a test sees at every turn: jobs claimed ahead, agents running at once, folders in active/."""

    def __init__(self, loop: Loop, s: Seam) -> None:
        self.loop, self.s = loop, s
        self.ahead: set[str] = set()
        self.most_running = 0
        self.active_while_running: set[str] = set()  # in active/ without an agent while another agent ran

    def look(self) -> None:
        sched = self.loop.sched
        self.ahead |= set(sched.ahead.ready)
        holding = [j for j, r in sched.running.items() if r.holds]
        self.most_running = max(self.most_running, len(holding))
        if holding:
            idle = set(os.listdir(self.s.layout.root / "active")) - set(sched.running)
            self.active_while_running |= idle

    async def until_done(self, *job_ids: str) -> None:
        def check() -> bool:
            self.look()
            return self.loop.landed("done", *job_ids)()

        await self.loop.until(check, f"{job_ids} to be done", timeout=20)
        await self.loop.settle()


def drop_spaced(loop: Loop, s: Seam, job_ids: list[str], **extra: Any) -> None:
    """Drop orders with distinct modification times, oldest first."""
    base = time.time() - 100
    for i, job_id in enumerate(job_ids):
        name = s.drop(order(job_id, **extra))
        os.utime(s.layout.inbox / name, (base + i, base + i))
        loop.s.inbox.hint("moved", name)


async def warmed_up(s: Seam) -> tuple[Loop, Watch]:
    """Run RUNS_KEPT jobs W0, W1, ... so that the agent's runs are known; nothing is claimed ahead meanwhile."""
    loop = Loop(s)
    watch = Watch(loop, s)
    warm = [f"W{i}" for i in range(RUNS_KEPT)]
    drop_spaced(loop, s, warm)
    await watch.until_done(*warm)
    assert not watch.ahead, "claimed ahead before the agent's runs were known"
    return loop, watch


def test_a_quick_agents_next_order_is_claimed_while_its_slot_is_busy_and_starts_in_order(tmp_path: Path) -> None:
    """After RUNS_KEPT quick runs, orders are claimed ahead; never more agents than max_jobs; starts keep order.

    Runs of 0.2 s: on a loaded machine a claim can take tens of milliseconds, and a run
    must outlast two of them to be claimed ahead.
    """
    with open_seam(tmp_path, {"worker": quick_agent(tmp_path, 0.2)}, max_jobs=1) as s:

        async def body() -> Watch:
            loop, watch = await warmed_up(s)
            jobs = [f"J{i}" for i in range(6)]
            drop_spaced(loop, s, jobs)
            await watch.until_done(*jobs)
            return watch

        watch = run(body, timeout=60)
    assert watch.ahead, "no order was claimed ahead"
    assert watch.active_while_running, "no job waited claimed in active/ while another ran"
    assert watch.most_running == 1
    assert started(tmp_path) == [f"W{i}" for i in range(RUNS_KEPT)] + [f"J{i}" for i in range(6)]


def test_a_job_claimed_ahead_starts_on_the_slot_before_the_job_that_gave_it_back_is_checked(tmp_path: Path) -> None:
    """The agent's exit hands its slot on at once: the next agent starts, then the ended job is checked.

    The root's small file work runs on the loop here (as for a root held in memory), where the
    ended job's checks would otherwise run to their end before the scheduler's next turn.
    """
    with open_seam(tmp_path, {"worker": quick_agent(tmp_path, 0.2)}, max_jobs=1) as s:
        s.lanes.files_in_memory = True

        async def body() -> None:
            loop, _ = await warmed_up(s)
            jobs = [f"H{i}" for i in range(5)]
            drop_spaced(loop, s, jobs)
            await loop.until(loop.landed("done", *jobs), "the jobs to be done", timeout=20)
            await loop.settle()

        with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:  # job_id is bound
            run(body, timeout=60)
    events = [(str(e["event"]), str(e.get("job_id"))) for e in logs]
    at = {pair: i for i, pair in enumerate(events)}
    handed = [
        (prev, nxt)
        for prev, nxt in itertools.pairwise([f"H{i}" for i in range(5)])
        if at[("job.claimed", nxt)] < at[("agent.exited", prev)]  # claimed ahead, waiting for prev's slot
    ]
    assert handed, f"no job was claimed ahead: {events}"
    for prev, nxt in handed:
        assert at[("agent.exited", prev)] < at[("agent.started", nxt)] < at[("job.verified", prev)], (prev, nxt, events)
    assert started(tmp_path)[RUNS_KEPT:] == [f"H{i}" for i in range(5)]


def test_an_order_with_expires_is_never_claimed_ahead(tmp_path: Path) -> None:
    """`expires` is refused (not failed) if it is not started in time: such an order waits unclaimed."""
    with open_seam(tmp_path, {"worker": quick_agent(tmp_path)}, max_jobs=1) as s:

        async def body() -> Watch:
            loop, watch = await warmed_up(s)
            jobs = [f"E{i}" for i in range(4)]
            drop_spaced(loop, s, jobs, expires=iso(time.time() + 3600))
            await watch.until_done(*jobs)
            return watch

        watch = run(body, timeout=60)
    assert not watch.ahead and not watch.active_while_running
    assert started(tmp_path)[RUNS_KEPT:] == [f"E{i}" for i in range(4)]


def test_a_cancel_of_a_job_claimed_ahead_fails_it_without_an_attempt(tmp_path: Path) -> None:
    with open_seam(tmp_path, {"worker": quick_agent(tmp_path, 0.3)}, max_jobs=1) as s:

        async def body() -> dict[str, Any]:
            loop, watch = await warmed_up(s)
            drop_spaced(loop, s, ["C0", "C1"])

            def c1_claimed_ahead() -> bool:
                watch.look()
                return "C1" in loop.sched.ahead.ready

            await loop.until(c1_claimed_ahead, "C1 to be claimed ahead")
            assert loop.sched.cancel("C1", "claimed")
            await loop.until(loop.landed("failed", "C1"), "C1 to fail")
            await watch.until_done("C0")
            return s.result("failed", "C1")

        result = run(body, timeout=60)
    assert result["reason"] == "cancelled" and result["attempts"] == []
    assert "C1" not in started(tmp_path)


# -- the rule, pure ---------------------------------------------------------------------------------
def test_quick_needs_enough_short_runs_that_outlast_a_claim() -> None:
    ahead = Ahead()
    for _ in range(RUNS_KEPT - 1):
        ahead.ran("a", 0.05)
    assert not ahead.quick("a", []), "too few runs known"
    ahead.ran("a", 0.05)
    assert ahead.quick("a", [0.01])
    assert not ahead.quick("a", [QUICK_S]), "one of its agents has been running long"
    ahead.claimed(0.03)  # a claim takes 30 ms: a 50 ms run does not outlast two
    assert not ahead.quick("a", [])
    ahead.ran("b", QUICK_S)
    ahead.ran("b", 0.1)
    ahead.ran("b", 0.1)
    assert not ahead.quick("b", []), "a long run among the last ones"


def test_a_ready_join_waiting_for_its_agents_slot_stops_claims_ahead_behind_it() -> None:
    """A join whose parents are done waits parked for its quick agent's next slot: no order of that agent behind it
    (parked or in inbox/) is claimed ahead, or each would take the slot first and the join would wait behind a
    stream of newer, lower-priority orders (section 16). Another agent's orders are claimed ahead as before."""
    import collections

    from dispatcher.core.work import Kind, Parked
    from dispatcher.spec.config import build_config

    ahead = Ahead()
    for agent in ("a", "b"):
        for _ in range(RUNS_KEPT):
            ahead.ran(agent, 0.05)
    cfg = build_config(
        {"root": "/nonexistent", "max_jobs": 4, "agents": {n: sh(GOOD, concurrency=1) for n in ("a", "b")}},
        None,
        root=Path("/nonexistent"),
    )
    join = Parked(Kind.JOINED, "J", "a", token=1, rank=(-7, 1.0))

    class Inbox:  # the next order in inbox/ is one of `agent`, read at a glance
        def __init__(self, agent: str) -> None:
            self.agent = agent

        def next_agent(self, gated: frozenset[str]) -> tuple[str, bool]:
            return (self.agent, False)

        def pop(self, gated: frozenset[str]) -> str:
            return f"{self.agent}-1.json"

    for head, want in (("a", []), ("b", ["b-1.json"])):
        parked = collections.deque([join])
        out, _agents = ahead.choose(cfg, parked, Inbox(head), frozenset(), lambda agent: [0.01])  # type: ignore[arg-type]
        ahead.claiming.clear()
        assert out == want and list(parked) == [join], (head, out)


def test_room_counts_jobs_claimed_ahead_and_in_the_claim_trip() -> None:
    ahead = Ahead()
    assert ahead.room("a", 2) == 2
    ahead.claiming["a"] += 1
    ahead.queued("J-1", "a")
    assert ahead.room("a", 2) == 0 and ahead.total() == 2
    ahead.started("J-1")
    assert ahead.room("a", 2) == 1


def test_when_max_jobs_limits_jobs_claimed_ahead_still_start_before_the_orders_behind_them(tmp_path: Path) -> None:
    """max_jobs 2 binds (agent A may run 3 at once): A's orders still start oldest first, at most 2 agents."""
    slow = sh(f'echo "$DISPATCH_JOB_ID" >> "{tmp_path / "starts"}"; sleep 0.3; {GOOD}')
    agents = {"worker": {**quick_agent(tmp_path, 0.2), "concurrency": 3}, "slow": slow}
    with open_seam(tmp_path, agents, max_jobs=2) as s:

        async def body() -> Watch:
            loop, watch = await warmed_up(s)
            drop_spaced(loop, s, ["B0"], to="slow")
            jobs = [f"A{i}" for i in range(8)]
            drop_spaced(loop, s, jobs)
            await watch.until_done("B0", *jobs)
            return watch

        watch = run(body, timeout=60)
    assert watch.ahead, "nothing was claimed ahead"
    assert watch.most_running <= 2
    assert [j for j in started(tmp_path) if j.startswith("A")] == [f"A{i}" for i in range(8)]


def test_a_job_set_aside_whose_gate_just_lifted_goes_before_the_hand_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B1, held by a gate, is let go as a `worker` agent exits: that slot goes to B1, as a turn would give it.

    The gate's time passes in the few milliseconds between the gate's `until` and the daemon's look at
    its gates; a job claimed ahead for `worker` waits at the head of the queue meanwhile.
    """
    gates: list[Gate] = []
    worker = sh(f'echo "$DISPATCH_JOB_ID" >> "{tmp_path / "starts"}"; sleep 0.2; {GOOD}', concurrency=1)
    other = sh(f'echo "$DISPATCH_JOB_ID" >> "{tmp_path / "starts"}"; {GOOD}', concurrency=1)
    run_job, agent_exited = Scheduler._run, Scheduler._agent_exited
    lifted: list[str] = []

    def launched(self: Scheduler, launch: Any, *, cancel: bool = False) -> None:
        if launch.parked.job_id == "B1" and not gates:
            gates.append(Gate("b", GateKind.PAUSE, None, "paused"))  # B1 meets it before its attempt
        run_job(self, launch, cancel=cancel)

    def exited(self: Scheduler, job_id: str, hand_on: bool) -> bool:
        ready = self.parked and self.parked[0].job_id in self.ahead.ready
        if self.running[job_id].job.agent == "worker" and len(self.aside) and ready and not lifted:
            gates[:] = [Gate("b", GateKind.LIMIT, time.time() - 0.001, "lifted")]  # its time just passed
            lifted.append(job_id)
        return agent_exited(self, job_id, hand_on)

    monkeypatch.setattr(Scheduler, "_run", launched)
    monkeypatch.setattr(Scheduler, "_agent_exited", exited)
    with open_seam(tmp_path, {"worker": worker, "b": other}, max_jobs=1) as s:
        s.ctx.gates = lambda: tuple(gates)

        async def body() -> None:
            loop, _ = await warmed_up(s)
            loop.drop(order("B1", to="b"))
            await loop.until(lambda: len(loop.sched.aside) == 1, "B1 to be set aside")
            jobs = [f"J{i}" for i in range(6)]
            drop_spaced(loop, s, jobs)
            await loop.until(loop.landed("done", *jobs, "B1"), "the jobs to be done", timeout=30)
            await loop.settle()

        run(body, timeout=60)
    assert lifted, "no job was claimed ahead when the gate lifted"
    starts = started(tmp_path)[RUNS_KEPT:]
    assert starts.index("B1") == starts.index(lifted[0]) + 1, (lifted, starts)


def test_a_hand_on_that_fails_leaves_the_job_to_the_next_turn_and_the_ended_job_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start at an agent's exit raises once: logged; the job claimed ahead starts at the next turn; none fails."""
    failed: list[str] = []
    start = ClaimsAhead._start_handed_over

    def once(self: ClaimsAhead, p: Any) -> bool:
        if not failed:  # the first start of a job claimed ahead: at an exit (a turn would raise it to the test)
            failed.append(p.job_id)
            raise RuntimeError("no start now")
        return start(self, p)

    monkeypatch.setattr(ClaimsAhead, "_start_handed_over", once)
    with open_seam(tmp_path, {"worker": quick_agent(tmp_path, 0.2)}, max_jobs=1) as s:

        async def body() -> None:
            loop, _ = await warmed_up(s)
            jobs = [f"F{i}" for i in range(4)]
            drop_spaced(loop, s, jobs)
            await loop.until(loop.landed("done", *jobs), "the jobs to be done", timeout=20)
            await loop.settle()

        with capture_logs() as logs:
            run(body, timeout=60)
    assert failed, "no start at an exit was tried"
    assert [e.get("step") for e in logs if e["event"] == "daemon.error"] == ["hand_on"]
    assert started(tmp_path)[RUNS_KEPT:] == [f"F{i}" for i in range(4)]
