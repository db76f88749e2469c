"""Gates and waits of a job (contract section 14): usage limits, pauses, daily cost caps.

A job asks ``Waits.hold`` before each attempt. While a gate holds its agent
(a usage limit another attempt met, a hand-set pause, a daily cap reached) the
job waits in active/, shown as ``waiting`` (a wait row in the ledger): it ends
its run as ``Outcome.GATED``, and the scheduler sets it aside without a slot
until its snapshot of the gates lets the agent go, then runs it again; that
``hold`` asks the ledger itself, and clears the wait row when no gate is left.
After an attempt that failed, ``limited``
reads the end of its output for the agent's ``limits:``; a match sets the
agent's gate in the ledger (every host honours it) and the attempt does not
count against ``max_attempts``.

The decisions (which gate holds, when a daily window allows again) are pure
functions; the ledger is asked in the ledger lane.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import structlog

from dispatcher.clock import iso
from dispatcher.lanes import Lanes
from dispatcher.ledger.base import EVERY_AGENT, Gate, GateKind, Ledger
from dispatcher.spec.jobspec import Attempt
from dispatcher.spec.limits import TAIL_BYTES, LimitHit, find_limit
from dispatcher.spec.settings import Agent, Config
from dispatcher.text import number

log = structlog.get_logger("dispatcher")
DAY_S = 24 * 3600.0


def holding(gates: Sequence[Gate], agent: str, at: float) -> Gate | None:
    """Return the gate that holds ``agent`` longest at ``at`` (a hand-set one first), or None."""
    held = [g for g in gates if g.holds(agent, at)]
    if not held:
        return None
    return max(held, key=lambda g: float("inf") if g.until is None else g.until)


def window_until(costs: Sequence[tuple[float, float]], cap: float, at: float) -> float | None:
    """Return when the last 24 hours' spend drops below ``cap`` again, or None if it is below now.

    ``costs`` are (finished, cost_usd), oldest first, all within the window at ``at``.
    """
    spent = sum(c for _, c in costs)
    if round(spent, 10) < cap:  # rounded as every cost sum is: 3 x 0.3 USD reaches a cap of 0.9
        return None
    for finished, cost in costs:
        spent -= cost
        if round(spent, 10) < cap:
            return finished + DAY_S
    return at + DAY_S


def _cap(cfg: Config, name: str) -> float | None:
    """Return the daily cap the config in force sets for ``name`` (an agent, or ``*`` for the root), or None."""
    if name == EVERY_AGENT:
        return cfg.max_daily_cost_usd
    agent = cfg.agents.get(name)
    return agent.max_daily_cost_usd if agent is not None else None


def _spent(costs: Sequence[tuple[float, str, float]], name: str) -> list[tuple[float, float]]:
    """Return the (finished, cost) rows of the window that count against ``name``'s cap (``*``: all of them)."""
    return [(t, c) for t, a, c in costs if name in (a, EVERY_AGENT)]


def budget_gates(costs: Sequence[tuple[float, str, float]], cfg: Config, agent: Agent, at: float) -> list[Gate]:
    """Return the daily-cap gates that hold ``agent`` (its own cap, the root's), from the window's costs."""
    out = []
    for name, cap in ((agent.name, agent.max_daily_cost_usd), (EVERY_AGENT, cfg.max_daily_cost_usd)):
        if cap is None:
            continue
        rows = _spent(costs, name)
        until = window_until(rows, cap, at)
        if until is not None:
            spent = round(sum(c for _, c in rows), 6)
            why = f"{number(spent)} USD in 24 h reached max_daily_cost_usd {number(cap)}"
            out.append(Gate(name, GateKind.BUDGET, until, why))
    return out


def unsupported_budget_gates(
    gates: Sequence[Gate], cfg: Config, costs_since: Callable[[float], Sequence[tuple[float, str, float]]], at: float
) -> list[Gate]:
    """Return the daily-cap gates the config no longer holds up: its cap removed or raised, so the window allows.

    ``costs_since`` reads the window's (finished, agent, cost) rows; it is asked only when a daily-cap gate exists.
    """
    budget = [g for g in gates if g.kind == GateKind.BUDGET]
    if not budget:
        return []
    window = costs_since(at - DAY_S)
    out = []
    for g in budget:
        cap = _cap(cfg, g.agent)
        if cap is None or window_until(_spent(window, g.agent), cap, at) is None:
            out.append(g)
    return out


def limit_texts(stdout_tail: bytes, stderr_tail: bytes) -> tuple[str, str]:
    """Return the texts limits are matched on: the last 64 KiB of stdout and of stderr."""
    return stdout_tail[-TAIL_BYTES:].decode("utf-8", "replace"), stderr_tail[-TAIL_BYTES:].decode("utf-8", "replace")


def waited_s(attempts: Sequence[Attempt]) -> float:
    """Return how long this job has waited for usage limits in all, the wait its last attempt was sent on included.

    A wait that ended early (``dispatcher resume``, a gate lifted) counts until the next
    attempt started; a next attempt that started late (no slot) counts no more than the wait.
    """
    total = 0.0
    ordered = sorted(attempts, key=lambda a: a.n)
    for i, a in enumerate(ordered):
        limited = a.extra.get("limited")
        if not (isinstance(limited, dict) and isinstance(limited.get("wait_s"), (int, float))):
            continue
        wait = float(limited["wait_s"])
        if i + 1 < len(ordered):
            wait = min(wait, max(0.0, ordered[i + 1].started - a.ended))
        total += wait
    return total


class Waits:
    """One job's gates: wait before an attempt, record a usage limit after one."""

    def __init__(
        self,
        job_id: str,
        ledger: Ledger,
        lanes: Lanes,
        config: Callable[[], Config],
        gates: Callable[[], Sequence[Gate]],
        notify: Callable[[str, str, str | None], None] | None = None,
        *,
        note: Callable[[Gate], None] = lambda gate: None,
        left_over: bool = False,
    ) -> None:
        self.job_id = job_id
        self.ledger = ledger
        self.lanes = lanes
        self.config = config
        self.gates = gates  # the daemon's snapshot of the ledger's gates (no trip to the ledger)
        self.notify = notify
        self.note = note  # tells the daemon's snapshot at once, so that no other attempt of the agent starts
        self.not_before_text: str | None = None
        self.not_before = 0.0  # a usage limit this job met itself: wait for it before the snapshot knows it
        self.waiting = False  # this job's wait is recorded (and job.waiting logged)
        self.waiting_until: float | None = None  # the gate's until as recorded (a later limit may move it)
        self.waiting_since: float | None = None  # when this wait began (epoch seconds)
        self.left_over = left_over  # a wait row of an earlier run may be left (a recovered job): the ledger decides

    def limited(self, agent: Agent, stdout_tail: bytes, stderr_tail: bytes, at: float) -> LimitHit | None:
        """Return the agent's usage limit found in an attempt's output, or None (pure but for the text)."""
        if not agent.limits:
            return None
        out, err = limit_texts(stdout_tail, stderr_tail)
        return find_limit(out + "\n" + err, agent.limits, at, (out, err))

    async def gate(self, agent: Agent, hit: LimitHit) -> None:
        """Gate ``agent`` until the limit's time on every host; log agent.limited (and agent.gated)."""
        if hit.until > self.not_before:
            self.not_before, self.not_before_text = hit.until, hit.text
        log.warning("agent.limited", job_id=self.job_id, agent=agent.name, until=iso(hit.until), text=hit.text)
        gate = Gate(agent.name, GateKind.LIMIT, hit.until, hit.text)
        self.note(gate)
        if await self.lanes.ledger(self._set, gate, time.time()):
            log.warning("agent.gated", agent=agent.name, kind=str(GateKind.LIMIT), until=iso(hit.until))

    def _set(self, gate: Gate, at: float) -> bool:
        return self.ledger.set_gate(gate, at=at)

    async def hold(self, agent: Agent) -> Gate | None:
        """Return the gate that holds ``agent`` now, or None once none does.

        The first time a gate holds the job, its wait is recorded (``waiting`` in
        `status`) and ``job.waiting`` is logged; the next call asks the ledger
        itself, and clears the wait when the gate is gone. A gate the daemon's
        snapshot does not know yet is noted there, so that the job stays aside.
        """
        gate = await self._holding(agent, fresh=self.waiting or self.left_over)
        if gate is None:
            await self.release()
            return None
        if not self.waiting:
            self.waiting, self.waiting_until, self.waiting_since = True, gate.until, time.time()
            await self.lanes.ledger(self.ledger.set_gate_wait, self.job_id, agent.name, gate.until)
            log.info("job.waiting", job_id=self.job_id, agent=agent.name, kind=gate.kind,
                     until=iso(gate.until) if gate.until is not None else None, reason=gate.reason)  # fmt: skip
        elif gate.until != self.waiting_until:  # another attempt's limit moved the gate: `status` shows the new time
            self.waiting_until = gate.until
            await self.lanes.ledger(self.ledger.set_gate_wait, self.job_id, agent.name, gate.until)
        if holding(self.gates(), agent.name, time.time()) is None:
            self.note(gate)
        return gate

    async def release(self) -> None:
        """Clear this job's wait row if it may have one (the job runs or ends now)."""
        if self.waiting or self.left_over:
            await self.lanes.ledger(self.ledger.clear_gate_wait, self.job_id)
            self.waiting = self.left_over = False
            self.waiting_since = None

    async def _holding(self, agent: Agent, *, fresh: bool) -> Gate | None:
        """Return the gate holding the agent now: the snapshot, this job's own limit, a daily cap."""
        now = time.time()
        if not fresh and self.not_before > now:  # the snapshot may not know it yet; a later gate it knows wins
            own = Gate(agent.name, GateKind.LIMIT, self.not_before, self.not_before_text)
            return holding([*self.gates(), own], agent.name, now)
        cfg = self.config()
        agent = cfg.agents.get(agent.name, agent)  # a cap a reload set, raised or removed counts from now on
        capped = agent.max_daily_cost_usd is not None or cfg.max_daily_cost_usd is not None
        if not fresh and not capped:
            return holding(self.gates(), agent.name, now)
        return await self.lanes.ledger(self._ask, agent, cfg, now, capped)

    def _ask(self, agent: Agent, cfg: Config, now: float, capped: bool) -> Gate | None:
        """Read the gates (and, with a daily cap, the window's spend) from the ledger (ledger lane)."""
        gates = self.ledger.gates()
        if capped:
            for gate in budget_gates(self.ledger.costs_since(now - DAY_S), cfg, agent, now):
                if self.ledger.set_gate(gate, at=now):
                    log.warning("budget.gated", agent=gate.agent, until=iso(gate.until or now), reason=gate.reason)
                    if self.notify is not None:
                        self.notify(gate.agent, self.job_id, gate.reason)
                gates.append(gate)
        return holding(gates, agent.name, now)
