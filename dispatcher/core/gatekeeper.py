"""The daemon's view of the agents' gates (contract section 14), kept fresh from the ledger.

While a gate is set, or when the ledger is shared by other hosts, one trip to the
ledger lane every ``POLL_S`` seconds lifts the gates whose time has come
(``agent.resumed`` is logged by the daemon that lifts one: each is lifted once, on
any host) and reads the rest. With no gate on a ledger of this host alone, the
snapshot changes only through this daemon (``note``) or a command (`pause`,
`resume`, which drop a hint: ``kick``), so an idle daemon reads it only every
``idle_s`` seconds and costs no CPU in between. The scheduler claims no new order
of a gated agent; jobs read the snapshot before each attempt without a trip to
the ledger. A change wakes the loop, and the metric ``dispatcher_agent_gated``
follows the snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import structlog

from dispatcher.clock import iso
from dispatcher.lanes import Lanes
from dispatcher.ledger.base import EVERY_AGENT, Gate, Ledger

if TYPE_CHECKING:
    from dispatcher.metrics import Metrics

log = structlog.get_logger("dispatcher")
POLL_S = 1.0
DUE_SLACK_S = 0.005  # a gate is lifted this long after its time, so that the time has surely passed


def gated_agents(gates: Iterable[Gate], agents: Iterable[str], at: float) -> set[str]:
    """Return the agents a gate holds at ``at`` (a gate of ``*`` holds every agent).

    Only ``agents`` (the configured ones) are held: an order for a name the config no longer has is
    read, and refused as any order naming an unknown agent is, whatever gate that name kept.
    """
    names = set(agents)
    out: set[str] = set()
    for g in gates:
        if g.until is not None and g.until <= at:
            continue
        if g.agent == EVERY_AGENT:
            out |= names
        elif g.agent in names:
            out.add(g.agent)
    return out


class GateKeeper:
    """A snapshot of the ledger's gates, refreshed in the background while the daemon runs."""

    def __init__(
        self,
        ledger: Ledger,
        lanes: Lanes,
        agents: Callable[[], Iterable[str]],
        wake: Callable[[], None],
        metrics: Metrics | None = None,
        *,
        shared: bool = False,
        idle_s: float = 30.0,
        stale: Callable[[list[Gate], float], list[Gate]] | None = None,
    ) -> None:
        self.ledger = ledger
        self.stale = stale  # gates the config no longer holds up (a daily cap removed or raised): lifted
        self.shared = shared  # other hosts may set gates: read them every POLL_S
        self.idle_s = idle_s
        self.lanes = lanes
        self.agents = agents
        self.wake = wake
        self.metrics = metrics
        self.snapshot: tuple[Gate, ...] = ()
        self._task: asyncio.Task[None] | None = None
        self._kicked: asyncio.Event | None = None
        self._due: float | None = None  # the time of the soonest gate this daemon set (``note``)

    def gates(self) -> tuple[Gate, ...]:
        """Return the latest snapshot (no trip to the ledger)."""
        return self.snapshot

    def note(self, gate: Gate) -> None:
        """Add a gate this daemon just set to the snapshot (on the loop), before the ledger is read again.

        Its time is remembered apart from the snapshot (a read of the ledger made before the gate
        is written there would drop it), so that the gate is lifted when its time comes.
        """
        self.snapshot = (*self.snapshot, gate)
        if gate.until is not None and (self._due is None or gate.until < self._due):
            self._due = gate.until
        self.wake()
        self.kick()  # the background wait is measured again: at most until this gate's time

    def _wait_s(self, now: float) -> float:
        """Return how long the background refresh sleeps: POLL_S while gates exist, never past the next one's time."""
        wait = POLL_S if self.snapshot or self.shared else self.idle_s
        if self._due is not None and self._due <= now:
            self._due = None  # lifted by the refresh that just ran
        dues = [g.until for g in self.snapshot if g.until is not None and g.until > now]
        if self._due is not None:
            dues.append(self._due)
        if dues:
            wait = min(wait, min(dues) - now + DUE_SLACK_S)
        return max(wait, 0.0)

    def gated(self) -> set[str]:
        """Return the agents the snapshot holds now."""
        return gated_agents(self.snapshot, self.agents(), time.time())

    async def refresh(self) -> None:
        """Lift expired gates (logging agent.resumed) and read the others; wake the loop on a change."""
        lifted, gates = await self.lanes.ledger(self._read, time.time())
        for g in lifted:
            log.info("agent.resumed", agent=g.agent, kind=g.kind, until=iso(g.until) if g.until else None)
        changed = tuple(gates) != self.snapshot
        self.snapshot = tuple(gates)
        self.publish()
        if changed or lifted:
            self.wake()

    def publish(self) -> None:
        """Set ``dispatcher_agent_gated`` from the snapshot (at each refresh, and when metrics start)."""
        if self.metrics is not None:
            held = self.gated()
            self.metrics.set_gated({a: int(a in held) for a in self.agents()})

    def _read(self, now: float) -> tuple[list[Gate], list[Gate]]:
        """Read the gates; lift the expired and stale ones (a write) only when there are some (ledger lane)."""
        gates = self.ledger.gates()
        stale = self.stale(gates, now) if self.stale is not None else []
        expired = any(g.until is not None and g.until <= now for g in gates)
        if not expired and not stale:
            return [], gates
        lifted = self.ledger.lift_gates(expired_at=now) if expired else []
        for g in stale:
            if all((g.agent, g.kind) != (x.agent, x.kind) for x in lifted):
                lifted += self.ledger.lift_gates(g.agent, kind=g.kind)
        return lifted, self.ledger.gates()

    def start(self) -> None:
        """Refresh in the background until stopped (see the module's docstring for how often)."""
        self._kicked = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="gatekeeper")

    def kick(self) -> None:
        """Refresh now (a command changed the gates and dropped a hint)."""
        if self._kicked is not None:
            self._kicked.set()

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - a ledger that is away: try again next turn
                if not self.ledger.giving_up():  # a wait a stop gave up is no error
                    log.warning("daemon.error", step="gates", error=str(exc))
            assert self._kicked is not None  # noqa: S101 - set by start()
            # not asyncio.wait_for: on 3.11 it drops a cancel that comes in the turn a kick ends the wait
            # (python/cpython#86296), and the stop then waits for the next idle read
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._wait_s(time.time())):
                    await self._kicked.wait()
            self._kicked.clear()

    async def stop(self) -> None:
        """End the background refresh."""
        task = self._task
        if task is not None:
            task.cancel()
            await asyncio.wait({task})  # the refresh's end, not its CancelledError; a cancel of the stop itself goes on
